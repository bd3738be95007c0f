"""`GET /admin/learnt`: what the service and its agents learnt about their machines,
for the simulated twin (`mesh replay --live`) to run with instead of a stale prior.

Per node (from the agents' stats, mesh.node.node_learning.NodeLearning.view): the speed probe and
its factors, per model the learnt time factors of its newest instance (AdaptiveTimes.drift:
instance-wide and per grid region, the margin, iterations observed; kept after the instance
is recycled). Per model: the profiles the dispatcher plans with. `cold_starts`: the loads
the service measured per node, model and source (mesh.perf.load_times.ColdStartTable). `summary`, per kind of node: the
factors and margin over every model and node, weighted by iterations observed, the median measured cold start (builds:
every load but those that adopted a parked worker) and the median load from the parked tier: what a twin of
one model replicated many times (the live replay's) needs.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from mesh.perf.load_times import PARKED
from mesh.perf.profile import profile_to_dict
from mesh.perf.times import weighted_geomean


def _weighted_geomean(pairs: list[tuple[int, float]]) -> float | None:
    mean = weighted_geomean(pairs)
    return None if mean is None else round(mean, 4)


def _regions(entries: list[dict[str, Any]], key: str) -> dict[str, float]:
    """A region's factor over the models that learnt it, weighted by their observations."""
    by_region: dict[str, list[tuple[int, float]]] = {}
    for d in entries:
        for region, factor in (d.get(key) or {}).items():
            by_region.setdefault(region, []).append((max(1, int(d.get("observed", 0))), float(factor)))
    return {r: g for r, pairs in sorted(by_region.items()) if (g := _weighted_geomean(pairs)) is not None}


def summarize_kind(node_views: list[dict[str, Any]], loads: Sequence[float],
                   parked: Sequence[float] = ()) -> dict[str, Any]:
    """Factors, regions and margin over the learnt views of one kind's nodes; the median of
    `loads`, the cold starts the service measured on them that built their instance, and of
    `parked`, those that adopted a parked worker."""
    drifts = [m["time_factors"] for v in node_views for m in (v.get("models") or {}).values()
              if m.get("time_factors") and m["time_factors"].get("observed", 0) > 0]
    weights = [int(d["observed"]) for d in drifts]
    margins = [(int(d["observed"]), float(d["margin"])) for d in drifts if d.get("margin") is not None]
    return {"observed": sum(weights),
            "prefill": _weighted_geomean([(n, float(d["prefill"])) for n, d in zip(weights, drifts)]),
            "decode": _weighted_geomean([(n, float(d["decode"])) for n, d in zip(weights, drifts)]),
            "prefill_regions": _regions(drifts, "prefill_regions"), "decode_regions": _regions(drifts,
                                                                                               "decode_regions"),
            "margin": (round(sum(n * m for n, m in margins) / sum(n for n, _ in margins), 4) if margins else None),
            "cold_start_s": round(statistics.median(loads), 4) if loads else None, "cold_starts": len(loads),
            "parked_load_s": round(statistics.median(parked), 4) if parked else None, "parked_loads": len(parked)}


def learnt_view(control: Any) -> dict[str, Any]:
    """The export (see the module docstring); `control`: the service's ClusterControl."""
    nodes, by_kind = [], {}
    for node in control.cluster.nodes:
        learnt = (node.stats or {}).get("learnt") or {}
        nodes.append({"node_id": node.node_id, "kind": node.kind, **learnt})
        by_kind.setdefault(node.kind, []).append(learnt)
    models = {uid: {"profiles": {kind: profile_to_dict(p) for kind, p in spec.profiles.items()}}
              for uid, spec in control.cluster.catalog.items()}
    table = control.cluster.cold_starts
    loads = {kind: [r.load_s for r in table.records if r.kind == kind and r.source != PARKED] for kind in by_kind}
    parked = {kind: [r.load_s for r in table.records if r.kind == kind and r.source == PARKED] for kind in by_kind}
    return {"nodes": nodes, "models": models, "cold_starts": table.to_dict(),
            "summary": {k: summarize_kind(v, loads[k], parked[k]) for k, v in sorted(by_kind.items())}}
