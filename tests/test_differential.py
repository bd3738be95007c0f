"""The differential test (issue 24 item 3): one scenario through the replay and through the
service, decision for decision.

The same workload (200 requests for 16 models on 2 CPU + 2 GPU nodes, Xeon 6462C and
A100-80GB) runs twice under the `mesh` policy:

- replay: `run_policy`, LocalNodes with simulated engines on the virtual-time loop;
- live: the service's `ClusterControl` (the dispatcher over one AgentNode per node), whose
  node agents are real `python -m mesh.agent --emulate DEVICE` processes with emulated
  engines on the wall clock, requests submitted at their arrival times as the HTTP routes
  submit them (a `Job` with the prompt's token ids).

Both sides read the same catalog profiles, SLO, cold-start model, memory, keep-alive and
queue settings, and neither has noise, so the two runs differ only by what the live
control plane does differently (round trips, the wall clock). TIME_SCALE multiplies every
time of the scenario (the profiles' iteration times, written to a profile folder both
sides read: the replay's catalog and the agents' `--emulate-profiles`; the SLO; the cold
starts; the arrivals, keep-alive and queue timeout) to make the live run shorter; it is 1
here: at 0.4 and 0.6 the live decisions' round trips (5-90 ms on a loaded 2-core machine)
were too large against the scaled SLOs and flipped borderline requests. The live run takes
about two minutes (the slow mark; the replay-only check is fast).

Each request is compared by where it completed (node), whether it was preempted (moved by
7.1) and whether it was rejected. The scenario holds cold starts, preemptions, evictions
and queue expiries in both runs (asserted), at least 95% of the requests agree, and the SLO
rates are within 2 points. docs/evaluation.md ("The differential test") has the figures.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import pytest

from mesh.bench.emulated_weights import arrival_job
from mesh.control.dispatcher import accounting
from mesh.control.fleet import ClusterConfig
from mesh.control.supervisor import AgentSettings
from mesh.engines.emulation import emulated_nodes
from mesh.perf.load_times import ColdStart
from mesh.perf.profile import catalog_profile, save_profile
from mesh.policy.slo import SLO
from mesh.replay.driver import ReplayConfig, build_catalog, run_policy
from mesh.service.cluster_control import ClusterControl, ClusterSettings
from mesh.service.errors import ApiError
from mesh.service.model_catalogue import MEAN_OUTPUT_PRIOR
from mesh.service.registry import ModelRecord
from mesh.wire.served_request import Outcome, ServedRequest
from workloads.workload import Arrival, Workload

TIME_SCALE = 1.0  # every time of the scenario (profiles, SLO, cold starts, arrivals, keep-alive, queue timeout) x this
EMULATE = "xeon-6462c:2,a100-80gb:2"
DEVICES = {"cpu": "xeon-6462c", "gpu": "a100-80gb"}
BASES = ["llama-2-13b"] * 3 + ["llama-2-7b"] * 7 + ["llama-3.2-3b"] * 6  # 16 models
MEMORY = {"cpu": 256 * 2**30, "gpu": 32 * 2**30}  # GPU nodes smaller than the device's: KV caches run short
SEED = 5
REQUESTS = 200
PROMPT_MAX = 512  # prompts of 64 to this many tokens
WINDOW_S = 60.0  # unscaled
LONG = (300, 500)  # outputs of a LONG_SHARE of the requests: they outgrow the KV estimate made with O_avg (6.1)
LONG_SHARE = 0.05
BURST_LONG = (300, 500)  # outputs of the burst's requests
BURST, BURST_AT_S, BURST_S, BURST_MODEL = 24, 30.0, 3.0, "f00"  # unscaled times
KEEP_ALIVE_S = 5.0  # unscaled
QUEUE_TIMEOUT_S = 30.0  # unscaled (the replay's default); under mesh a request leaves once it cannot meet its SLO
QUEUE_CAPACITY = 900


def scenario(seed: int = SEED, scale: float = TIME_SCALE) -> Workload:
    """REQUESTS requests (times x scale) for 16 models: a background over WINDOW_S of
    skewed popularity (prompts of 64-PROMPT_MAX tokens, outputs of 16-200, LONG for a share of
    them), and a burst of BURST long requests for one 13B model at BURST_AT_S (they outgrow
    the KV estimate made with O_avg, 6.1, on a node whose memory is short: evictions)."""
    rng = random.Random(seed)
    models = {f"f{i:02d}": BASES[i] for i in range(len(BASES))}
    names = list(models)
    weights = [1 / (i + 1) for i in range(len(names))]
    rng.shuffle(weights)
    times = [rng.uniform(0, WINDOW_S) for _ in range(REQUESTS - BURST)]
    burst = [BURST_AT_S + rng.uniform(0, BURST_S) for _ in range(BURST)]
    rows = []
    for t in times:
        model = rng.choices(names, weights)[0]
        out = rng.randint(*LONG) if rng.random() < LONG_SHARE else rng.randint(16, 200)
        rows.append((t, model, rng.randint(64, PROMPT_MAX), out))
    for t in burst:
        rows.append((t, BURST_MODEL, rng.randint(64, PROMPT_MAX), rng.randint(*BURST_LONG)))
    rows.sort()
    arrivals = [Arrival(f"r{k:03d}", t * scale, m, m, p, o) for k, (t, m, p, o) in enumerate(rows)]
    return Workload(arrivals, models, {"duration_s": WINDOW_S * scale, "seed": seed})


def scaled_cold_start(scale: float = TIME_SCALE) -> ColdStart:
    """The replay's cold-start model with its loads x scale (faster bandwidths)."""
    base = ColdStart()
    return dataclasses.replace(base, pcie_bytes_per_s=base.pcie_bytes_per_s / scale,
                               cpu_load_bytes_per_s=base.cpu_load_bytes_per_s / scale)


