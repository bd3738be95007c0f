"""`mesh bench learning`: how many iterations until a node's predicted iteration times are
within 10% of the real ones, on a machine with no profile for the model.

One real OpenVINO instance of the demo model (or `--model`) serves a staggered workload
(requests of varied prompt lengths arriving while others decode, so prefills of many
lengths and decodes of batch 1 up to `--requests` interleave) through a NodeRuntime, and
every iteration is recorded (kind, batch, tokens, seconds). The records are then fed, in
order, to AdaptiveTimes started three ways, each predicting an iteration before observing it:
- `prior`: DefaultCpuTimes as it is (factors 1.0), what agents did before the probe;
- `probe`: the prior scaled by this machine's speed probe (mesh.node.speed_probe);
- `oracle`: the prior scaled by the factors the run ends with (the best a probe could do).
`within_10pct_after` is the first iteration from which the predicted time of a run of
`--window` iterations is within 10% of the real one in at least half the later runs (their median error <= 10%)
(`window_errors`, `within_after`). Speed varies on shared cores; run it a few times.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.bench.report import emit
from mesh.perf.times import AdaptiveTimes, DefaultCpuTimes
from mesh.policy.batching import IterationKind

PROMPTS = (24, 96, 40, 200, 64, 400, 32, 150, 300, 48, 120, 500, 80, 256, 36, 180)
WINDOW = 1024
TOLERANCE = 0.10


@dataclass(frozen=True, slots=True)
class Iteration:
    """One real iteration: kind, batch (requests that got a token), tokens (prompt tokens of a
    prefill, mean context of a decode), seconds."""

    kind: IterationKind
    batch: int
    tokens: float
    seconds: float


def predictions(iterations: list[Iteration], times: AdaptiveTimes) -> list[float]:
    """Each iteration's predicted seconds, predicted before it is observed (as a node does)."""
    out = []
    for it in iterations:
        if it.kind is IterationKind.PREFILL:
            predicted = times.prefill_s(max(1, int(it.tokens)))
        else:
            predicted = times.decode_s(max(1, it.batch), it.tokens)
        out.append(predicted)
        times.observe(it.kind, predicted, it.seconds, it.batch, it.tokens)
    return out


def window_errors(predicted: list[float], actual: list[float], window: int = 8) -> list[float]:
    """|sum predicted / sum actual - 1| over each run of `window` iterations from each
    iteration on: a decision (shadow validation) adds up the iterations ahead of it, so one
    preempted iteration on shared cores is noise around it, not its error."""
    return [abs(sum(predicted[i:i + window]) / sum(actual[i:i + window]) - 1.0)
            for i in range(len(actual) - window + 1)]


def within_after(errors: list[float], tolerance: float = TOLERANCE, share: float = 0.5) -> int | None:
    """The first iteration from which at least `share` of the later windows are within
    `tolerance`; None if no such iteration (noise on shared cores can keep a run out)."""
    good = 0
    for i in range(len(errors) - 1, -1, -1):  # suffix counts, from the end
        good += errors[i] <= tolerance
    first = None
    for i in range(len(errors)):
        if good >= share * (len(errors) - i) and errors[i] <= tolerance:
            first = i
            break
        good -= errors[i] <= tolerance
    return first


def learning_figures(iterations: list[Iteration], starts: dict[str, tuple[float, float]], weight_bytes: int,
                     window: int = 8) -> dict[str, Any]:
    """Per start: iterations until within 10% (window sums), the first window's error, the
    median window error over the first 32 iterations and after them."""
    actual = [it.seconds for it in iterations]
    out: dict[str, Any] = {}
    for name, start in starts.items():
        times = AdaptiveTimes(DefaultCpuTimes.for_weights(weight_bytes), start=start)
        errors = window_errors(predictions(iterations, times), actual, window)
        out[name] = {"start": [round(x, 3) for x in start], "within_10pct_after": within_after(errors),
                     "first_window_error": round(errors[0], 3) if errors else None,
                     "median_error_first_32": round(statistics.median(errors[:32]), 3) if errors else None,
                     "median_error_after_32": round(statistics.median(errors[32:]), 3) if len(errors) > 32 else None,
                     "final_factors": [round(times.prefill_factor, 3), round(times.decode_factor, 3)],
                     "margin": times.margin}
    return out


