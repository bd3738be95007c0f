"""`mesh bench core`: the cost of the policy core and of the simulated node.

A node with 8 instances of Llama-2-7B (A100 reference profile), 32 running requests each:
- shadow validation latency (p50, p99) of a random candidate on a random instance;
- one scheduling decision (`next_iteration`), and a decision plus its bookkeeping;
- simulated iterations per wall-clock second: the same node driven by the node runtime with
  simulated engines on the virtual-time loop.
Targets on a 2-core machine: validation p99 <= 1 ms, decision <= 20 us, >= 50,000 it/s.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import numpy as np

from mesh.bench.report import emit
from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.engines.simulated import SimulatedEngine
from mesh.node.runtime import NodeRuntime
from mesh.perf import PerformanceModel, reference_profile
from mesh.policy.batching import IterationKind
from mesh.policy.compute import ComputeSubsystem
from mesh.policy.kv_demand import RunningMean
from mesh.policy.node_spec import NodeSpec
from mesh.policy.shadow import shadow_validate
from mesh.policy.slo import SLO
from mesh.replay.virtual_loop import run_virtual
from mesh.wire.served_request import ServedRequest

INSTANCES, REQUESTS = 8, 32
MODEL, DEVICE = "llama-2-7b", "a100-80gb"


def busy_node(model: PerformanceModel, rng: random.Random) -> ComputeSubsystem:
    """8 instances x 32 running requests, on time: prompt lengths, tokens produced and
    headrooms (0.05-1.5 s at now = 0) spread at random."""
    c = ComputeSubsystem()
    slo = SLO()
    for i in range(INSTANCES):
        iid = f"i{i}"
        c.add_instance(iid, model, slo, prefill_token_budget=4096)
        rounds = rng.randint(1, 200)
        rids = []
        for j in range(REQUESTS):
            rid, prompt = f"{iid}-r{j}", rng.randint(64, 1024)
            # next deadline = ST + TTFT + TPOT * (rounds + 1) = headroom, at now = 0
            start = rng.uniform(0.05, 1.5) - slo.ttft_s(prompt) - slo.tpot_s * (rounds + 1)
            c.add_request(iid, rid, prompt, start_s=start)
            rids.append(rid)
        c.complete_iteration(iid, IterationKind.PREFILL, rids)
        for _ in range(rounds):
            c.complete_iteration(iid, IterationKind.DECODE, rids)
    return c


def bench_validation(c: ComputeSubsystem, rng: random.Random, trials: int) -> list[float]:
    samples = []
    ids = list(c.instances)
    for k in range(trials):
        iid, prompt = rng.choice(ids), rng.randint(16, 2048)
        t0 = time.perf_counter()
        shadow_validate(c, iid, f"cand{k}", prompt, start_s=0.0, now=0.0)
        samples.append(time.perf_counter() - t0)
    return samples


def bench_decision(c: ComputeSubsystem, rounds: int) -> tuple[float, float]:
    """(seconds per next_iteration, seconds per next_iteration + complete_iteration)."""
    t0 = time.perf_counter()
    for _ in range(rounds):
        c.next_iteration(0.0)
    decide = (time.perf_counter() - t0) / rounds
    t0 = time.perf_counter()
    for _ in range(rounds):
        it = c.next_iteration(0.0)
        c.complete_iteration(it.instance_id, it.kind, [r.request_id for r in c.instances[it.instance_id].running])
    return decide, (time.perf_counter() - t0) / rounds


async def _simulated_node(model: PerformanceModel, output_len: int) -> tuple[int, float]:
    """Run 8 x 32 requests of `output_len` tokens to completion; (iterations, wall seconds)."""
    prof = model.profile
    node = NodeRuntime(NodeSpec("bench", prof.device_kind, 2**50))  # memory is not what is measured
    node.start()
    slo = SLO(tpot_s=10.0)  # lenient, so validation admits everything
    for i in range(INSTANCES):
        eng = SimulatedEngine(MODEL, model, kv_bytes_per_token=prof.kv_bytes_per_token,
                              weight_bytes=prof.weight_bytes, context_window=prof.max_context)
        node.memory_ops.start_instance(f"i{i}", MODEL, eng, model, slo, RunningMean(200), 0.0)
    await asyncio.sleep(1.0)
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()
    left = INSTANCES * REQUESTS

    def done(_: ServedRequest) -> None:
        nonlocal left
        left -= 1
        if not left:
            finished.set()

    for i in range(INSTANCES):
        for j in range(REQUESTS):
            er = EngineRequest(f"i{i}-r{j}", 128, Sampling(max_tokens=output_len), output_len=output_len)
            req = ServedRequest(er, MODEL, loop.time(), slo, on_done=done)
            node.admit(f"i{i}", req, node.admission.validate(f"i{i}", req))  # admitted whatever the verdict
    start_iterations = node.iteration_count
    t0 = time.perf_counter()
    await finished.wait()
    wall = time.perf_counter() - t0
    await node.stop()
    return node.iteration_count - start_iterations, wall


def run(trials: int = 2000, decisions: int = 20000, output_len: int = 3000, seed: int = 0) -> dict[str, float]:
    model = PerformanceModel(reference_profile(MODEL, DEVICE))
    rng = random.Random(seed)
    c = busy_node(model, rng)
    bench_validation(c, rng, 50)  # warm-up
    samples = np.array(bench_validation(c, rng, trials)) * 1000
    decide, decide_update = bench_decision(busy_node(model, rng), decisions)
    done, wall = run_virtual(_simulated_node(model, output_len))
    return {
        "shadow_validation_p50_ms": float(np.percentile(samples, 50)),
        "shadow_validation_p99_ms": float(np.percentile(samples, 99)),
        "shadow_validation_mean_ms": float(statistics.fmean(samples)),
        "decision_us": decide * 1e6,
        "decision_with_bookkeeping_us": decide_update * 1e6,
        "sim_iterations_per_s": done / wall,
        "sim_iterations": done,
        "node": f"{INSTANCES} instances x {REQUESTS} running requests, {MODEL} on {DEVICE} profile",
    }


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("core", help="policy core cost: shadow validation, decisions, simulated iterations/s")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--trials", type=int, default=2000, help="shadow validations to time")
    p.add_argument("--output-len", type=int, default=3000,
                   help="tokens per simulated request (8 x this many iterations)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=lambda a: emit(
        "mesh bench core", run(a.trials, output_len=a.output_len, seed=a.seed), a.json,
        {"shadow_validation_p50_ms": "ms", "shadow_validation_p99_ms": "ms", "shadow_validation_mean_ms": "ms",
         "decision_us": "us", "decision_with_bookkeeping_us": "us", "sim_iterations_per_s": "it/s"},
    ))