def scaled_slo(scale: float = TIME_SCALE) -> SLO:
    base = SLO()
    return SLO(base.ttft_min_s * scale, base.ttft_s_per_prompt_token * scale, base.tpot_s * scale)


def write_profiles(folder: Path, scale: float = TIME_SCALE) -> Path:
    """The catalog profiles of BASES on both devices with every time x scale, as calibrated
    profiles `<model>__<device>.json` (what the replay's catalog and `--emulate-profiles` read)."""
    folder.mkdir(parents=True, exist_ok=True)
    for base in sorted(set(BASES)):
        for device in DEVICES.values():
            p = catalog_profile(base, device)
            scaled = dataclasses.replace(
                p, prefill_s=tuple(s * scale for s in p.prefill_s),
                decode_s=tuple(tuple(s * scale for s in row) for row in p.decode_s),
                overheads={k: v * scale for k, v in p.overheads.items()},
                provenance={**p.provenance, "time_scale": scale})
            save_profile(scaled, folder / f"{base}__{device}.json")
    return folder


# ---- the two runs ------------------------------------------------------------------------------

def replay(workload: Workload, profiles: Path, scale: float = TIME_SCALE,
           policy: str = "mesh") -> tuple[list[ServedRequest], Any]:
    """The scenario in virtual time: LocalNodes with simulated engines."""
    catalog = build_catalog(sorted(set(workload.models.values())), cpu_device=DEVICES["cpu"],
                            gpu_device=DEVICES["gpu"], profile_dir=profiles)
    cluster = ClusterConfig(cpu_nodes=2, gpu_nodes=2, cpu_memory_bytes=MEMORY["cpu"], gpu_memory_bytes=MEMORY["gpu"],
                            keep_alive_s=KEEP_ALIVE_S * scale, slo=scaled_slo(scale),
                            cold_start=scaled_cold_start(scale),
                            max_batch=ClusterSettings().max_batch, noise=0.0)
    config = ReplayConfig(cluster=cluster, queue_capacity=QUEUE_CAPACITY, queue_timeout_s=QUEUE_TIMEOUT_S * scale,
                          progress=False)
    run = run_policy(workload, policy, config, catalog, {b: MEAN_OUTPUT_PRIOR for b in catalog})
    return run.requests, run


async def live(workload: Workload, profiles: Path, scale: float = TIME_SCALE,
               policy: str = "mesh") -> tuple[list[ServedRequest], Any]:
    """The scenario through the service's cluster control: AgentNodes over emulated node agents
    (real processes), requests submitted at their arrival times on the wall clock."""
    nodes, devices = emulated_nodes(EMULATE, profiles)
    nodes = [dataclasses.replace(n, memory_bytes=MEMORY[n.kind]) for n in nodes]
    settings = ClusterSettings(
        policy=policy, keep_alive_s=KEEP_ALIVE_S * scale, cold_start_s=0.0, queue_capacity=QUEUE_CAPACITY,
        queue_timeout_s=QUEUE_TIMEOUT_S * scale,
        agent=AgentSettings(emulate=devices, emulate_noise=0.0, emulate_profiles=str(profiles)))
    control = ClusterControl(nodes, settings)
    # the service's cold-start model, scaled as the replay's (what its plans predict and, through
    # InstanceSpec.emulated_load_s, what its emulated loads take)
    control.cluster.config = dataclasses.replace(control.cluster.config, cold_start=scaled_cold_start(scale))
    slo = scaled_slo(scale)
    records = {m: ModelRecord(f"u-{m}", "diff", m, "emulated", base, 4096, slo)
               for m, base in workload.models.items()}
    await control.start()
    loop = asyncio.get_running_loop()
    submitted: list[ServedRequest] = []  # the dispatcher keeps only requests in flight: the test keeps them all
    dispatcher_submit = control.dispatcher.submit
    control.dispatcher.submit = lambda req: (submitted.append(req), dispatcher_submit(req))[1]
    errors: list[str] = []
    retry_after: list[int] = []

    async def one(a: Arrival, start: float) -> None:
        await asyncio.sleep(max(0.0, start + a.time_s - loop.time()))
        try:
            stream = await control.submit(arrival_job(a, records[a.model], loop.time()))
            async for _event in stream.events():
                pass
        except ApiError as exc:
            if exc.status == 429:  # turned away: Retry-After, the time left of its model's cold start (else 1 s)
                retry_after.append(int(exc.headers["Retry-After"]))
            elif exc.status != 503:  # 503: failed after it started (an eviction it could not survive)
                errors.append(f"{a.request_id}: {exc.status} {exc.message}")

    try:
        for record in {r.uid: r for r in records.values()}.values():  # described before the clock starts
            await control.catalogue.described(record)
        start = loop.time() + 0.5
        await asyncio.wait_for(asyncio.gather(*(one(a, start) for a in workload.arrivals)),
                               workload.duration_s + 120.0)
        requests = list(submitted)
        view = control.view()
    finally:
        await control.stop()
    assert not errors, errors[:5]
    # whole seconds, at least 1, at most what a cold start here takes (13B on a GPU: 1.2 s, behind other loads)
    assert retry_after and all(1 <= s <= 3 for s in retry_after), retry_after
    for r in requests:  # times from the workload's start, as the replay's
        r.arrival_s -= start
        r.first_token_s = None if r.first_token_s is None else r.first_token_s - start
        r.finish_s = None if r.finish_s is None else r.finish_s - start
    return requests, view


