"""Run a workload under one policy on a simulated cluster, in virtual time (LLM-Mesh 8.1).

The cluster is the real runtime (NodeRuntime per node, the dispatcher, the policy) with a
SimulatedEngine per instance whose iteration times come from the calibrated profiles, on
mesh.replay.virtual_loop: the waiting is skipped, the decisions are the ones a live
cluster would make. Wall time is measured with time.perf_counter (only here).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from mesh.control.cluster_node import EXITED
from mesh.control.dispatcher import DEFAULT_RETRY_INTERVAL_S, Dispatcher, DispatchStats
from mesh.control.fleet import ClusterConfig, Fleet, ModelSpec, check_cluster
from mesh.control.schedulers import SchedulerStats, scheduler_spec
from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.perf.profile import ProfileError, catalog_profile, reference_profiles
from mesh.policy.dispatch_rules import CPU, GPU
from mesh.policy.queueing import DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_TIMEOUT_S
from mesh.replay.simulator import EngineFactory, Simulator
from mesh.replay.virtual_loop import run_virtual
from mesh.wire.served_request import ServedRequest
from workloads.workload import Workload

DEFAULT_CPU_DEVICE = "xeon-6462c"
DEFAULT_GPU_DEVICE = "a100-80gb"


@dataclass(frozen=True)
class NodeFailure:
    """A node lost during a replay, as a node agent is lost live (mesh.replay.local_node
    LocalNode.lose): at `at_s` seconds into the workload, its requests go back to the
    dispatcher with their progress, and it takes nothing for `down_s` seconds (its agent
    restarting)."""

    node_id: str
    at_s: float
    down_s: float = 1.0
    cause: str = EXITED


@dataclass(frozen=True)
class ReplayConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    queue_capacity: int = DEFAULT_QUEUE_CAPACITY
    retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S
    queue_timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S  # None: turned away once it cannot meet its SLO
    drain_limit_s: float = 600.0  # virtual time after the window for in-flight requests to end
    progress: bool = True
    engines: Callable[[Fleet],
                      EngineFactory] | None = None  # per run: its engines (e.g. mesh.replay.cold_start_modes.Engines)
    failures: tuple[NodeFailure, ...] = ()  # nodes lost during the run


@dataclass
class NodeStats:
    node_id: str
    kind: str
    iterations: int
    busy_s: float
    decode_tokens: int
    prefill_tokens: int


@dataclass
class PolicyRun:
    """Everything a replay of one policy produced."""

    policy: str
    duration_s: float  # the workload window
    end_s: float  # virtual time when the last request ended
    wall_s: float
    requests: list[ServedRequest]
    usage: list[tuple[float, int, int]]  # (time, CPU nodes in use, GPU nodes in use), change points
    nodes: list[NodeStats]
    dispatch: DispatchStats
    policy_stats: SchedulerStats
    instances_started: int
    instances_recycled: int
    queue_peak: int
    accounting: dict[str, int]


def known_models() -> list[str]:
    """Models with a packaged reference profile on both the CPU and the GPU device."""
    pairs = set(reference_profiles())
    return sorted({m for m, d in pairs if d == DEFAULT_CPU_DEVICE and (m, DEFAULT_GPU_DEVICE) in pairs})


def build_catalog(
    bases: list[str],
    *,
    cpu_device: str = DEFAULT_CPU_DEVICE,
    gpu_device: str = DEFAULT_GPU_DEVICE,
    profile_dir: str | Path | None = None,
) -> dict[str, ModelSpec]:
    """A ModelSpec per base model: `profile_dir/<model>__<device>.json` if that file exists,
    else the packaged reference profile. Errors name the file (and the line for bad JSON)
    or list the models that have profiles."""
    catalog = {}
    for base in bases:
        profiles = {}
        for kind, device in ((CPU, cpu_device), (GPU, gpu_device)):
            try:
                profiles[kind] = catalog_profile(base, device, profile_dir)
            except ProfileError as exc:
                if "no reference profile" not in str(exc):
                    raise  # a bad file: its own message names it
                path = Path(profile_dir) / f"{base}__{device}.json" if profile_dir is not None else None
                where = f" and no {path}" if path is not None else ""
                raise ProfileError(f"unknown model {base!r}: no profile for it on {device}{where}; "
                                   f"valid models: {', '.join(known_models())}") from None
        catalog[base] = ModelSpec(base, profiles)
    return catalog


def _served(workload: Workload, slo) -> list[ServedRequest]:
    return [
        ServedRequest(
            EngineRequest(a.request_id, a.prompt_len, Sampling(max_tokens=max(1, a.output_len)),
                          output_len=a.output_len),
            a.model, a.time_s, slo,
        )
        for a in workload.arrivals
    ]


async def _run(workload: Workload, policy: str, config: ReplayConfig, catalog: dict[str, ModelSpec],
               prior: dict[str, float]) -> PolicyRun:
    loop = asyncio.get_running_loop()
    simulator = Simulator(config.cluster, catalog, workload.models, prior)
    cluster = simulator.cluster
    if config.engines is not None:
        simulator.engine_factory = config.engines(cluster)
    dispatcher = Dispatcher.for_policy(
        cluster, policy, queue_capacity=config.queue_capacity, retry_interval_s=config.retry_interval_s,
        queue_timeout_s=config.queue_timeout_s,
    )
    pol = dispatcher.policy
    lost = [(f, cluster.node(f.node_id)) for f in config.failures]  # ClusterError for a node it does not have
    await cluster.start()
    requests = _served(workload, config.cluster.slo)
    duration = workload.duration_s
    bar = tqdm(total=round(duration), unit="s", desc=f"{policy:>14}", disable=not config.progress,
               leave=True, dynamic_ncols=True, mininterval=0.5)

    async def progress() -> None:
        step = max(1.0, duration / 200)
        shown = 0
        while True:
            await asyncio.sleep(step)
            cluster.check_nodes()
            dispatcher.check()
            now = min(round(loop.time()), round(duration))
            bar.update(now - shown)
            shown = now
            bar.set_postfix(done=sum(1 for r in requests if r.outcome is not None), refresh=False)

    ticker = loop.create_task(progress())
    start = loop.time()
    for failure, node in lost:
        loop.call_at(start + failure.at_s, lambda f=failure, n=node: n.lose(
            f"node {f.node_id} lost at {f.at_s:g} s of the replay", f.cause, f.down_s, dispatcher.capacity_freed))
    try:
        for req in requests:
            delay = start + req.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            dispatcher.submit(req)
        dispatcher.close()
        remaining = max(0.0, start + duration - loop.time()) + config.drain_limit_s
        done, _ = await asyncio.wait([loop.create_task(dispatcher.all_done.wait()), ticker], timeout=remaining,
                                     return_when=asyncio.FIRST_COMPLETED)
        if ticker in done:
            ticker.result()  # a node crashed: raise it
        if not dispatcher.all_done.is_set():
            dispatcher.abort_all(f"still in flight {config.drain_limit_s:g} s after the window ended")
        cluster.check_nodes()
        dispatcher.check()
    finally:
        ticker.cancel()
        bar.update(round(duration) - bar.n)
        bar.close()
    end = loop.time()
    await cluster.stop()
    nodes = [NodeStats(n.node_id, n.spec.kind, r.iteration_count, r.busy_s, r.decode_tokens, r.prefill_tokens)
             for n, r in ((n, n.runtime) for n in cluster.nodes)]
    return PolicyRun(
        policy, duration, end - start, 0.0, requests, list(cluster.usage), nodes, dispatcher.stats, pol.stats,
        cluster.instances_started, cluster.instances_recycled, dispatcher.queue.peak, dispatcher.accounting(),
    )


def mean_output_prior(workload: Workload) -> dict[str, float]:
    """O_avg's starting value per base model (6.1): the mean output length of the length
    trace's rows eligible for that model, i.e. the historical mean (not the replayed one)."""
    out = {}
    for base, info in workload.description.get("per_model", {}).items():
        out[base] = float(info.get("trace_mean_output_len") or info.get("mean_output_len") or 256.0)
    return out


def run_policy(
    workload: Workload,
    policy: str,
    config: ReplayConfig,
    catalog: dict[str, ModelSpec],
    prior: dict[str, float] | None = None,
) -> PolicyRun:
    """Replay `workload` under `policy`; raises ClusterError/UnknownScheduler before running."""
    spec = scheduler_spec(policy)
    check_cluster(config.cluster, catalog, spec.kinds, policy)
    prior = prior if prior is not None else mean_output_prior(workload)
    t0 = time.perf_counter()
    run = run_virtual(_run(workload, policy, config, catalog, prior))
    run.wall_s = time.perf_counter() - t0
    return run


def trace_mean_output(lengths, max_total: int | None) -> float:
    """Mean output length of the length trace's rows that fit `max_total` (O_avg prior)."""
    mask = lengths.eligible_mask(max_total)
    return float(np.asarray(lengths.generated_tokens)[mask].mean())
