"""`mesh bench engine`: what Mesh's node runtime costs over the bare OpenVINO pipeline.

The same requests (prompt lengths from the Azure conversation trace / `--scale`, a fixed
number of output tokens each, end-of-sequence ignored) are served to completion, all
submitted at once, two ways on the same loaded pipeline:
- mesh: NodeRuntime + OpenVINOEngine (admission with shadow validation, the token-level
  loop, per-token text streaming with the incremental detokenizer, bookkeeping);
- bare: `ContinuousBatchingPipeline.add_request` with the same token ids and generation
  settings, then `step()` until done, reading every handle's new tokens after each step.
Both use one pipeline object (the engine's), so they share its compiled model and its
KV cache; runs alternate (mesh, bare, mesh, bare, ...) after an untimed warm-up round and
the medians are reported. Tokens per second = generated tokens / wall time from the first
submission to the last token. On a VM whose speed drifts by 10-20% between runs a few
seconds apart, the ratio of two wall-clock rates is noisy; `mesh_outside_step_share` is
the precise figure of what Mesh adds: the share of the mesh path's wall time spent outside
`pipe.step()` (the same steps run in both paths), timed in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from mesh.bench.report import emit

WINDOW = 1024
MAX_BATCH = 32


def _requests(n: int, scale: float, output_len: int, seed: int, trace: str | Path) -> list[tuple[int, int]]:
    from mesh.bench.fidelity import build_workload

    work = build_workload(n, 1.0, scale, seed, trace, max_prompt=512, max_output=output_len)
    return [(w.prompt_len, output_len) for w in work]


async def _mesh_round(engine: Any, prompts: list[list[int]], output_len: int) -> tuple[float, int, int]:
    """(seconds, tokens, iterations) through a NodeRuntime holding `engine` as one instance."""
    from mesh.engines.engine_api import EngineRequest, Sampling
    from mesh.node.runtime import NodeRuntime
    from mesh.policy.kv_demand import RunningMean
    from mesh.policy.node_spec import NodeSpec
    from mesh.policy.slo import SLO
    from mesh.wire.served_request import ServedRequest

    loop = asyncio.get_running_loop()
    node = NodeRuntime(NodeSpec("bench", "cpu", 64 * 2**30))
    node.start()
    slo = SLO(tpot_s=10.0)
    node.memory_ops.start_instance("i", "m", engine, _FlatTimes(), slo, RunningMean(output_len), 0.0)
    while not node.instances["i"].loaded:
        await asyncio.sleep(0.01)
    done = asyncio.Event()
    left = len(prompts)
    streamed = 0

    def on_output(_req: ServedRequest, tokens: Any, texts: Any, _logprobs: Any) -> None:
        nonlocal streamed
        streamed += len(tokens)

    def on_done(_req: ServedRequest) -> None:
        nonlocal left
        left -= 1
        if not left:
            done.set()

    start_iterations = node.iteration_count
    t0 = time.perf_counter()
    now = loop.time()
    for k, ids in enumerate(prompts):
        er = EngineRequest(f"m{k}", len(ids), Sampling(max_tokens=output_len), ids, output_len=output_len)
        req = ServedRequest(er, "m", now, slo, on_output=on_output, on_done=on_done)
        node.admit("i", req, node.admission.validate("i", req))
    await done.wait()
    wall = time.perf_counter() - t0
    iterations = node.iteration_count - start_iterations
    await node.stop()
    return wall, streamed, iterations


def _bare_round(pipe: Any, prompts: list[list[int]], output_len: int, first_id: int) -> tuple[float, int, int]:
    """(seconds, tokens, steps) stepping the pipeline directly."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    t0 = time.perf_counter()
    handles = []
    for k, ids in enumerate(prompts):
        config = ov_genai.GenerationConfig()
        config.max_new_tokens = output_len
        config.num_return_sequences = 1
        config.ignore_eos = True
        config.do_sample = False
        handles.append(pipe.add_request(first_id + k, ov.Tensor(np.asarray([ids], dtype=np.int64)), config))
    tokens = steps = 0
    while pipe.has_non_finished_requests():
        pipe.step()
        steps += 1
        for h in handles:
            if h.can_read():
                for out in h.read().values():
                    tokens += len(out.generated_ids)
    wall = time.perf_counter() - t0
    return wall, tokens, steps


