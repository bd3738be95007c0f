"""Iteration times of a model before and beside its calibration profile.

`DefaultCpuTimes`: a linear model fitted by hand to the demo model's measured iteration
times (docs/openvino.md) and scaled by weight size, for a CPU instance without a profile;
`prior_profile` puts it on a profile's grid, what the cluster dispatcher plans a model's
instances with before the model is calibrated. `AdaptiveTimes` wraps either (or a
profile's `mesh.perf.model.PerformanceModel`) and corrects it with the iteration times the
node really sees (the agent feeds it the node's iteration records).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mesh.perf.profile import Profile
from mesh.policy.batching import IterationKind, IterationTimes

MARGIN_EVERY = 8  # AdaptiveTimes recomputes its learnt margin every this many iterations
# AdaptiveTimes.relax: after this long without an iteration, the learnt factors move back
# toward their start, halving their (log) distance every RELAX_HALF_LIFE_S.
RELAX_AFTER_S = 10.0
RELAX_HALF_LIFE_S = 30.0
DEMO_WEIGHT_BYTES = 98_362_432  # SmolLM2-135M Q4_1, the model DefaultCpuTimes was fitted on


@dataclass(frozen=True, slots=True)
class DefaultCpuTimes:
    """Linear iteration times for a CPU instance without a calibration profile.

    Fitted to SmolLM2-135M on 2 shared cores (docs/openvino.md): prefill about 1.1 ms per
    prompt token plus 20 ms; decode 9.5 ms + 1.1 ms per request + 4.6 us per request per
    token of context. Other models scale by weight size (decode on CPU is bound by reading
    the weights), never below the demo's times. A rough prior: AdaptiveTimes corrects it.
    """

    scale: float = 1.0

    @classmethod
    def for_weights(cls, weight_bytes: int) -> "DefaultCpuTimes":
        return cls(max(1.0, weight_bytes / DEMO_WEIGHT_BYTES))

    def prefill_s(self, prompt_len: int) -> float:
        return self.scale * (0.020 + 0.0011 * prompt_len)

    def decode_s(self, batch: int, avg_context: float) -> float:
        return self.scale * (0.0095 + 0.0011 * batch + 4.6e-6 * batch * avg_context)


class AdaptiveTimes:
    """Iteration times from a base model, corrected per grid region by real iterations.

    `observe(kind, predicted, actual, batch, tokens)` moves the factor of the iteration's
    region toward actual/predicted with weight `prefill_alpha` or `alpha` (geometric,
    clamped to [min_factor, max_factor]). A region is a cell of the profile's 2^k grids:
    prefills by floor(log2(prompt tokens)), decodes by (floor(log2(batch)), floor(log2(mean
    context))); a region not observed yet uses the instance-wide factor (`prefill_factor`,
    `decode_factor`, learnt from every iteration of that kind), so the model is refined
    where the node runs and falls back to the whole-instance correction elsewhere. A machine
    busier or faster than the profile's stays predicted within a few iterations while one
    slow outlier moves it little: an observation's ratio counts at most `max_step` times (or
    1/`max_step`) the prediction, so an iteration that compiled a new shape (seconds, on a
    fresh instance) cannot throw the factor to its clamp; sustained slowness still gets
    there, a few iterations later. `drift()` summarises how far the profile is off.

    The learnt margin (`margin`): once `margin_after` iterations were observed, the
    `margin_quantile` of actual/predicted over the last `margin_window` iterations, minus 1,
    bounded to [min_margin, max_margin], recomputed every MARGIN_EVERY iterations; None before that (shadow validation
    then uses the node's margin, LLM-Mesh's 10%). Shadow validation reads it per instance.

    Stale slowness fades (`relax`): factors are learnt only from iterations, and the
    admissions they drive decide whether iterations run. A node that learnt a 7-8x slowdown
    while other jobs took its cores predicts a lone 158-token prompt past the 2 s TTFT SLO
    (with the margin), so every request waits and none runs to correct it, long after
    the other jobs left (docs/benchmarking.md, "Where a token's time goes"). Past
    RELAX_AFTER_S without an iteration (or since the first `relax` where none ran yet) the
    factors move back toward `start`, the node's probed speed for the prior (half-life
    RELAX_HALF_LIFE_S); the next iterations learn the machine as it is then.
    """

    def __init__(self, base: IterationTimes, alpha: float = 0.2, prefill_alpha: float = 0.4,
                 min_factor: float = 0.25, max_factor: float = 8.0, *, margin_quantile: float = 0.95,
                 margin_window: int = 256, margin_after: int = 32, min_margin: float = 0.05,
                 max_margin: float = 0.5, max_step: float = 2.0, start: tuple[float, float] = (1.0, 1.0)) -> None:
        """`start`: the (prefill, decode) factors before any iteration: the node's speed
        against the prior's machine (mesh.perf.speed), or what an earlier
        instance of the model learnt here (`warm_start`); 1.0: the base as it is."""
        self.base = base
        self.max_step = max_step
        self.alpha = alpha
        self.prefill_alpha = prefill_alpha  # prefills are rarer than decodes: learn faster
        self.min_factor, self.max_factor = min_factor, max_factor
        self.prefill_factor = self._clamp(start[0])
        self.decode_factor = self._clamp(start[1])
        self.start = (self.prefill_factor, self.decode_factor)  # what relax() returns to
        self._evidence_s: float | None = None  # when the last iteration ended (observe's at_s)
        self._relaxed_s = -math.inf  # up to when relax() has moved the factors
        self.prefill_regions: dict[int, float] = {}  # floor(log2 prompt) -> factor
        self.decode_regions: dict[tuple[int, int], float] = {}  # (floor(log2 batch), floor(log2 context)) -> factor
        self.margin_quantile, self.margin_after = margin_quantile, margin_after
        self.min_margin, self.max_margin = min_margin, max_margin
        self._ratios: deque[float] = deque(maxlen=margin_window)
        self.observed = 0
        self._margin: float | None = None  # recomputed every MARGIN_EVERY observations (a quantile costs ~30 us)

    @staticmethod
    def _cell(x: float) -> int:
        return int(math.floor(math.log2(max(1.0, x))))

    def _prefill_factor(self, prompt_len: float) -> float:
        return self.prefill_regions.get(self._cell(prompt_len), self.prefill_factor)

    def _decode_factor(self, batch: float, avg_context: float) -> float:
        return self.decode_regions.get((self._cell(batch), self._cell(avg_context)), self.decode_factor)

    def prefill_s(self, prompt_len: int) -> float:
        return self._prefill_factor(prompt_len) * self.base.prefill_s(prompt_len)

    def decode_s(self, batch: int, avg_context: float) -> float:
        return self._decode_factor(batch, avg_context) * self.base.decode_s(batch, avg_context)

    def observe(self, kind: IterationKind, predicted_s: float, actual_s: float, batch: int = 0,
                tokens: float = 0, at_s: float | None = None) -> None:
        """One iteration: its kind, predicted and real seconds, batch size and tokens (prompt
        tokens of a prefill, mean context of a decode; 0: no region, the instance-wide factor only);
        `at_s`: when it ended (the event loop's clock), for `relax`."""
        if not (predicted_s > 0 and actual_s > 0 and math.isfinite(actual_s)):
            return
        if at_s is not None:
            self._evidence_s = at_s if self._evidence_s is None else max(self._evidence_s, at_s)
        ratio = actual_s / predicted_s
        self.observed += 1
        self._ratios.append(ratio)
        if self.observed >= self.margin_after and (self._margin is None or self.observed % MARGIN_EVERY == 0):
            q = float(np.quantile(np.fromiter(self._ratios, float), self.margin_quantile)) - 1.0
            self._margin = min(self.max_margin, max(self.min_margin, q))
        ratio = min(self.max_step, max(1.0 / self.max_step, ratio))  # for the factors; the margin sees it whole
        if kind is IterationKind.PREFILL:
            if tokens >= 1:
                cell = self._cell(tokens)
                used = self.prefill_regions.get(cell, self.prefill_factor)
                self.prefill_regions[cell] = self._clamp(used * ratio ** self.prefill_alpha)
            self.prefill_factor = self._clamp(self.prefill_factor * ratio ** self.prefill_alpha)
        else:
            if batch >= 1 and tokens >= 1:
                cell = (self._cell(batch), self._cell(tokens))
                used = self.decode_regions.get(cell, self.decode_factor)
                self.decode_regions[cell] = self._clamp(used * ratio ** self.alpha)
            self.decode_factor = self._clamp(self.decode_factor * ratio ** self.alpha)

    def relax(self, now_s: float) -> None:
        """Move the factors back toward their start for the time past RELAX_AFTER_S since the
        last iteration (class docstring); `now_s` on the clock `observe`'s at_s used."""
        if self._evidence_s is None:  # nothing observed here yet (factors set or warm-started): fade from now
            self._evidence_s = now_s
        since = max(self._evidence_s + RELAX_AFTER_S, self._relaxed_s)
        if now_s <= since:
            return
        keep = 0.5 ** ((now_s - since) / RELAX_HALF_LIFE_S)
        p0, d0 = self.start
        self.prefill_factor = p0 * (self.prefill_factor / p0) ** keep
        self.decode_factor = d0 * (self.decode_factor / d0) ** keep
        self.prefill_regions = {c: p0 * (f / p0) ** keep for c, f in self.prefill_regions.items()}
        self.decode_regions = {c: d0 * (f / d0) ** keep for c, f in self.decode_regions.items()}
        self._relaxed_s = now_s

    def warm_start(self, learnt: "AdaptiveTimes") -> None:
        """Start from what an earlier instance of the same model on this node learnt (its
        factors, regions and recent ratios, hence its margin once it had one): a model's
        next instance is within its error from its first iteration, not after re-learning."""
        self.prefill_factor, self.decode_factor = learnt.prefill_factor, learnt.decode_factor
        self.prefill_regions, self.decode_regions = dict(learnt.prefill_regions), dict(learnt.decode_regions)
        self._ratios.extend(learnt._ratios)
        self.observed, self._margin = learnt.observed, learnt._margin
        self._evidence_s, self._relaxed_s = learnt._evidence_s, learnt._relaxed_s  # stale stays stale
        self.start = learnt.start

    @property
    def margin(self) -> float | None:
        """The learnt margin for shadow validation (see the class docstring), None until learnt."""
        return self._margin

    def drift(self) -> dict[str, Any]:
        """How far the profile is off on this node: the instance-wide factors, the regions
        learnt and the largest relative deviation among them (|factor - 1|), the margin."""
        factors = [self.prefill_factor, self.decode_factor, *self.prefill_regions.values(),
                   *self.decode_regions.values()]
        margin = self.margin
        return {"prefill": round(self.prefill_factor, 4), "decode": round(self.decode_factor, 4),
                "max_drift": round(max(abs(f - 1.0) for f in factors), 4),
                "regions": len(self.prefill_regions) + len(self.decode_regions),
                "prefill_regions": {str(2**k): round(f, 4) for k, f in sorted(self.prefill_regions.items())},
                "decode_regions": {f"{2**b}x{2**c}": round(f, 4) for (b, c), f in sorted(self.decode_regions.items())},
                "observed": self.observed, "margin": None if margin is None else round(margin, 4)}

    # The base model's overheads (mesh-profile/2), for mesh.policy.batching.extra_s.
    @property
    def decode_after_prefill_s(self) -> float:
        return getattr(self.base, "decode_after_prefill_s", 0.0)

    @property
    def decode_batch_change_s(self) -> float:
        return getattr(self.base, "decode_batch_change_s", 0.0)

    @property
    def prefill_new_shape_s(self) -> float:
        return getattr(self.base, "prefill_new_shape_s", 0.0)

    @property
    def instance_switch_s(self) -> float:
        return getattr(self.base, "instance_switch_s", 0.0)

    @property
    def step_overhead_s(self) -> float:
        return getattr(self.base, "step_overhead_s", 0.0)

    def _clamp(self, x: float) -> float:
        return min(self.max_factor, max(self.min_factor, x))


def prior_profile(model: str, kind: str, weight_bytes: int, kv_bytes_per_token: int, max_context: int) -> Profile:
    """`DefaultCpuTimes` on a profile's grid (exact: it is linear in each axis): what the
    cluster dispatcher plans a model's instances with before the model is calibrated, the
    same times the agent validates with (mesh.control.fleet ModelSpec)."""
    times = DefaultCpuTimes.for_weights(weight_bytes)
    lengths = sorted({*(16 * 2**k for k in range(16) if 16 * 2**k < max_context), max_context})
    batches = [2**k for k in range(9)]
    return Profile(
        model, f"{kind}-prior", kind, "openvino", kv_bytes_per_token, weight_bytes, max_context,
        tuple(lengths), tuple(times.prefill_s(n) for n in lengths), tuple(batches), tuple(lengths),
        tuple(tuple(times.decode_s(b, c) for c in lengths) for b in batches),
        {"method": "prior", "hardware": {}, "source": "mesh.perf.times.DefaultCpuTimes"},
    )


def learnt_profile(profile: Profile, learnt: dict[str, Any]) -> Profile:
    """`profile` with what a service learnt on its nodes applied: each grid
    point's time times the factor of its AdaptiveTimes region (`learnt`'s `prefill_regions`
    keyed "2^k", `decode_regions` keyed "2^b x 2^c", as AdaptiveTimes.drift writes them),
    else the instance-wide `prefill` / `decode` factor: the times the service's nodes
    predicted at the end of a run, for its simulated twin."""
    prefill_f = float(learnt.get("prefill") or 1.0)
    decode_f = float(learnt.get("decode") or 1.0)
    pre_regions = {int(k): float(v) for k, v in (learnt.get("prefill_regions") or {}).items()}
    dec_regions = {tuple(int(x) for x in k.split("x")): float(v) for k,
                   v in (learnt.get("decode_regions") or {}).items()}

    def cell(x: float) -> int:
        return 2 ** AdaptiveTimes._cell(x)

    prefill = tuple(t * pre_regions.get(cell(n), prefill_f) for n, t in zip(profile.prefill_lengths, profile.prefill_s))
    decode = tuple(tuple(t * dec_regions.get((cell(b), cell(c)), decode_f) for c, t in zip(profile.decode_contexts,
                                                                                           row))
                   for b, row in zip(profile.decode_batches, profile.decode_s))
    provenance = {**profile.provenance, "learnt": {k: learnt.get(k) for k in ("prefill", "decode", "margin",
                                                                              "observed")}}
    return replace(profile, device=f"{profile.device}+learnt", prefill_s=prefill, decode_s=decode,
                   provenance=provenance)


def weighted_geomean(pairs: list[tuple[int, float]]) -> float | None:
    """The geometric mean of positive factors, each weighted by its count (e.g. iterations
    observed); None without any weight."""
    total = sum(n for n, _ in pairs)
    if total <= 0:
        return None
    return math.exp(sum(n * math.log(f) for n, f in pairs if f > 0) / total)
