"""Replay workloads built from the Azure traces (LLM-Mesh 8.1).

`build_workload` samples functions of an Azure Functions trace, maps each to one model
replica, turns its per-minute invocation counts (scaled) into request arrival times, and
gives each request an (input, output) length pair sampled from an Azure LLM trace.
`bursty_single_model` replays the LLM trace's own arrival times for one model.

Everything is seeded: the same arguments give the same workload. Each random decision
draws from its own stream, `numpy.random.default_rng([seed, stream])`, so changing one
choice (say the arrival process) does not reshuffle another (the functions sampled).
See docs/workloads.md for the rate scaling and its default.
"""
from __future__ import annotations

import math
from fractions import Fraction
from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workloads.azure_functions import FunctionTrace
from workloads.azure_llm import LengthTrace

# Default load: mean requests per second per sampled function. rate_scale="auto" scales a
# sample of N functions so its mean aggregate rate over the window is N times this (32, 64,
# 128 functions: 3.2, 6.4, 12.8 rps). 0.1 is about the raw rate per function of a typical
# sample (median over seeds of minutes 480..509: 0.054, 0.084, 0.098 rps for 32, 64, 128
# functions), so "auto" leaves a typical sample near its raw load and evens out the samples
# that catch or miss the few heavy-tailed functions (one function holds 61% of the window's
# invocations). Why this level suits 4 CPU + 4 A100 nodes: docs/workloads.md.
DEFAULT_TARGET_RPS_PER_FUNCTION: float = 0.1

ARRIVAL_PROCESSES: tuple[str, ...] = ("poisson", "uniform")
ARRIVAL_DEFINITIONS: dict[str, str] = {
    "poisson": (
        "each (function, minute) cell's count is drawn as Poisson(scaled count) and its "
        "arrival times are i.i.d. uniform in the minute: a Poisson process whose rate is "
        "constant within each minute (expected count = scaled count)"
    ),
    "uniform": (
        "each (function, minute) cell's count is the scaled count, stochastically rounded "
        "(floor + 1 with probability of the fractional part; exact when the scaled count is "
        "an integer), and its arrival times are i.i.d. uniform in the minute"
    ),
}

