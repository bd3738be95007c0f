"""Replay metrics (LLM-Mesh 8.2): SLO-compliant requests, nodes in use, decode throughput
per node, TTFT and TPOT percentiles, rejected and failed requests; and the comparison table.

Definitions:
- requests = slo_compliant + slo_violating (completed late) + rejected + failed;
  slo_rate = slo_compliant / requests. A request is SLO-compliant when its first token
  meets the TTFT SLO and its last token the Eq. 1 deadline ST + TTFT_SLO + TPOT_SLO (n-1)
  (mesh.control.dispatcher.eq1_slo_met); slo_compliant_strict also asks the mean TPOT after
  the first token to be within the TPOT SLO (ServedRequest.slo_met).
- cpu_nodes_avg / gpu_nodes_avg: nodes hosting at least one instance (loading included),
  time-averaged over the workload window [0, duration].
- decode throughput per node: tokens produced by decode iterations on nodes of a kind,
  divided by the node-seconds those nodes were in use (whole run, tail included).
- TTFT / TPOT percentiles: ttft_p*_s and tpot_p*_s over completed requests (TPOT: those with
  >= 2 tokens); ttft_p*_all_s over every request, a rejected or failed one counted as never
  served (infinite TTFT; the percentile is infinite, null in JSON, once it falls among them),
  so a policy that turns requests away does not look faster. The TTFT CDF plot counts every
  request too.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from mesh.control.dispatcher import accounting
from mesh.policy.dispatch_rules import CPU, GPU
from mesh.replay.driver import PolicyRun
from mesh.wire.served_request import Outcome, ServedRequest

PERCENTILES = (50, 90, 99)


def node_seconds(usage: Sequence[tuple[float, int, int]], start: float, end: float) -> tuple[float, float]:
    """Integral of (CPU nodes in use, GPU nodes in use) over [start, end]; `usage` holds the
    change points of a step function."""
    cpu = gpu = 0.0
    for k, (t, c, g) in enumerate(usage):
        t_next = usage[k + 1][0] if k + 1 < len(usage) else math.inf
        a, b = max(t, start), min(t_next, end)
        if b > a:
            cpu += c * (b - a)
            gpu += g * (b - a)
    return cpu, gpu


def usage_per_second(usage: Sequence[tuple[float, int, int]], duration: float) -> dict[str, list[int]]:
    """Nodes in use sampled at every whole second of the window (for JSON and plots)."""
    times = np.arange(0, int(math.ceil(duration)) + 1, dtype=float)
    change = np.array([u[0] for u in usage])
    idx = np.searchsorted(change, times, side="right") - 1
    idx = np.clip(idx, 0, len(usage) - 1)
    return {
        "t": times.astype(int).tolist(),
        "cpu": [usage[i][1] for i in idx],
        "gpu": [usage[i][2] for i in idx],
    }


def _pct(values: Sequence[float]) -> dict[int, float | None]:
    if len(values) == 0:
        return {p: None for p in PERCENTILES}
    arr = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return {p: float(v) for p, v in zip(PERCENTILES, arr)}


def ttft_all_percentiles(served: Sequence[float], unserved: int) -> dict[int, float]:
    """TTFT percentiles over every request: `served` TTFTs plus `unserved` requests never
    served (rejected or failed), counted as infinite. The p-th percentile is the smallest
    value with at least p% of requests at or below it (no interpolation, so a percentile that
    falls among the unserved is infinite rather than undefined)."""
    n = len(served) + unserved
    if n == 0:
        return {p: math.inf for p in PERCENTILES}
    ordered = sorted(served)
    out: dict[int, float] = {}
    for p in PERCENTILES:
        rank = max(1, math.ceil(p / 100 * n))  # 1-based rank of the p-th percentile
        out[p] = ordered[rank - 1] if rank <= len(ordered) else math.inf
    return out


def request_figures(requests: Sequence[ServedRequest], usage: Sequence[tuple[float, int, int]],
                    duration_s: float) -> dict[str, Any]:
    """The figures any replay of `requests` gives, simulated or live: counts by outcome, both
    SLO readings over every request, nodes in use over the window, TTFT and TPOT percentiles."""
    acc = accounting(requests)
    completed = [r for r in requests if r.outcome is Outcome.COMPLETED]
    ttft = _pct([r.ttft_s for r in completed])
    tpot = _pct([r.tpot_s for r in completed if r.tokens_out >= 2])
    ttft_all = ttft_all_percentiles([r.ttft_s for r in completed], len(requests) - len(completed))
    cpu_s, gpu_s = node_seconds(usage, 0.0, duration_s)
    out: dict[str, Any] = {
        **acc,
        "slo_rate": acc["slo_compliant"] / acc["requests"] if acc["requests"] else 0.0,
        "slo_rate_strict": acc["slo_compliant_strict"] / acc["requests"] if acc["requests"] else 0.0,
        "cpu_nodes_avg": cpu_s / duration_s,
        "gpu_nodes_avg": gpu_s / duration_s,
        "cpu_nodes_max": max(u[1] for u in usage),
        "gpu_nodes_max": max(u[2] for u in usage),
    }
    for p in PERCENTILES:
        out[f"ttft_p{p}_s"] = ttft[p]
    for p in PERCENTILES:
        out[f"ttft_p{p}_all_s"] = ttft_all[p]
    for p in PERCENTILES:
        out[f"tpot_p{p}_s"] = tpot[p]
    return out


def summarize(run: PolicyRun) -> dict[str, Any]:
    cpu_all, gpu_all = node_seconds(run.usage, 0.0, max(run.end_s, run.duration_s))
    decode = {CPU: 0, GPU: 0}
    for n in run.nodes:
        decode[n.kind] += n.decode_tokens
    out = request_figures(run.requests, run.usage, run.duration_s)
    out.update({
        "decode_tok_s_per_cpu_node": decode[CPU] / cpu_all if cpu_all else 0.0,
        "decode_tok_s_per_gpu_node": decode[GPU] / gpu_all if gpu_all else 0.0,
        "wall_s": run.wall_s,
        "virtual_s": run.end_s,
        "rejected_by_reason": dict(run.dispatch.rejected),
        "failed_by_reason": dict(run.dispatch.failed),
        # requests of nodes lost during the run (--fail-node), by cause: handed back, placed again, turned away
        "lost_by_cause": dict(run.dispatch.lost), "resumed_by_cause": dict(run.dispatch.resumed),
        "lost_failed_by_cause": dict(run.dispatch.lost_failed),
        "placed_at_arrival": run.dispatch.placed_at_arrival,
        "queued": run.dispatch.queued,
        "queue_peak": run.queue_peak,
        "instances_started": run.instances_started,
        "instances_recycled": run.instances_recycled,
        "preemptions": run.policy_stats.preemptions,
        "warm_ups": run.policy_stats.warm_ups,
        "preempted_requests": run.policy_stats.preempted_requests,
        "validations": run.policy_stats.validations,
        "iterations": sum(n.iterations for n in run.nodes),
        "usage_per_second": usage_per_second(run.usage, run.duration_s),
    })
    return out


# (key, header, format)
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", "{:d}"),
    ("slo_compliant", "SLO ok", "{:d}"),
    ("slo_rate", "SLO %", "{:.1%}"),
    ("slo_rate_strict", "strict %", "{:.1%}"),
    ("cpu_nodes_avg", "CPU nodes", "{:.2f}"),
    ("gpu_nodes_avg", "GPU nodes", "{:.2f}"),
    ("decode_tok_s_per_cpu_node", "tok/s/CPU", "{:.0f}"),
    ("decode_tok_s_per_gpu_node", "tok/s/GPU", "{:.0f}"),
    ("ttft_p50_s", "TTFT p50", "{:.2f}"),
    ("ttft_p90_s", "p90", "{:.2f}"),
    ("ttft_p99_s", "p99", "{:.2f}"),
    ("ttft_p50_all_s", "TTFT all p50", "{:.2f}"),
    ("ttft_p99_all_s", "all p99", "{:.2f}"),
    ("tpot_p50_s", "TPOT p50", "{:.3f}"),
    ("tpot_p90_s", "p90", "{:.3f}"),
    ("tpot_p99_s", "p99", "{:.3f}"),
    ("rejected", "rejected", "{:d}"),
    ("failed", "failed", "{:d}"),
    ("wall_s", "wall s", "{:.1f}"),
)


def json_ready(summary: dict[str, Any]) -> dict[str, Any]:
    """`summary` with infinite figures (TTFT percentiles among never-served requests) as None,
    JSON having no infinity."""
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in summary.items()}


def aligned(rows: list[list[str]]) -> str:
    """Rows of cells as a plain-text table: the first row a header, the first column left-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def table(results: dict[str, dict[str, Any]]) -> str:
    """The comparison table, one row per policy (times in seconds)."""
    head = ["policy"] + [h for _, h, _ in TABLE_COLUMNS]
    rows = [head]
    for name, m in results.items():
        row = [name]
        for key, _, fmt in TABLE_COLUMNS:
            v = m.get(key)
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    return aligned(rows)