async def _serve(engine: Any, prompts: list[list[int]], output_len: int, gap_s: float) -> list[Iteration]:
    from mesh.engines.engine_api import EngineRequest, Sampling
    from mesh.node.runtime import NodeRuntime
    from mesh.policy.kv_demand import RunningMean
    from mesh.policy.node_spec import NodeSpec
    from mesh.policy.slo import SLO
    from mesh.wire.served_request import ServedRequest

    loop = asyncio.get_running_loop()
    node = NodeRuntime(NodeSpec("bench", "cpu", 64 * 2**30), record_iterations=True)
    node.start()
    slo = SLO(ttft_min_s=600.0, tpot_s=60.0)
    times = AdaptiveTimes(DefaultCpuTimes.for_weights(engine.weight_bytes))
    node.memory_ops.start_instance("i", "m", engine, times, slo, RunningMean(output_len), 0.0)
    while not node.instances["i"].loaded:
        await asyncio.sleep(0.01)
    left = len(prompts)
    done = asyncio.Event()

    def on_done(_req: ServedRequest) -> None:
        nonlocal left
        left -= 1
        if not left:
            done.set()

    for k, ids in enumerate(prompts):
        er = EngineRequest(f"r{k}", len(ids), Sampling(max_tokens=output_len), ids, output_len=output_len)
        req = ServedRequest(er, "m", loop.time(), slo, on_done=on_done)
        node.admit("i", req, node.admission.validate("i", req))
        await asyncio.sleep(gap_s)  # the next arrives while these decode
    await done.wait()
    await node.stop()
    return [Iteration(r.kind, r.batch_size, float(r.tokens), r.duration_s) for r in node.iterations or []
            if r.duration_s > 0 and r.batch_size > 0]


def run(requests: int = 16, output_len: int = 48, gap_s: float = 0.4, model: str | None = None,
        window: int = 8) -> dict[str, Any]:
    from mesh.calibration.openvino_calibration import TokenPrompts
    from mesh.engines.openvino_engine import OpenVINOEngine
    from mesh.modelfiles.demo import demo_gguf_path
    from mesh.node.speed_probe import probe_speed
    from mesh.perf.speed import PRIOR_MACHINE, SpeedFactors

    speed = probe_speed()
    factors = SpeedFactors.against(speed)
    model_path = Path(model) if model else demo_gguf_path(fetch=False)
    import os

    cores = len(os.sched_getaffinity(0))
    properties = {"INFERENCE_NUM_THREADS": cores} if cores < (os.cpu_count() or cores) else {}
    engine = OpenVINOEngine(model_path, model_name="m", context_window=WINDOW, max_num_seqs=32, ignore_eos=True,
                            properties=properties)
    asyncio.run(engine.load())
    try:
        tp = TokenPrompts.for_engine(engine)
        prompts = [tp.ids(PROMPTS[k % len(PROMPTS)], k) for k in range(requests)]
        iterations = asyncio.run(_serve(engine, prompts, output_len, gap_s))
    finally:
        asyncio.run(engine.unload())
    final = AdaptiveTimes(DefaultCpuTimes.for_weights(engine.weight_bytes))
    predictions(iterations, final)
    starts = {"prior": (1.0, 1.0), "probe": (factors.prefill, factors.decode),
              "oracle": (final.prefill_factor, final.decode_factor)}
    figures = learning_figures(iterations, starts, engine.weight_bytes, window)
    return {"iterations": len(iterations),
            "prefills": sum(1 for it in iterations if it.kind is IterationKind.PREFILL),
            "max_batch": max((it.batch for it in iterations), default=0), "cores": cores,
            "speed": speed.to_dict(), "reference": PRIOR_MACHINE.to_dict(), "probe_factors": factors.to_dict(),
            "within_10pct_after_prior": figures["prior"]["within_10pct_after"],
            "within_10pct_after_probe": figures["probe"]["within_10pct_after"],
            "by_start": figures, "window": window, "tolerance": TOLERANCE,
            # the reference this run implies (speed x learnt factor): equal across runs and
            # machines if the probe tracks the engine, and what PRIOR_MACHINE should hold
            "implied_reference": {"gemm_gflops": round(speed.gemm_gflops * final.prefill_factor, 2),
                                  "stream_gbps": round(speed.stream_gbps * final.decode_factor, 2)}}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("learning", help="iterations until a node's iteration times are within 10%% without a profile")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--requests", type=int, default=16, help="requests, one every --gap seconds (default 16)")
    p.add_argument("--output-len", type=int, default=48, help="tokens generated per request (default 48)")
    p.add_argument("--gap", type=float, default=0.4, help="seconds between arrivals (default 0.4)")
    p.add_argument("--window", type=int, default=8, help="iterations per error window (default 8)")
    p.add_argument("--model", help="GGUF or IR (default: the demo model)")
    p.set_defaults(func=lambda a: emit("mesh bench learning", run(a.requests, a.output_len, a.gap, a.model, a.window),
                                       a.json, {}))