# Random streams: default_rng([seed, stream]).
_STREAM_FUNCTIONS, _STREAM_MODELS, _STREAM_COUNTS, _STREAM_TIMES, _STREAM_LENGTHS = range(5)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request: when it arrives (seconds from the workload's start), for which function
    and model replica, and its prompt and output lengths in tokens."""

    request_id: str
    time_s: float
    function: str
    model: str
    prompt_len: int
    output_len: int


@dataclass
class Workload:
    """Requests sorted by arrival time, the model replicas they call, and how it was built.

    `models` maps each model replica name ("llama-2-7b/f017") to its base model name
    ("llama-2-7b"). `description` is plain JSON-serialisable data: input files, seed,
    functions sampled, window, rate scaling used and why, totals, per-minute and
    per-function counts, length exclusion.
    """

    arrivals: list[Arrival]
    models: dict[str, str]
    description: dict[str, Any]

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def duration_s(self) -> float:
        """Length of the window the arrivals were drawn in (seconds)."""
        return float(self.description["duration_s"])

    def requests_per_model(self) -> dict[str, int]:
        """Number of requests per model replica (every replica listed, zeros included)."""
        out = dict.fromkeys(self.models, 0)
        for a in self.arrivals:
            out[a.model] += 1
        return out


def default_target_rps(functions: int) -> float:
    """The mean aggregate request rate rate_scale="auto" aims at for `functions` functions:
    functions * DEFAULT_TARGET_RPS_PER_FUNCTION."""
    if functions < 1:
        raise ValueError(f"functions must be >= 1, got {functions}")
    return functions * DEFAULT_TARGET_RPS_PER_FUNCTION


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def stochastic_round(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Round each non-negative value to floor(v) or floor(v) + 1, up with probability
    v - floor(v), so the expected result is exactly v. Returns int64."""
    values = np.asarray(values, dtype=np.float64)
    if np.any(~np.isfinite(values)) or np.any(values < 0):
        raise ValueError("stochastic_round needs finite non-negative values")
    low = np.floor(values)
    up = rng.random(values.shape) < (values - low)
    return low.astype(np.int64) + up.astype(np.int64)


def model_mix_counts(weights: Mapping[str, float], n: int) -> dict[str, int]:
    """Split `n` replicas among base models in proportion to `weights` by the largest
    remainder method: each gets floor(n * w / sum w), and the leftover replicas go to the
    largest fractional parts (ties: the larger weight, then the order of `weights`).
    Counts sum to exactly `n`."""
    if n < 0:
        raise ValueError(f"replica count must be >= 0, got {n}")
    if not weights:
        raise ValueError("model mix is empty: give at least one base model with a weight > 0")
    names = list(weights)
    w = np.array([float(weights[k]) for k in names], dtype=np.float64)
    if np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(
            f"model mix weights must be finite, >= 0 and not all 0, got {dict(weights)}"
        )
    # Exact rational arithmetic, so equal fractional parts tie exactly.
    exact = [Fraction(float(x)) for x in w]
    quota = [n * x / sum(exact) for x in exact]
    counts = [math.floor(q) for q in quota]
    left = n - sum(counts)
    order = sorted(range(len(names)), key=lambda i: (-(quota[i] - counts[i]), -exact[i], i))
    for i in order[:left]:
        counts[i] += 1
    return dict(zip(names, counts))


def sample_functions(trace: FunctionTrace, n: int, seed: int) -> np.ndarray:
    """Row indices of `n` functions drawn uniformly without replacement, in trace order.

    The draw is the first `n` of one seeded permutation, so for one seed the sample of
    32 functions is contained in the sample of 64, which is contained in that of 128."""
    seed = _check_seed(seed)
    if not 1 <= n <= trace.n_functions:
        raise ValueError(
            f"cannot sample {n} functions: {trace.path} holds {trace.n_functions} "
            f"(choose 1..{trace.n_functions})"
        )
    perm = _rng(seed, _STREAM_FUNCTIONS).permutation(trace.n_functions)
    return np.sort(perm[:n])


def _function_rows(trace: FunctionTrace, function_ids: Sequence[str]) -> np.ndarray:
    if len(function_ids) == 0:
        raise ValueError("no function ids given")
    rows = np.array([trace.index_of(f) for f in function_ids], dtype=np.int64)
    if len(np.unique(rows)) != len(rows):
        raise ValueError("function ids repeat")
    return rows


def rate_scale_for_target(
    trace: FunctionTrace,
    function_ids: Sequence[str],
    minutes: int,
    target_rps: float,
    *,
    start_minute: int | None = None,
) -> float:
    """The factor that, multiplying every per-minute count of `function_ids` in the window
    of `minutes` minutes from `start_minute` (default: the trace's first minute), gives a
    mean aggregate request rate of `target_rps` requests per second over the window:
    target_rps * 60 * minutes / (raw invocations in the window). The expected number of
    requests a workload built with it holds is exactly target_rps * 60 * minutes.
    ValueError when the functions are silent in the window."""
    if not (math.isfinite(target_rps) and target_rps > 0):
        raise ValueError(f"target_rps must be a positive number, got {target_rps}")
    cols = trace.window(minutes, start_minute)
    rows = _function_rows(trace, function_ids)
    raw = int(trace.counts[rows, cols].sum())
    if raw == 0:
        raise ValueError(
            f"the {len(rows)} functions have no invocation in minutes "
            f"{trace.minutes[cols][0]}..{trace.minutes[cols][-1]} of {trace.path}: no "
            f"rate scale reaches {target_rps} rps; choose another seed or window"
        )
    return target_rps * 60.0 * minutes / raw


def _resolve_max_total(
    max_total: int | Mapping[str, int] | None, bases: Sequence[str]
) -> dict[str, int | None]:
    if max_total is None:
        return dict.fromkeys(bases)
    if isinstance(max_total, Mapping):
        missing = [b for b in bases if b not in max_total]
        if missing:
            raise ValueError(
                f"max_total has no context window for base models {missing}; "
                f"give one for each of {list(bases)} (or one int for all)"
            )
        out: dict[str, int | None] = {b: max_total[b] for b in bases}
    else:
        out = dict.fromkeys(bases, max_total)
    for b, v in out.items():
        if v is not None and (isinstance(v, bool) or int(v) != v or v < 2):
            raise ValueError(f"max_total for {b} must be an integer >= 2, got {v!r}")
    return {b: (None if v is None else int(v)) for b, v in out.items()}


def _arrival_list(
    times: np.ndarray,
    functions: Sequence[str],
    models: Sequence[str],
    prompt: np.ndarray,
    output: np.ndarray,
) -> list[Arrival]:
    width = max(6, len(str(max(len(times) - 1, 0))))
    return [
        Arrival(
            request_id=f"r{i:0{width}d}",
            time_s=float(t),
            function=f,
            model=m,
            prompt_len=int(p),
            output_len=int(o),
        )
        for i, (t, f, m, p, o) in enumerate(zip(times, functions, models, prompt, output))
    ]


def build_workload(
    trace: FunctionTrace,
    lengths: LengthTrace,
    *,
    functions: int = 32,
    minutes: int = 30,
    start_minute: int | None = None,
    models: Mapping[str, float] | None = None,
    seed: int = 0,
    rate_scale: float | str = "auto",
    target_rps: float | None = None,
    arrivals: str = "poisson",
    max_total: int | Mapping[str, int] | None = None,
) -> Workload:
    """Build a replay workload from an Azure Functions trace and an Azure LLM trace.

    - Samples `functions` functions uniformly without replacement (`sample_functions`).
    - Gives each one model replica "<base>/f<index>": base models in exact proportion to
      `models` (weights; default {"llama-2-7b": 1}) by largest remainder, shuffled with the
      seed; index is the function's position in the sample (trace order), zero-padded.
    - Window: `minutes` minutes from `start_minute` (default: the trace's first minute);
      arrival times are seconds from the window's start.
    - Rate: every per-minute count is multiplied by `rate_scale`: a float, or "auto" =
      `rate_scale_for_target` for `target_rps` (default `default_target_rps(functions)`).
    - Arrivals: `arrivals` is "poisson" or "uniform" (see ARRIVAL_DEFINITIONS).
    - Lengths: each request's (prompt_len, output_len) is drawn from `lengths` restricted to
      input + output <= max_total of its base model (`max_total`: one int for all, a dict
      per base model, or None for no limit) and input, output >= 1.
    """
    seed = _check_seed(seed)
    minutes, functions = _check_shape(minutes, functions, arrivals)
    mix = dict(models) if models is not None else {"llama-2-7b": 1.0}
    cols = trace.window(minutes, start_minute)
    window_minutes = trace.minutes[cols]
    rows = sample_functions(trace, functions, seed)
    function_ids = [trace.function_ids[r] for r in rows]
    raw = trace.counts[rows, cols]  # (functions, minutes)
    raw_total = int(raw.sum())
    duration_s = 60.0 * minutes

    scale, target, scale_reason = _rate_scale(trace, function_ids, functions, minutes, int(window_minutes[0]),
                                              rate_scale, target_rps, raw_total, duration_s)

    mix_counts, assigned, replicas = _replicas(mix, functions, seed)
    replica_models = dict(zip(replicas, assigned))
    windows = _resolve_max_total(max_total, [b for b, c in mix_counts.items() if c > 0])

    expected, n, times, f_idx = _arrival_times(raw, scale, arrivals, minutes, seed)

    # Lengths, per base model.
    base_names = sorted(windows)
    base_code = np.array([base_names.index(b) for b in assigned], dtype=np.int64)
    req_code = base_code[f_idx]
    prompt, output, length_info = _draw_lengths(lengths, req_code, base_names, windows, seed)

    arrival_list = _arrival_list(
        times,
        [function_ids[i] for i in f_idx],
        [replicas[i] for i in f_idx],
        prompt,
        output,
    )

    per_function_requests = n.sum(axis=1)
    per_model = _per_model(mix, windows, base_names, base_code, req_code, per_function_requests, raw, expected,
                           prompt, output, length_info, duration_s)
    total = int(n.sum())
    description: dict[str, Any] = {
        "kind": "azure_functions",
        "function_trace": str(trace.path),
        "length_trace": str(lengths.path),
        "seed": seed,
        "functions": functions,
        "functions_available": trace.n_functions,
        "sampling": "uniform without replacement: first N of a permutation seeded by "
        "default_rng([seed, 0]); listed in trace order",
        "window": {
            "start_minute": int(window_minutes[0]),
            "end_minute": int(window_minutes[-1]),
            "minutes": minutes,
            "time_zero": f"start of minute {int(window_minutes[0])} of the trace",
        },
        "duration_s": duration_s,
        "arrivals": arrivals,
        "arrivals_definition": ARRIVAL_DEFINITIONS[arrivals],
        "rate_scale": {
            "mode": "auto" if target is not None else "explicit",
            "value": scale,
            "target_rps": target,
            "default_target_rps_per_function": DEFAULT_TARGET_RPS_PER_FUNCTION,
            "reason": scale_reason,
            "fractional_counts": "stochastic rounding"
            if arrivals == "uniform"
            else "Poisson draw per minute",
        },
        "model_mix": {b: float(w) for b, w in mix.items()},
        "model_counts": mix_counts,
        "raw_invocations": raw_total,
        "raw_mean_rps": raw_total / duration_s,
        "expected_requests": float(expected.sum()),
        "requests": total,
        "mean_rps": total / duration_s,
        "per_model": per_model,
        "per_minute": {
            "minute": [int(m) for m in window_minutes],
            "raw": [int(v) for v in raw.sum(axis=0)],
            "requests": [int(v) for v in n.sum(axis=0)],
        },
        "per_function": [
            {"replica": replicas[i], "function": function_ids[i], "trigger": trace.triggers[rows[i]],
             "base_model": assigned[i], "raw_invocations": int(raw[i].sum()), "requests": int(per_function_requests[i])}
            for i in range(functions)
        ],
        "lengths": {
            "mean_prompt_len": float(prompt.mean()) if total else 0.0,
            "mean_output_len": float(output.mean()) if total else 0.0,
        },
    }
    return Workload(arrivals=arrival_list, models=replica_models, description=description)


def _rate_scale(trace: FunctionTrace, function_ids: list[str], functions: int, minutes: int, start_minute: int,
                rate_scale: float | str, target_rps: float | None, raw_total: int,
                duration_s: float) -> tuple[float, float | None, str]:
    """The factor every per-minute count is multiplied by, the target rate it meets (None
    for an explicit factor) and why (build_workload's "Rate")."""
    if isinstance(rate_scale, str):
        if rate_scale != "auto":
            raise ValueError(f"rate_scale must be a positive number or 'auto', got {rate_scale!r}")
        target = default_target_rps(functions) if target_rps is None else float(target_rps)
        scale = rate_scale_for_target(trace, function_ids, minutes, target, start_minute=start_minute)
        scale_reason = (
            f"auto: scaled so the mean aggregate rate is {target:g} rps"
            + (
                f" = {functions} functions x DEFAULT_TARGET_RPS_PER_FUNCTION "
                f"({DEFAULT_TARGET_RPS_PER_FUNCTION:g} rps)"
                if target_rps is None
                else " (target_rps given)"
            )
            + f"; the raw sample holds {raw_total} invocations = {raw_total / duration_s:.4g} rps"
        )
        return scale, target, scale_reason
    if target_rps is not None:
        raise ValueError("target_rps applies only to rate_scale='auto'")
    scale = float(rate_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"rate_scale must be a positive number or 'auto', got {rate_scale!r}")
    return scale, None, f"explicit rate_scale={scale:g} given by the caller"


def _arrival_times(raw: np.ndarray, scale: float, arrivals: str, minutes: int,
                   seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Counts per (function, minute) cell, then arrival times: (expected counts, counts,
    sorted arrival times, each arrival's function index)."""
    expected = raw.astype(np.float64) * scale
    if arrivals == "poisson":
        n = _rng(seed, _STREAM_COUNTS).poisson(expected).astype(np.int64)
    else:
        n = stochastic_round(expected, _rng(seed, _STREAM_COUNTS))
    flat = n.ravel()
    cell = np.repeat(np.arange(flat.size), flat)
    f_idx = cell // minutes
    m_idx = cell % minutes
    times = 60.0 * m_idx + 60.0 * _rng(seed, _STREAM_TIMES).random(cell.size)
    order = np.lexsort((f_idx, times))
    return expected, n, times[order], f_idx[order]


def _draw_lengths(lengths: LengthTrace, req_code: np.ndarray, base_names: list[str], windows: Mapping[str, Any],
                  seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Each request's (prompt_len, output_len), drawn per base model within its max_total."""
    prompt = np.zeros(req_code.size, dtype=np.int64)
    output = np.zeros(req_code.size, dtype=np.int64)
    length_rng = _rng(seed, _STREAM_LENGTHS)
    length_info: dict[str, Any] = {}
    for k, b in enumerate(base_names):
        mask = req_code == k
        s = lengths.sample(int(mask.sum()), length_rng, windows[b])
        prompt[mask] = s.prompt_tokens
        output[mask] = s.output_tokens
        length_info[b] = {
            "max_total": windows[b],
            "excluded_fraction": s.excluded_fraction,
            "excluded_requests_of_trace": s.excluded,
            "eligible_requests_of_trace": s.eligible,
        }
    return prompt, output, length_info


def _per_model(mix: Mapping[str, float], windows: Mapping[str, Any], base_names: list[str], base_code: np.ndarray,
               req_code: np.ndarray, per_function_requests: np.ndarray, raw: np.ndarray, expected: np.ndarray,
               prompt: np.ndarray, output: np.ndarray, length_info: Mapping[str, Any],
               duration_s: float) -> dict[str, Any]:
    """build_workload's description of each base model: replicas, invocations, requests, lengths."""
    per_model: dict[str, Any] = {}
    for b in windows:
        sel = base_code == base_names.index(b)
        req_mask = req_code == base_names.index(b)
        count = int(per_function_requests[sel].sum())
        per_model[b] = {
            "weight": float(mix[b]),
            "replicas": int(sel.sum()),
            "raw_invocations": int(raw[sel].sum()),
            "expected_requests": float(expected[sel].sum()),
            "requests": count,
            "mean_rps": count / duration_s,
            "mean_prompt_len": float(prompt[req_mask].mean()) if count else 0.0,
            "mean_output_len": float(output[req_mask].mean()) if count else 0.0,
            **length_info[b],
        }
    return per_model


def _check_shape(minutes: Any, functions: Any, arrivals: str) -> tuple[int, int]:
    if isinstance(minutes, bool) or not isinstance(minutes, (int, np.integer)):
        raise ValueError(f"minutes must be an integer number of trace minutes, got {minutes!r}")
    if isinstance(functions, bool) or not isinstance(functions, (int, np.integer)):
        raise ValueError(f"functions must be an integer, got {functions!r}")
    if arrivals not in ARRIVAL_PROCESSES:
        raise ValueError(f"arrivals must be one of {ARRIVAL_PROCESSES}, got {arrivals!r}")
    return int(minutes), int(functions)


def _replicas(mix: Mapping[str, float], functions: int, seed: int) -> tuple[dict[str, int], list[str], list[str]]:
    """Model replicas: base models in exact proportion to `mix` by largest remainder, shuffled
    with the seed; (counts per base, each function's base, each function's replica name)."""
    mix_counts = model_mix_counts(mix, functions)
    bases = [b for b, c in mix_counts.items() for _ in range(c)]
    assigned = [bases[i] for i in _rng(seed, _STREAM_MODELS).permutation(functions)]
    width = max(3, len(str(functions - 1)))
    return mix_counts, assigned, [f"{b}/f{i:0{width}d}" for i, b in enumerate(assigned)]


def bursty_single_model(
    lengths: LengthTrace,
    *,
    model: str,
    minutes: float,
    seed: int = 0,
    time_scale: float = 1.0,
    max_total: int | None = None,
) -> Workload:
    """One model replica "<model>/f000" called at the LLM trace's own arrival times.

    Request i arrives at `timestamps_s[i] * time_scale` (time_scale < 1 compresses the
    trace: higher rate, same burst shape); arrivals from the first `minutes` minutes of
    that rescaled time are kept. Each request keeps its own row's lengths; a row whose pair
    does not fit `max_total` (or has an input or output below 1) gets a pair drawn with the
    seed from the rows that fit, so no arrival is dropped (the count is reported).
    """
    seed = _check_seed(seed)
    if not (math.isfinite(minutes) and minutes > 0):
        raise ValueError(f"minutes must be a positive number, got {minutes}")
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a positive number, got {time_scale}")
    if not model or "/" in model:
        raise ValueError(f"model must be a base model name without '/', got {model!r}")
    duration_s = 60.0 * float(minutes)
    times = lengths.timestamps_s * time_scale
    keep = np.flatnonzero(times < duration_s)
    times = times[keep]
    prompt = lengths.context_tokens[keep].copy()
    output = lengths.generated_tokens[keep].copy()
    fits = lengths.eligible_mask(max_total)[keep]
    bad = np.flatnonzero(~fits)
    if bad.size:
        s = lengths.sample(int(bad.size), _rng(seed, _STREAM_LENGTHS), max_total)
        prompt[bad] = s.prompt_tokens
        output[bad] = s.output_tokens
    replica = f"{model}/f000"
    function = Path(lengths.path).stem
    arrival_list = _arrival_list(
        times, [function] * times.size, [replica] * times.size, prompt, output
    )
    per_minute = np.bincount((times // 60).astype(np.int64), minlength=math.ceil(minutes))
    description: dict[str, Any] = {
        "kind": "azure_llm_timestamps",
        "length_trace": str(lengths.path),
        "seed": seed,
        "model": model,
        "minutes": float(minutes),
        "duration_s": duration_s,
        "time_scale": float(time_scale),
        "arrivals_definition": "row i arrives at (its TIMESTAMP - the first row's) * "
        "time_scale seconds; rows at or after the window's end are left out",
        "trace_rows_in_window": int(keep.size),
        "trace_rows": len(lengths),
        "window_covers_trace": bool(keep.size == len(lengths)),
        "max_total": max_total,
        "resampled_lengths": int(bad.size),
        "requests": int(times.size),
        "mean_rps": times.size / duration_s,
        "per_minute": {
            "minute": list(range(len(per_minute))),
            "requests": [int(v) for v in per_minute],
        },
        "lengths": {
            "mean_prompt_len": float(prompt.mean()) if times.size else 0.0,
            "mean_output_len": float(output.mean()) if times.size else 0.0,
        },
    }
    return Workload(arrivals=arrival_list, models={replica: model}, description=description)


def scale_lengths(workload: Workload, factor: float, max_total: int) -> Workload:
    """The same arrivals with prompt and output lengths divided by `factor` (rounded; prompt
    >= 4, output >= 2) and the output cut so prompt + output <= `max_total`: a trace for a
    smaller model or machine (`mesh replay --live`)."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"the length scale must be a positive number, got {factor}")
    if max_total < 6:
        raise ValueError(f"max_total must leave room for a 4-token prompt and 2 tokens out, got {max_total}")
    out = []
    for a in workload.arrivals:
        prompt = min(max(4, round(a.prompt_len / factor)), max_total - 2)
        output = min(max(2, round(a.output_len / factor)), max_total - prompt)
        out.append(dataclasses.replace(a, prompt_len=prompt, output_len=output))
    description = {**workload.description, "length_scale": factor, "length_max_total": max_total}
    return Workload(out, dict(workload.models), description)