class _StepTimer:
    """Stands in for the pipeline inside the engine and adds up the time of its steps, so
    the time Mesh spends outside `pipe.step()` can be told apart (about 1 us per step)."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self.seconds = 0.0

    def step(self) -> None:
        t0 = time.perf_counter()
        self._pipe.step()
        self.seconds += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


class _FlatTimes:
    """Iteration times for the scheduler; any values do (one instance, nothing refused)."""

    def prefill_s(self, prompt_len: int) -> float:
        return 0.001 * prompt_len

    def decode_s(self, batch: int, avg_context: float) -> float:
        return 0.02


def run(n: int = 16, output_len: int = 64, rounds: int = 6, scale: float = 8.0, seed: int = 0,
        model: str | None = None, trace: str | None = None, wait_quiet_s: float = 60.0) -> dict[str, Any]:
    from mesh.bench.fidelity import DEFAULT_TRACE
    from mesh.calibration.openvino_calibration import TokenPrompts
    from mesh.calibration.runner import CpuMeter, wait_for_quiet
    from mesh.engines.openvino_engine import OpenVINOEngine
    from mesh.modelfiles.demo import demo_gguf_path

    model_path = Path(model) if model else demo_gguf_path(fetch=True)
    lengths = _requests(n, scale, output_len, seed, trace or DEFAULT_TRACE)
    engine = OpenVINOEngine(model_path, model_name="m", context_window=WINDOW, max_num_seqs=MAX_BATCH,
                            ignore_eos=True)
    asyncio.run(engine.load())
    tp = TokenPrompts.for_engine(engine)
    prompts = [tp.ids(p, k) for k, (p, _) in enumerate(lengths)]
    pipe = engine._pipe  # the same pipeline for both paths (the bench may look inside)
    meter = CpuMeter()
    quiet = wait_for_quiet(min(30.0, wait_quiet_s)) if wait_quiet_s > 0 else None
    load_start = os.getloadavg()
    mesh, bare, shares, m_out, m_share = [], [], [], [], []
    next_id = 10**6
    budget = wait_quiet_s
    for r in range(rounds + 1):  # round 0 is the untimed warm-up
        order = ("mesh", "bare") if r % 2 == 0 else ("bare", "mesh")
        if r and budget > 0:  # before each timed pair, let other jobs leave the CPUs (bounded)
            t0 = time.perf_counter()
            wait_for_quiet(min(30.0, budget))
            budget -= time.perf_counter() - t0
        for path in order:
            before = meter.snapshot()
            if path == "mesh":
                timer = engine._pipe = _StepTimer(pipe)
                result = asyncio.run(_mesh_round(engine, prompts, output_len))
                engine._pipe = pipe
                if r:
                    m_out.append(1000 * (result[0] - timer.seconds) / result[2])
                    m_share.append((result[0] - timer.seconds) / result[0])
            else:
                result = _bare_round(pipe, prompts, output_len, next_id)
                next_id += len(prompts)
            share = meter.foreign_share(before, meter.snapshot())
            if r:
                (mesh if path == "mesh" else bare).append(result)
                if share is not None:
                    shares.append(share)
    load_end = os.getloadavg()
    asyncio.run(engine.unload())
    mesh_tps = [tok / wall for wall, tok, _ in mesh]
    bare_tps = [tok / wall for wall, tok, _ in bare]
    m, b = statistics.median(mesh_tps), statistics.median(bare_tps)
    return {
        "mesh_tokens_per_s": m,
        "bare_tokens_per_s": b,
        "ratio": m / b,
        "target_ratio": 0.95,
        "mesh_tokens_per_s_runs": [round(x, 1) for x in mesh_tps],
        "bare_tokens_per_s_runs": [round(x, 1) for x in bare_tps],
        "ratio_of_paired_runs": [round(x / y, 3) for x, y in zip(mesh_tps, bare_tps)],
        "ratio_paired_median": statistics.median(x / y for x, y in zip(mesh_tps, bare_tps)),
        "mesh_outside_step_ms_per_iteration": statistics.median(m_out),
        "mesh_outside_step_share": statistics.median(m_share),
        "tokens_per_run": mesh[0][1],
        "mesh_iterations": mesh[0][2],
        "bare_steps": bare[0][2],
        "requests": n,
        "output_len": output_len,
        "mean_prompt_len": statistics.fmean(p for p, _ in lengths),
        "rounds": rounds,
        "others_cpu_share_max": max(shares) if shares else None,
        "others_cpu_share_runs": shares,
        "others_cpu_share_before": quiet,
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in load_end],
    }


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="tokens/s through Mesh's node runtime vs the bare OpenVINO pipeline")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--requests", type=int, default=16, help="requests per run, submitted at once (default 16)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--rounds", type=int, default=6, help="timed runs of each path (default 6)")
    p.add_argument("--scale", type=float, default=8.0, help="divide the trace's prompt lengths by this")
    p.add_argument("--model", help="GGUF or IR (default: the demo model)")
    p.add_argument("--trace", help="Azure LLM trace CSV for prompt lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-quiet", type=float, default=60.0, metavar="S",
                   help="wait up to S seconds in all for other processes to leave the CPUs before the timed "
                        "runs (0: do not wait; default 60)")
    p.set_defaults(func=lambda a: emit(
        "mesh bench engine", run(a.requests, a.output_len, a.rounds, a.scale, a.seed, a.model, a.trace,
                                 a.wait_quiet), a.json,
        {"mesh_tokens_per_s": "tok/s", "bare_tokens_per_s": "tok/s"},
    ))
