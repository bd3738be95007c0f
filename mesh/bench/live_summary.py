"""Live replays summarised over seeds and repeats (`scripts/evaluation.sh live`).

    python -m mesh.bench.live_summary docs/eval/live_rig-*.json

Each file is one `mesh replay --live ... --json` run of a fresh service; its rig, seed and
repeat come from its name (`live_rig-<rig>_<policy>_s<seed>_r<repeat>.json`), its policy from
the run itself. Per rig and policy it prints the live SLO attainment (every request counted:
rejected and failed ones in the denominator) and its twin's (the same requests simulated
under the same policy, `simulated_by_policy`) as minimum / median / maximum over the runs,
the largest live-twin gap, the largest spread between repeats of one seed, the median nodes
in use (the cost) live and in the twin, and, per rig,
in how many paired runs (same seed and repeat) Mesh served at least as many requests within
their SLO as sllm+cpu, and the first requests of models registered at least `LEAD_S` before
their traffic: how many got their first token within the TTFT SLO, and
which did not. A single run is never a figure.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

# A replay registers every model before its clock starts, so a model whose first request
# arrives at >= LEAD_S on that clock was registered at least LEAD_S before it.
LEAD_S = 60.0
NAME = re.compile(r"live_rig-(?P<rig>[a-z0-9-]+)_(?P<policy>[a-z0-9-]+)_s(?P<seed>\d+)_r(?P<repeat>\d+)\.json$")


@dataclass(frozen=True)
class RunFigures:
    """One live replay's figures, as read back from its JSON (read_run)."""

    rig: str
    policy: str
    seed: int
    repeat: int
    requests: int
    served: int  # within their SLO
    live_pct: float
    twin_pct: float
    late_firsts: tuple[str, ...] = ()  # first requests (>= LEAD_S) past their TTFT SLO: "model at t s: TTFT x s"
    firsts: int = 0  # first requests at >= LEAD_S
    live_nodes: float = 0.0  # nodes in use on average (CPU + GPU), live
    twin_nodes: float = 0.0  # and in the twin


def _first_requests(detail: list[dict]) -> tuple[int, tuple[str, ...]]:
    """(how many models' first requests arrived at >= LEAD_S, those of them not served
    within their TTFT SLO), from the run's `requests_detail`."""
    first: dict[str, dict] = {}
    for r in sorted(detail, key=lambda r: r["arrival_s"]):
        first.setdefault(r["model"], r)
    late = []
    for model, r in sorted(first.items()):
        if r["arrival_s"] < LEAD_S:
            continue
        ttft = r.get("ttft_s")
        if r["outcome"] != "completed" or ttft is None or ttft > r["ttft_slo_s"]:
            what = f"TTFT {ttft:.2f} s" if ttft is not None else r["outcome"]
            late.append(f"{model} at {r['arrival_s']:.0f} s: {what} (SLO {r['ttft_slo_s']:.1f} s)")
    return sum(1 for r in first.values() if r["arrival_s"] >= LEAD_S), tuple(late)


def read_run(path: str | Path) -> RunFigures:
    """One run's figures; ValueError if its name or content is not a live replay's."""
    path = Path(path)
    m = NAME.search(path.name)
    if m is None:
        raise ValueError(f"{path.name}: not named live_rig-<rig>_<policy>_s<seed>_r<repeat>.json")
    data = json.loads(path.read_text())
    live = data["live"]
    policy = live.get("policy") or m["policy"]
    twin = (data.get("simulated_by_policy") or {}).get(policy) or data["simulated"]
    firsts, late = _first_requests(live.get("requests_detail") or [])
    return RunFigures(m["rig"], policy, int(m["seed"]), int(m["repeat"]), int(live["requests"]),
                      int(live["slo_compliant"]), 100.0 * float(live["slo_rate"]), 100.0 * float(twin["slo_rate"]),
                      late, firsts, _nodes(live), _nodes(twin))


def _nodes(figures: dict) -> float:
    return float(figures.get("cpu_nodes_avg") or 0.0) + float(figures.get("gpu_nodes_avg") or 0.0)


def _mmm(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def summary(runs: Iterable[RunFigures]) -> str:
    """The markdown table (module docstring)."""
    runs = sorted(runs, key=lambda r: (r.rig, r.policy, r.seed, r.repeat))
    lines = ["| rig | policy | runs | live SLO % (min / median / max) | twin SLO % (min / median / max) | "
             "max abs(live - twin) | max repeat spread | nodes in use, live / twin (median) |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[RunFigures]] = {}
    for r in runs:
        groups.setdefault((r.rig, r.policy), []).append(r)
    for (rig, policy), group in groups.items():
        by_seed: dict[int, list[float]] = {}
        for r in group:
            by_seed.setdefault(r.seed, []).append(r.live_pct)
        spread = max((max(v) - min(v) for v in by_seed.values() if len(v) > 1), default=None)
        gap = max(abs(r.live_pct - r.twin_pct) for r in group)
        lines.append(f"| {rig} | {policy} | {len(group)} | {_mmm([r.live_pct for r in group])} | "
                     f"{_mmm([r.twin_pct for r in group])} | {gap:.1f} | "
                     f"{'-' if spread is None else f'{spread:.1f}'} | "
                     f"{statistics.median(r.live_nodes for r in group):.2f} / "
                     f"{statistics.median(r.twin_nodes for r in group):.2f} |")
    pairs: dict[str, list[bool]] = {}
    index = {(r.rig, r.policy, r.seed, r.repeat): r for r in runs}
    for (rig, policy, seed, repeat), r in index.items():
        other = index.get((rig, "sllm+cpu", seed, repeat))
        if policy == "mesh" and other is not None:
            pairs.setdefault(rig, []).append(r.served >= other.served)
    for rig, wins in sorted(pairs.items()):
        lines.append(f"\n{rig}: Mesh served at least as many requests within their SLO as sllm+cpu in "
                     f"{sum(wins)} of {len(wins)} paired runs")
    firsts = sum(r.firsts for r in runs)
    late = [f"{r.rig} {r.policy} seed {r.seed} repeat {r.repeat}: {x}" for r in runs for x in r.late_firsts]
    lines.append(f"\nFirst requests of models registered at least {LEAD_S:.0f} s before them: "
                 f"{firsts - len(late)} of {firsts} within their TTFT SLO")
    lines.extend(f"- late: {x}" for x in late)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m mesh.bench.live_summary live_rig-*.json", file=sys.stderr)
        return 2
    runs = []
    for p in paths:
        try:
            runs.append(read_run(p))
        except (OSError, ValueError, KeyError) as exc:
            print(f"skipped {p}: {exc}", file=sys.stderr)
    if not runs:
        print("no live replay runs to summarise", file=sys.stderr)
        return 1
    print(summary(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
