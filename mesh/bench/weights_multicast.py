"""`mesh bench multicast`: weights by network multicast between node agents on loopback.

`--ray` runs it between Ray nodes, beside Ray's object store (mesh.bench.multicast_ray).

One source agent and N receiving agents (real processes), a model file of M MB of random
bytes cut into blocks, and for each plan (naive, chain, binomial): each target's
completion time (every block received and verified) and the whole (`total_s`), beside the
bound M/B (`bound_s`), B the single-stream bandwidth measured first with the same
transport (one agent to one agent, best of `--bw-repeats`), and one block time (`block_s`).
The target: chain and binomial within 1.15 x bound + one block time; naive about
N x bound.

On loopback every "link" is the same kernel memcpy on the same 2 cores, so N receivers
share one machine's bandwidth instead of having a NIC each. `--link-mbps L` paces every
agent's uplink to L Mbit/s (a per-node NIC, the model of BlitzScale 5.1 and lambdaScale 4.2);
pick L so that N x L stays well below what the machine moves, and the plans' shape is
measured fairly. The JSON records the mode, the bandwidth and the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from mesh.bench.random_model import write_random_model
from mesh.bench.report import write_json
from mesh.perf.load_times import CostModel, schedule
from mesh.policy.multicast import PLANS, make_plan, naive
from mesh.weights.blocks import Manifest, pack
from mesh.weights.coordinator import multicast
from mesh.weights.launch import new_token, spawn_agents, stop_agents

MB = 10**6
TARGET_FACTOR = 1.15


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def _bench(receivers: int, size_mb: float, plans: Sequence[str], block_mb: float, link_mbps: float | None,
                 bw_repeats: int, repeat: int, lookahead: int, save: bool, seed: int,
                 workdir: str | None) -> dict[str, Any]:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mesh-multicast-", dir=workdir) as tmp:
        model = Path(tmp) / "model.bin"
        write_random_model(model, int(size_mb * MB), seed)
        manifest: Manifest = pack(model, int(block_mb * MB), model="random-model")
        block_bytes = manifest.blocks[0].size
        targets = [f"r{i}" for i in range(receivers)]
        token = new_token()  # the agents require it, as on a real network (MESH_WEIGHTS_TOKEN)
        agents = await spawn_agents(["src", *targets], link_mbps, token=token)
        addresses = {n: a.address for n, a in agents.items()}
        try:
            # B: one agent to one agent, the same transport and checksums, best of a few
            singles = []
            for i in range(bw_repeats):
                r = await multicast(addresses, manifest, naive(["src"], ["r0"], manifest.count), {"src": str(model)},
                                    transfer_id=f"bw{i}", token=token)
                singles.append(r.total_s)
            bandwidth = manifest.total_bytes / min(singles)
            bound = manifest.total_bytes / bandwidth
            cost = CostModel(block_bytes, bandwidth)
            out: dict[str, Any] = {
                "receivers": receivers, "size_mb": manifest.total_bytes / MB, "block_mb": block_bytes / MB,
                "blocks": manifest.count, "mode": "paced" if link_mbps else "loopback", "link_mbps": link_mbps,
                "bandwidth_MBps": bandwidth / MB, "single_stream_s": singles, "bound_s": bound,
                "block_s": cost.block_s, "lookahead": lookahead, "repeat": repeat,
                "cpu_count": os.cpu_count(), "loadavg_before": list(load_before),
            }
            for name in plans:
                plan = make_plan(name, ["src"], targets, manifest.count)
                runs = []
                for i in range(repeat):
                    outputs = {t: str(Path(tmp) / f"{name}-{t}.bin") for t in targets} if save else None
                    cpu0 = sum(process_cpu_s(a.pid) for a in agents.values())
                    t0 = time.perf_counter()
                    r = await multicast(addresses, manifest, plan, {"src": str(model)}, outputs,
                                        transfer_id=f"{name}{i}", lookahead=lookahead, token=token)
                    runs.append((r, time.perf_counter() - t0,
                                  sum(process_cpu_s(a.pid) for a in agents.values()) - cpu0))
                    for path in (outputs or {}).values():  # free the disk early
                        Path(path).unlink(missing_ok=True)
                r, wall, cpu = sorted(runs, key=lambda x: x[0].total_s)[len(runs) // 2]  # the median run
                target = TARGET_FACTOR * bound + cost.block_s
                out[name] = {
                    "total_s": r.total_s, "bound_s": bound, "ratio": r.total_s / bound,
                    "block_s": cost.block_s, "rounds": plan.rounds,
                    "predicted_s": schedule(plan, cost, manifest.sizes()).total_s,
                    "target_s": target if name != "naive" else receivers * bound,
                    "within_target": r.total_s <= target if name != "naive" else None,
                    "completion_s": dict(sorted(r.completion_s.items(), key=lambda kv: kv[1])),
                    "runs_total_s": [x[0].total_s for x in runs],
                    "wall_s_with_setup": wall,
                    # CPU the agents used (setup included: the source reads and checks the file)
                    "agents_cpu_s": cpu,
                    "cpu_s_per_GB_received": cpu / (receivers * manifest.total_bytes / 1e9),
                }
                if save:
                    out[name]["saved_s"] = r.saved_s
        finally:
            await stop_agents(agents)
    out["loadavg_after"] = list(os.getloadavg())
    return out


def run(receivers: int = 4, size_mb: float = 500, plans: Sequence[str] = ("naive", "chain", "binomial"),
        block_mb: float = 4, link_mbps: float | None = None, bw_repeats: int = 2, repeat: int = 1,
        lookahead: int = 0, save: bool = False, seed: int = 0, workdir: str | None = None) -> dict[str, Any]:
    if receivers < 1:
        raise ValueError(f"--receivers must be >= 1, got {receivers}")
    if size_mb <= 0 or block_mb <= 0:
        raise ValueError("--size-mb and --block-mb must be > 0")
    if repeat < 1 or bw_repeats < 1:
        raise ValueError("--repeat and --bw-repeats must be >= 1")
    unknown = [p for p in plans if p not in PLANS]
    if unknown or not plans:
        raise ValueError(f"--plans: unknown plan {unknown[0]!r}" if unknown else "--plans: none given")
    return asyncio.run(_bench(receivers, size_mb, plans, block_mb, link_mbps, bw_repeats, repeat, lookahead,
                              save, seed, workdir))


def report(fig: dict[str, Any], plans: Sequence[str], json_path: str | None) -> None:
    mode = f"paced to {fig['link_mbps']:g} Mbit/s per node" if fig["link_mbps"] else "unpaced loopback"
    print(f"mesh bench multicast: 1 source -> {fig['receivers']} receivers, {fig['size_mb']:.0f} MB in "
          f"{fig['blocks']} blocks of {fig['block_mb']:.1f} MB, {mode}")
    print(f"  single-stream B = {fig['bandwidth_MBps']:.0f} MB/s, bound M/B = {fig['bound_s']:.3f} s, "
          f"block time = {fig['block_s'] * 1000:.1f} ms, load average {fig['loadavg_before'][0]:.2f} -> "
          f"{fig['loadavg_after'][0]:.2f} on {fig['cpu_count']} cores")
    print(f"  {'plan':<9} {'total_s':>8} {'bound_s':>8} {'x bound':>8} {'target_s':>9} {'model_s':>8} "
          f"{'agent CPU s':>11}  first/last target")
    for name in plans:
        p = fig[name]
        times = list(p["completion_s"].values())
        print(f"  {name:<9} {p['total_s']:8.3f} {p['bound_s']:8.3f} {p['ratio']:8.2f} {p['target_s']:9.3f} "
              f"{p['predicted_s']:8.3f} {p['agents_cpu_s']:11.1f}  {times[0]:.3f} / {times[-1]:.3f}")
    if json_path:
        write_json(json_path, fig)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("multicast", help="weights by multicast between agent processes: naive vs chain vs binomial")
    p.add_argument("--receivers", type=int, default=4, help="receiving agents (N)")
    p.add_argument("--size-mb", type=float, default=500, help="model size M in MB (random bytes)")
    p.add_argument("--block-mb", type=float, default=4, help="block size in MB")
    p.add_argument("--plans", default=None,
                   help="comma-separated plan names (default naive,chain,binomial; with --ray chain,binomial)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="between Ray nodes, beside Ray's object store (rows chain, binomial, ray_object_store): "
                        "on the Ray cluster at ADDRESS, or, bare, on a local Ray cluster of 1 + N nodes it starts "
                        "(mesh.bench.multicast_ray)")
    p.add_argument("--link-mbps", type=float, default=None,
                   help="pace each agent's uplink to this many Mbit/s (a NIC per node); default: unpaced")
    p.add_argument("--bw-repeats", type=int, default=2, help="single-stream runs to measure B (best kept)")
    p.add_argument("--repeat", type=int, default=1, help="runs per plan (the median run is reported)")
    p.add_argument("--lookahead", type=int, default=0,
                   help="sends a node may make ahead of plan order while waiting for a block (0: strict)")
    p.add_argument("--save", action="store_true", help="also write every received file (atomically)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")

    def go(a: argparse.Namespace) -> int:
        plans = [x.strip() for x in (a.plans or ("chain,binomial" if a.ray else "naive,chain,binomial")).split(",")
                 if x.strip()]
        if a.ray is not None:
            from mesh.bench import multicast_ray

            unknown = [x for x in plans if x not in PLANS]
            if unknown or not plans:
                raise SystemExit(f"mesh bench multicast: --plans: unknown plan {unknown[0]!r}" if unknown
                                 else "mesh bench multicast: --plans: none given")
            fig = multicast_ray.run(a.receivers, a.size_mb, a.block_mb, None if a.ray == "local" else a.ray, plans,
                                    a.bw_repeats, a.repeat, a.seed, a.link_mbps)
            multicast_ray.report(fig, a.json)
            return 0
        fig = run(a.receivers, a.size_mb, plans, a.block_mb, a.link_mbps, a.bw_repeats, a.repeat, a.lookahead,
                  a.save, a.seed)
        report(fig, plans, a.json)
        return 0

    p.set_defaults(func=go)
