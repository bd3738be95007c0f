"""Engines in an agent: which engine serves an instance, and the iteration times the node's
compute subsystem predicts for it.

CPU agents run `OpenVINOEngine`. GPU agents (vLLM) come with issue 6: `make_engine` is the
hook - an `InstanceSpec.engine` of "vllm" names the engine, and the GPU agent registers its
factory in ENGINE_FACTORIES.

Two adaptations for living in an agent process, both in `AgentOpenVINOEngine`:
- `step()` yields to the event loop before each iteration. OpenVINO's `step()` blocks and
  never awaits, so without the yield the node's token loop would never let the agent read
  its connection (admissions, aborts, pings) while requests run.
- `load()` reports its outcome to a callback, so the agent can tell the control service
  when the instance is ready or failed.

Iteration times: a calibration profile (issue 4, `calibration.profile`) when the load
message names one; otherwise `DefaultCpuTimes`, a linear model fitted by hand to the demo
model's measured iteration times (docs/openvino.md) and scaled by weight size. Both are
wrapped in `AdaptiveTimes`, which corrects them with the iteration times the node really
sees (the agent feeds it the node's iteration records).
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, Callable

from engines.protocol import EngineError, IterationKind, StepResult
from mesh.agent.protocol import InstanceSpec
from mesh.policy.compute import IterationTimes

LoadCallback = Callable[[BaseException | None], None]

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
    """Iteration times from a base model, times a correction learnt from real iterations.

    `observe(kind, predicted, actual)` moves the prefill or decode factor toward
    actual/predicted with weight `prefill_alpha` or `alpha` (geometric, clamped to [min_factor, max_factor]),
    so a machine busier or faster than the profile's stays predicted within a few
    iterations while one slow outlier moves it little.
    """

    def __init__(self, base: IterationTimes, alpha: float = 0.2, prefill_alpha: float = 0.4,
                 min_factor: float = 0.25, max_factor: float = 8.0) -> None:
        self.base = base
        self.alpha = alpha
        self.prefill_alpha = prefill_alpha  # prefills are rarer than decodes: learn faster
        self.min_factor, self.max_factor = min_factor, max_factor
        self.prefill_factor = 1.0
        self.decode_factor = 1.0

    def prefill_s(self, prompt_len: int) -> float:
        return self.prefill_factor * self.base.prefill_s(prompt_len)

    def decode_s(self, batch: int, avg_context: float) -> float:
        return self.decode_factor * self.base.decode_s(batch, avg_context)

    def observe(self, kind: IterationKind, predicted_s: float, actual_s: float) -> None:
        if not (predicted_s > 0 and actual_s > 0 and math.isfinite(actual_s)):
            return
        ratio = actual_s / predicted_s
        if kind is IterationKind.PREFILL:
            self.prefill_factor = self._clamp(self.prefill_factor * ratio ** self.prefill_alpha)
        else:
            self.decode_factor = self._clamp(self.decode_factor * ratio ** self.alpha)

    # The base model's overheads (mesh-profile/2), for mesh.policy.compute.extra_s.
    @property
    def decode_after_prefill_s(self) -> float:
        return getattr(self.base, "decode_after_prefill_s", 0.0)

    @property
    def decode_batch_change_s(self) -> float:
        return getattr(self.base, "decode_batch_change_s", 0.0)

    @property
    def instance_switch_s(self) -> float:
        return getattr(self.base, "instance_switch_s", 0.0)

    @property
    def step_overhead_s(self) -> float:
        return getattr(self.base, "step_overhead_s", 0.0)

    def _clamp(self, x: float) -> float:
        return min(self.max_factor, max(self.min_factor, x))


def _openvino_engine_class() -> type:
    from engines.openvino_engine import OpenVINOEngine

    class AgentOpenVINOEngine(OpenVINOEngine):
        """OpenVINOEngine that yields after each step and reports its load (see module doc)."""

        on_loaded: LoadCallback | None = None

        async def load(self) -> None:
            try:
                await super().load()
            except BaseException as exc:
                if self.on_loaded is not None:
                    self.on_loaded(exc)
                raise
            if self.on_loaded is not None:
                self.on_loaded(None)

        async def step(self) -> StepResult:
            # Yield before the iteration, never between it and the runtime applying its
            # result: an abort handled in between would leave the result naming a request
            # the runtime no longer has.
            await asyncio.sleep(0)  # let the agent read its connection between iterations
            if not self.has_work():  # everything was aborted during the yield
                return StepResult(IterationKind.DECODE, [], [], [], {})
            return self.step_blocking()

    return AgentOpenVINOEngine


def _make_openvino(spec: InstanceSpec, on_loaded: LoadCallback) -> Any:
    cls = _openvino_engine_class()
    engine = cls(spec.path, model_name=spec.model, context_window=spec.context_window,
                 max_num_seqs=spec.max_num_seqs)
    engine.on_loaded = on_loaded
    return engine


def _make_vllm(spec: InstanceSpec, on_loaded: LoadCallback) -> Any:
    """A vLLM instance (engines.vllm_engine): its own worker process, stepped by this agent's
    node runtime; the device comes from the installed vLLM build ($MESH_VLLM_DEVICE wins;
    a GPU agent's CUDA_VISIBLE_DEVICES pins its GPU). `on_loaded` fires once the engine is
    built, which happens in the KV resize the node runtime issues right after the load."""
    from engines.vllm_engine import create

    return create(spec.path, model_name=spec.model, context_window=spec.context_window,
                  max_num_seqs=spec.max_num_seqs, on_loaded=on_loaded)


# Engine name -> factory(spec, on_loaded) -> an engines.protocol.Engine. GPU agents add "vllm".
ENGINE_FACTORIES: dict[str, Callable[[InstanceSpec, LoadCallback], Any]] = {
    "openvino": _make_openvino,
    "vllm": _make_vllm,
}


def make_engine(spec: InstanceSpec, on_loaded: LoadCallback) -> Any:
    """The engine for one instance; EngineError says what is wrong with the spec."""
    factory = ENGINE_FACTORIES.get(spec.engine)
    if factory is None:
        raise EngineError(f"unknown engine {spec.engine!r}; known: {', '.join(sorted(ENGINE_FACTORIES))}")
    return factory(spec, on_loaded)


def iteration_times(spec: InstanceSpec, weight_bytes: int) -> AdaptiveTimes:
    """The instance's predicted iteration times: its profile if given, else the default."""
    if spec.profile:
        from calibration.perf_model import PerformanceModel
        from calibration.profile import ProfileError, load_profile

        try:
            return AdaptiveTimes(PerformanceModel(load_profile(spec.profile)))
        except ProfileError as exc:
            raise EngineError(f"cannot use profile {spec.profile}: {exc}") from exc
    return AdaptiveTimes(DefaultCpuTimes.for_weights(weight_bytes))


def prior_profile(model: str, kind: str, weight_bytes: int, kv_bytes_per_token: int, max_context: int) -> Any:
    """`DefaultCpuTimes` on a profile's grid (exact: it is linear in each axis): what the
    cluster dispatcher plans a model's instances with before the model is calibrated, the
    same times the agent validates with (mesh.runtime.cluster ModelSpec)."""
    from calibration.profile import Profile

    times = DefaultCpuTimes.for_weights(weight_bytes)
    lengths = sorted({*(16 * 2**k for k in range(16) if 16 * 2**k < max_context), max_context})
    batches = [2**k for k in range(9)]
    return Profile(
        model, f"{kind}-prior", kind, "openvino", kv_bytes_per_token, weight_bytes, max_context,
        tuple(lengths), tuple(times.prefill_s(n) for n in lengths), tuple(batches), tuple(lengths),
        tuple(tuple(times.decode_s(b, c) for c in lengths) for b in batches),
        {"method": "prior", "hardware": {}, "source": "mesh.agent.engines.DefaultCpuTimes"},
    )
