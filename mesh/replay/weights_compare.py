"""Compare cold-start modes (mesh.replay.cold_start_modes) on a bursty single-model trace.

    python -m mesh.replay.weights_compare --model llama-2-7b --gpu-nodes 8 --minutes 5 \
        --time-scale 0.1 --json out.json

replays `workloads.workload.bursty_single_model` (the Azure LLM conversation trace's own
arrival times, compressed by --time-scale) on GPU nodes only, once per mode, under one
policy (default `sllm`: one instance per GPU, GPU only), and prints per mode TTFT p50/p90/p99,
SLO attainment, GPU node-seconds and the loads by source.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from mesh.control.fleet import ClusterConfig
from mesh.control.load_timing import MODES, WeightsConfig
from mesh.perf.load_times import GIB, ColdStart
from mesh.policy.live_scaling import late_for_layers
from mesh.replay.cold_start_modes import Engines
from mesh.replay.driver import ReplayConfig, build_catalog, run_policy, trace_mean_output
from mesh.replay.metrics import node_seconds, summarize
from mesh.wire.served_request import Outcome
from workloads.azure_llm import load_lengths
from workloads.datasets import CONVERSATION_FILE, DATA_DIR
from workloads.workload import Workload, bursty_single_model


def late_for_missing_layers(requests, waited: set[str]) -> int:
    """Requests served late because of missing layers (mesh.policy.live_scaling.late_for_layers)."""
    return sum(1 for r in requests if late_for_layers(r.request_id in waited, r.outcome is Outcome.COMPLETED,
                                                      r.slo_met, r.late_s != 0))


def compare(workload: Workload, base: str, modes: Sequence[str], weights: WeightsConfig, gpu_nodes: int,
            policy: str = "sllm", keep_alive_s: float = 1.0, prior: dict[str, float] | None = None,
            progress: bool = False) -> dict[str, dict[str, Any]]:
    """One replay per mode; per mode the summary (mesh.replay.metrics) plus the loads."""
    catalog = build_catalog([base])
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        cfg = replace(weights, mode=mode)
        nominal = cfg.nominal_bytes_per_s()
        cluster = ClusterConfig(cpu_nodes=0, gpu_nodes=gpu_nodes, gpu_memory_bytes=80 * GIB,
                                cold_start=ColdStart(nominal, nominal, cfg.fixed_s), keep_alive_s=keep_alive_s)
        eng = Engines(cfg)
        run = run_policy(workload, policy, ReplayConfig(cluster=cluster, engines=eng, progress=progress), catalog,
                         prior)
        s = summarize(run)
        _, gpu_all = node_seconds(run.usage, 0.0, max(run.end_s, run.duration_s))
        stats = eng.models[0].stats
        loads = sorted(stats.load_s)
        out[mode] = {
            "ttft_p50_s": s["ttft_p50_s"], "ttft_p90_s": s["ttft_p90_s"], "ttft_p99_s": s["ttft_p99_s"],
            "slo_rate": s["slo_rate"], "requests": s["requests"], "completed": s.get("completed"),
            "rejected": s["rejected"], "failed": s["failed"],
            "gpu_node_s": gpu_all, "gpu_node_s_window": s["gpu_nodes_avg"] * run.duration_s,
            "gpu_nodes_max": s["gpu_nodes_max"], "instances_started": s["instances_started"],
            "warm_ups": s.get("warm_ups", 0),
            "loads": dict(stats.loads), "multicasts": stats.multicasts,
            "live_pulls": stats.pulls, "pipelines": stats.pipelines, "activation_bytes": stats.activation_bytes,
            "recompute_tokens": stats.recompute_tokens,
            "late_missing_layers": late_for_missing_layers(run.requests, stats.waited),
            "load_s_min": loads[0] if loads else None, "load_s_median": loads[len(loads) // 2] if loads else None,
            "load_s_max": loads[-1] if loads else None,
        }
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    head = ("| mode | TTFT p50 (s) | p90 | p99 | SLO % | GPU node-s | max GPUs | instances | load s (median / max) "
            "| loads by source |")
    rows = [head, "|" + "---|" * 10]
    for mode, r in results.items():
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731 - a one-line formatter local to the table
        loads = ", ".join(f"{k} {v}" for k, v in sorted(r["loads"].items()))
        rows.append(f"| {mode} | {f(r['ttft_p50_s'], '.2f')} | {f(r['ttft_p90_s'], '.2f')} | "
                    f"{f(r['ttft_p99_s'], '.2f')} | {r['slo_rate']:.1%} | {r['gpu_node_s']:.0f} | {r['gpu_nodes_max']} "
                    f"| {r['instances_started']} | {f(r['load_s_median'], '.2f')} / {f(r['load_s_max'], '.2f')} | "
                    f"{loads} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mesh.replay.weights_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DATA_DIR),
                   help="folder with the Azure traces (default: the copies in workloads/data)")
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--gpu-nodes", type=int, default=8)
    p.add_argument("--minutes", type=float, default=5.0, help="window of the (rescaled) trace")
    p.add_argument("--time-scale", type=float, default=1.0, help="< 1 compresses the trace (higher rate, same bursts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="sllm")
    p.add_argument("--keep-alive", type=float, default=1.0, help="seconds an idle instance is kept")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--ssd-gbps", type=float, default=3.0, help="SSD read bandwidth, GB/s")
    p.add_argument("--pcie-gbps", type=float, default=25.0, help="host -> GPU bandwidth, GB/s")
    p.add_argument("--net-gbit", type=float, default=200.0, help="per-GPU network bandwidth, Gbit/s")
    p.add_argument("--block-mb", type=float, default=256.0)
    p.add_argument("--plan", default="binomial", choices=("binomial", "chain", "naive"))
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--progress", action="store_true")
    a = p.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown mode {bad[0]!r}; known: {', '.join(MODES)}")
    weights = WeightsConfig(ssd_bytes_per_s=a.ssd_gbps * 1e9, pcie_bytes_per_s=a.pcie_gbps * 1e9,
                            net_bytes_per_s=a.net_gbit * 1e9 / 8, block_bytes=int(a.block_mb * 2**20), plan=a.plan)
    catalog = build_catalog([a.model])
    max_total = catalog[a.model].profiles["gpu"].max_context
    lengths = load_lengths(Path(a.data) / CONVERSATION_FILE)
    workload = bursty_single_model(lengths, model=a.model, minutes=a.minutes, seed=a.seed, time_scale=a.time_scale,
                                   max_total=max_total)
    prior = {a.model: trace_mean_output(lengths, max_total)}
    results = compare(workload, a.model, modes, weights, a.gpu_nodes, a.policy, a.keep_alive, prior, a.progress)
    print(f"{len(workload.arrivals)} requests over {workload.duration_s:.0f} s, {a.model}, {a.gpu_nodes} GPU nodes, "
          f"policy {a.policy}, keep-alive {a.keep_alive:g} s")
    print(table(results))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "workload": workload.description, "results": results},
                                           indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
