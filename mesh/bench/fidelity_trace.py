"""Iteration logs of `mesh bench fidelity`, side by side (`--trace-out DIR`).

The live and the simulated run of the same workload each leave an iteration log
(mesh.node.runtime.IterationRecord: instance, kind, batch size, prompt tokens or mean
context, start, duration, predicted duration). This module writes both logs (JSON lines),
finds where the two sequences of iterations first differ and says why as far as the logs
and the workload tell (`divergence.md`), and draws two figures: live iteration time
against its prediction, and cumulative tokens over time in both runs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True, slots=True)
class Divergence:
    index: int  # position in the node's iteration sequence where the runs first differ (-1: none)
    live: dict[str, Any] | None
    sim: dict[str, Any] | None
    why: str


def log_rows(iterations: Sequence[Any], t0: float) -> list[dict[str, Any]]:
    """The iteration log as plain rows; times relative to the workload's start `t0`."""
    rows = []
    for k, it in enumerate(iterations):
        rows.append({"i": k, "instance": it.instance_id, "kind": it.kind.value, "batch": it.batch_size,
                     "tokens": it.tokens, "start_s": round(it.start_s - t0, 6), "duration_s": round(it.duration_s, 6),
                     "predicted_s": round(it.predicted_s, 6),
                     "predicted_kind": it.predicted_kind.value if it.predicted_kind is not None else None,
                     "predicted_batch": it.predicted_batch})
    return rows


def _key(row: dict[str, Any]) -> tuple[str, str, int]:
    return row["instance"], row["kind"], row["batch"]


def first_divergence(live: list[dict[str, Any]], sim: list[dict[str, Any]],
                     arrivals: Sequence[tuple[str, str, float]] = ()) -> Divergence:
    """Where the sequences (instance, kind, batch size) first differ, and a reason read off
    the logs: which instance the node chose, what the engine did against what the compute
    subsystem predicted, and which arrivals fell between the two runs' start times.
    `arrivals`: (request id, model, seconds after the start)."""
    for k, (a, b) in enumerate(zip(live, sim)):
        if _key(a) == _key(b):
            continue
        lo, hi = sorted((a["start_s"], b["start_s"]))
        between = [f"{rid} ({model}) at {t:.3f} s" for rid, model, t in arrivals if lo <= t < hi]
        reasons = []
        if a["predicted_kind"] and a["kind"] != a["predicted_kind"]:
            reasons.append(f"live engine ran a {a['kind']} where the node predicted a {a['predicted_kind']}")
        if a["predicted_batch"] and a["batch"] != a["predicted_batch"]:
            reasons.append(f"live engine served {a['batch']} requests where the node predicted {a['predicted_batch']}")
        if b["predicted_batch"] and b["batch"] != b["predicted_batch"]:
            reasons.append(f"simulated engine served {b['batch']} where the node predicted {b['predicted_batch']}")
        if between:
            reasons.append(f"the iteration started at {a['start_s']:.3f} s live and {b['start_s']:.3f} s simulated, "
                           f"and between the two {', '.join(between)} arrived: one run saw it at this boundary, "
                           "the other did not (the runs' clocks had drifted apart by then)")
        elif a["instance"] != b["instance"]:
            reasons.append("the node chose another instance: their deadlines ordered differently "
                           "(earlier iterations took different times)")
        if not reasons:
            reasons.append("same predictions, different outcome: a request finished or joined at a different round")
        return Divergence(k, a, b, "; ".join(reasons))
    if len(live) != len(sim):
        k = min(len(live), len(sim))
        return Divergence(k, live[k] if k < len(live) else None, sim[k] if k < len(sim) else None,
                          "one run has more iterations after a common prefix")
    return Divergence(-1, None, None, "the sequences are identical")