# ---- the comparison -------------------------------------------------------------------------------

def decision(r: ServedRequest) -> tuple[str | None, bool, bool]:
    """(node it completed on, preempted, rejected): what the comparison compares. Node ids
    are the replay's (cpu0) and the service's (cpu-0) of the same node."""
    node = r.node_id.replace("-", "") if r.outcome is Outcome.COMPLETED and r.node_id else None
    preempted = any("preempted by" in a for a in r.attempts)
    return node, preempted, r.outcome is Outcome.REJECTED


def events(requests: list[ServedRequest]) -> dict[str, int]:
    """How often each thing the scenario must hold happened."""
    return {
        "preempted": sum(1 for r in requests if any("preempted by" in a for a in r.attempts)),
        "evicted": sum(r.evictions for r in requests),
        "expired": sum(1 for r in requests if r.outcome is Outcome.REJECTED and "waited" in r.detail),
        "rejected": sum(1 for r in requests if r.outcome is Outcome.REJECTED),
    }


def compare(simulated: list[ServedRequest], served: list[ServedRequest]) -> dict[str, Any]:
    sim = {r.request_id: r for r in simulated}
    real = {r.request_id: r for r in served}
    assert sim.keys() == real.keys()
    differ = sorted(rid for rid in sim if decision(sim[rid]) != decision(real[rid]))
    a_sim, a_real = accounting(simulated), accounting(served)
    return {
        "requests": len(sim), "agree": 1 - len(differ) / len(sim), "differ": differ,
        "slo_simulated": a_sim["slo_compliant"] / len(sim), "slo_live": a_real["slo_compliant"] / len(sim),
        "events_simulated": events(simulated), "events_live": events(served),
        "detail": {rid: (decision(sim[rid]), decision(real[rid]), sim[rid].attempts, real[rid].attempts,
                         sim[rid].detail[:80], real[rid].detail[:80]) for rid in differ},
    }


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> Path:
    return write_profiles(tmp_path_factory.mktemp("profiles"))


def test_the_scenario_holds_every_event_in_the_replay(profiles):
    """The scenario is what the issue asks for: 200+ requests, 16 models, 4 nodes, and in
    the replay at least one cold start, preemption, eviction and queue expiry."""
    workload = scenario()
    requests, run = replay(workload, profiles)
    assert len(workload) >= 200 and len(workload.models) == 16
    e = events(requests)
    assert run.instances_started >= 16 and e["preempted"] >= 1 and e["evicted"] >= 1 and e["expired"] >= 1, e


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_service_decides_as_the_replay(profiles):
    workload = scenario()
    simulated, run = replay(workload, profiles)
    t0 = time.monotonic()
    served, view = asyncio.run(live(workload, profiles))
    wall = time.monotonic() - t0
    result = compare(simulated, served)
    d = view["dispatcher"]
    print(f"differential: {result['requests']} requests, {result['agree']:.1%} agree; SLO simulated "
          f"{result['slo_simulated']:.1%} live {result['slo_live']:.1%}; events simulated {result['events_simulated']} "
          f"live {result['events_live']}; live instances {d['new_instances']} new, {d['preemptions']} preemptions; "
          f"replay {run.instances_started} instances, {run.policy_stats.preemptions} preemptions; "
          f"live wall {wall:.0f} s")
    for rid, row in result["detail"].items():
        print("  differs", rid, row)
    live_events, sim_events = result["events_live"], result["events_simulated"]
    for name in ("preempted", "evicted", "expired"):
        assert sim_events[name] >= 1 and live_events[name] >= 1, (name, sim_events, live_events)
    assert run.instances_started >= 16 and d["new_instances"] >= 16  # every model started cold
    assert result["agree"] >= 0.95, result["differ"]
    assert abs(result["slo_simulated"] - result["slo_live"]) <= 0.02
