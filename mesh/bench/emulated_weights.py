"""The bursty replay of docs/multicast.md live on emulated nodes, against its twin.

`mesh bench emulated-weights --model llama-2-13b --gpu-nodes 8 --minutes 5 --modes
multicast,multicast-live --json out.json`: the workload of mesh.replay.weights_compare
(`bursty_single_model`: the Azure conversation trace at its own timestamps, one model), once
per weights mode through the service's cluster control (a `ClusterControl` over real
emulating node agents, `python -m mesh.agent --emulate a100-80gb`, requests submitted at their
arrival times as the HTTP routes submit them; loads timed by mesh.control.load_timing,
ZigZag between the agents by mesh.node.lending), then through its twin
(mesh.replay.weights_compare.compare, virtual time, the same rules). Policy `sllm`, keep-alive
1 s, no noise on either side. Per mode and side: TTFT percentiles, SLO attainment, loads by
source; live, the ZigZag pulls and the requests served late for missing layers (the agents'
counts); the twin's `late_missing_layers`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from mesh.control.load_timing import MODES, WeightsConfig
from mesh.control.supervisor import AgentSettings
from mesh.engines.emulation import emulated_nodes
from mesh.engines.engine_api import Sampling
from mesh.policy.slo import SLO
from mesh.replay.driver import build_catalog, trace_mean_output
from mesh.replay.metrics import request_figures
from mesh.replay.weights_compare import compare
from mesh.service.cluster_control import ClusterControl, ClusterSettings
from mesh.service.errors import ApiError
from mesh.service.registry import ModelRecord
from mesh.service.streams import Job
from mesh.wire.served_request import ServedRequest
from workloads.azure_llm import load_lengths
from workloads.datasets import CONVERSATION_FILE, DATA_DIR
from workloads.workload import Arrival, Workload, bursty_single_model

DEVICE = "a100-80gb"  # the replay's GPU (mesh.replay.weights_compare)


def arrival_job(a: Arrival, record: ModelRecord, now: float) -> Job:
    """An arrival of a replay as the service's job for an emulated node: its prompt is
    synthetic token ids of its length (an emulated engine reads none), its output its
    length exactly."""
    return Job(a.request_id, record, now, Sampling(max_tokens=a.output_len, ignore_eos=True),
               prompt_token_ids=[100 + (i * 7919) % 30000 for i in range(a.prompt_len)])


async def run_live(workload: Workload, base: str, weights: WeightsConfig, gpu_nodes: int, policy: str = "sllm",
                   keep_alive_s: float = 1.0) -> dict[str, Any]:
    """The workload through the service's cluster control on `gpu_nodes` emulated GPUs whose
    loads follow `weights`: the request figures (times from the workload's start), the loads
    by source, and the agents' live counts."""
    nodes, devices = emulated_nodes(f"{DEVICE}:{gpu_nodes}")
    settings = ClusterSettings(policy=policy, keep_alive_s=keep_alive_s, cold_start_s=0.0, emulated_weights=weights,
                               agent=AgentSettings(emulate=devices, emulate_noise=0.0))
    control = ClusterControl(nodes, settings)
    record = ModelRecord(f"u-{base}", "bench", base, "emulated", base, 4096, SLO())
    loop = asyncio.get_running_loop()
    submitted: list[ServedRequest] = []
    dispatcher_submit = control.dispatcher.submit
    control.dispatcher.submit = lambda req: (submitted.append(req), dispatcher_submit(req))[1]  # type: ignore
    errors: list[str] = []
    live: dict[str, int] = {}

    async def one(a: Arrival, start: float) -> None:
        await asyncio.sleep(max(0.0, start + a.time_s - loop.time()))
        try:
            stream = await control.submit(arrival_job(a, record, loop.time()))
            async for _event in stream.events():
                pass
        except ApiError as exc:
            errors.append(f"{exc.status}")

    async def poll_live() -> None:  # the KV recomputed goes with its instance: the largest seen per node
        while True:
            await asyncio.sleep(1.0)
            for node in control.pool.nodes():
                await node.refresh()
                for key, value in node.stats.get("live", {}).items():
                    live[f"{node.node_id}:{key}"] = max(live.get(f"{node.node_id}:{key}", 0), value)

    await control.start()
    poller = loop.create_task(poll_live())
    try:
        await control.catalogue.described(record)
        start = loop.time() + 0.5
        wall = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(one(a, start) for a in workload.arrivals)),
                               workload.duration_s + 300.0)
        wall = time.monotonic() - wall
        for node in control.pool.nodes():  # the agents' counts at the end (they keep them for their life)
            await node.refresh()
            for key, value in node.stats.get("live", {}).items():
                live[f"{node.node_id}:{key}"] = max(live.get(f"{node.node_id}:{key}", 0), value)
        timing = control.catalogue.emulated_loads.timing
        loads = dict(timing.stats.loads) if timing is not None else {}
    finally:
        poller.cancel()
        await control.stop()
    for r in submitted:
        r.arrival_s -= start
        r.first_token_s = None if r.first_token_s is None else r.first_token_s - start
        r.finish_s = None if r.finish_s is None else r.finish_s - start
    figures = request_figures(submitted, [(0.0, 0, 0)], workload.duration_s)
    totals: dict[str, int] = {}
    for key, value in live.items():
        name = key.split(":", 1)[1]
        totals[name] = totals.get(name, 0) + value
    return {"ttft_p50_s": figures["ttft_p50_s"], "ttft_p90_s": figures["ttft_p90_s"],
            "ttft_p99_s": figures["ttft_p99_s"], "slo_rate": figures["slo_rate"], "requests": figures["requests"],
            "rejected": figures["rejected"], "failed": figures["failed"], "errors": len(errors),
            "loads": loads, "live": totals, "wall_s": wall}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("emulated-weights", help="the bursty replay of docs/multicast.md live on emulated GPU nodes "
                       "against its twin, per weights mode (live scaling on and off)")
    p.add_argument("--model", default="llama-2-13b")
    p.add_argument("--gpu-nodes", type=int, default=8)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="multicast,multicast-live")
    p.add_argument("--net-gbit", type=float, default=200.0, help="per-GPU network bandwidth, Gbit/s")
    p.add_argument("--json", type=Path, help="write both sides' figures per mode as JSON")

    def go(a: argparse.Namespace) -> int:
        modes = [m.strip() for m in a.modes.split(",") if m.strip()]
        if any(m not in MODES for m in modes):
            p.error(f"modes are {', '.join(MODES)}")
        catalog = build_catalog([a.model])
        max_total = catalog[a.model].profiles["gpu"].max_context
        lengths = load_lengths(Path(DATA_DIR) / CONVERSATION_FILE)
        workload = bursty_single_model(lengths, model=a.model, minutes=a.minutes, seed=a.seed, max_total=max_total)
        prior = {a.model: trace_mean_output(lengths, max_total)}
        results: dict[str, Any] = {}
        for mode in modes:
            cfg = WeightsConfig(mode, net_bytes_per_s=a.net_gbit * 1e9 / 8)
            twin = compare(workload, a.model, [mode], cfg, a.gpu_nodes, "sllm", 1.0, prior)[mode]
            live = asyncio.run(run_live(workload, a.model, cfg, a.gpu_nodes))
            results[mode] = {"live": live, "twin": twin}
            print(f"{mode}: live TTFT p50/p90/p99 {live['ttft_p50_s']:.2f}/{live['ttft_p90_s']:.2f}/"
                  f"{live['ttft_p99_s']:.2f} s, SLO {live['slo_rate']:.1%}, loads {live['loads']}, {live['live']}; "
                  f"twin {twin['ttft_p50_s']:.2f}/{twin['ttft_p90_s']:.2f}/{twin['ttft_p99_s']:.2f} s, "
                  f"SLO {twin['slo_rate']:.1%}, loads {twin['loads']}, pulls {twin['live_pulls']}, "
                  f"late for layers {twin['late_missing_layers']}", flush=True)
        if a.json:
            config = {k: v for k, v in vars(a).items() if k != "func"}
            a.json.write_text(json.dumps({"config": config, "requests": len(workload.arrivals), "results": results},
                                         indent=1, default=str) + "\n")
        return 0

    p.set_defaults(func=go)