def per_instance_match(live: list[dict[str, Any]], sim: list[dict[str, Any]]) -> dict[str, Any]:
    """Per instance: iterations live and simulated, and how many of the first ones agree in
    (kind, batch) before the first difference."""
    out = {}
    for inst in sorted({r["instance"] for r in live} | {r["instance"] for r in sim}):
        a = [(r["kind"], r["batch"]) for r in live if r["instance"] == inst]
        b = [(r["kind"], r["batch"]) for r in sim if r["instance"] == inst]
        common = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out[inst] = {"live": len(a), "sim": len(b), "common_prefix": common,
                     "prefills_live": sum(1 for k, _ in a if k == "prefill"),
                     "prefills_sim": sum(1 for k, _ in b if k == "prefill")}
    return out


def write(out_dir: str | Path, live_iterations: Sequence[Any], live_t0: float, sim_iterations: Sequence[Any],
          sim_t0: float, arrivals: Sequence[tuple[str, str, float]]) -> dict[str, Any]:
    """Write live.jsonl, sim.jsonl, divergence.md and the figures into `out_dir`; return a summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    live, sim = log_rows(live_iterations, live_t0), log_rows(sim_iterations, sim_t0)
    for name, rows in (("live", live), ("sim", sim)):
        with open(out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    d = first_divergence(live, sim, arrivals)
    match = per_instance_match(live, sim)
    lines = ["# Live and simulated iteration logs", "",
             f"Iterations: live {len(live)}, simulated {len(sim)}.", ""]
    if d.index < 0:
        lines.append("The two runs ran the same sequence of iterations (instance, kind, batch size).")
    else:
        lines += [f"First difference at iteration {d.index}:", "",
                  f"- live: `{json.dumps(d.live)}`", f"- simulated: `{json.dumps(d.sim)}`", "",
                  f"Why: {d.why}."]
    lines += ["", "| instance | live | simulated | common prefix | prefills live | prefills simulated |",
              "|---|---|---|---|---|---|"]
    for inst, m in match.items():
        lines.append(f"| {inst} | {m['live']} | {m['sim']} | {m['common_prefix']} | {m['prefills_live']} | "
                     f"{m['prefills_sim']} |")
    (out / "divergence.md").write_text("\n".join(lines) + "\n")
    figures = _plots(out, live, sim)
    return {"dir": str(out), "first_divergence": d.index, "why": d.why, "per_instance": match, "figures": figures}


def _plots(out: Path, live: list[dict[str, Any]], sim: list[dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(5, 5))
    for kind, color in (("prefill", "tab:orange"), ("decode", "tab:blue")):
        xs = [1000 * r["predicted_s"] for r in live if r["kind"] == kind]
        ys = [1000 * r["duration_s"] for r in live if r["kind"] == kind]
        ax.scatter(xs, ys, s=8, alpha=0.6, color=color, label=f"{kind} ({len(xs)})")
    top = max([1000 * r["duration_s"] for r in live] + [1000 * r["predicted_s"] for r in live] + [1.0])
    ax.plot([0, top], [0, top], "k-", lw=0.8, label="live = predicted")
    ax.plot([0, top], [0, 1.1 * top], "k--", lw=0.8, label="+10% margin")
    ax.set_xlabel("predicted iteration time (ms)")
    ax.set_ylabel("live iteration time (ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "predicted_vs_live.png", dpi=120)
    plt.close(fig)
    written.append("predicted_vs_live.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows, style in (("live", live, "-"), ("simulated", sim, "--")):
        t, total, xs, ys = 0.0, 0, [], []
        for r in rows:
            t = r["start_s"] + r["duration_s"]
            total += r["batch"]
            xs.append(t)
            ys.append(total)
        ax.step(xs, ys, style, where="post", label=name)
    ax.set_xlabel("seconds after the workload starts")
    ax.set_ylabel("tokens produced (cumulative)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cumulative_tokens.png", dpi=120)
    plt.close(fig)
    written.append("cumulative_tokens.png")
    return written
