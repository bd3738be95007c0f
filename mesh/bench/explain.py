"""`mesh replay --live ... --explain`: every request whose outcome differs between the live
service and its twin, with the decision that differed and why.

A request's outcome is what the figures count: served within its SLO, served late, turned
away, or failed. Where live and twin disagree, the step that decided it is named:
- `admission`: one side turned the request away (its reason: the live service's error, or
  the twin's rule) while the other served it;
- `failure`: one side lost it after placing it;
- `first token`: both served it, and the TTFT is within its SLO on one side only: the twin
  says where its first token came from (placed at arrival or after waiting, on a warm
  instance or late behind a cold start: `late_s`), the live side what the client saw;
- `pace`: the first tokens were on time on both sides, the mean TPOT on one side only.
Requests are matched by id (both sides replay the same workload's arrivals). The twin
knows each decision (node, attempts, cold start); the live side is seen from the client,
so its reason is the service's answer and its timings.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from mesh.wire.served_request import Outcome, ServedRequest


@dataclass(frozen=True)
class Difference:
    request_id: str
    model: str
    arrival_s: float
    decision: str  # admission | failure | first token | pace
    live: str  # the outcome as the live client saw it
    twin: str  # the outcome in the twin, with its decisions
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _state(r: ServedRequest) -> str:
    if r.outcome is Outcome.COMPLETED:
        return "met" if r.slo_met else "late"
    return r.outcome.value if r.outcome is not None else "unfinished"


def _secs(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f} s"


def _told(r: ServedRequest, twin: bool) -> str:
    state = _state(r)
    if state in ("met", "late"):
        where = ""
        if twin:
            where = f" on {r.node_id or '?'}" + (f" after a {r.late_s:.1f} s cold start" if r.late_s > 0 else "")
            if len(r.attempts) > 1:
                where += f" ({len(r.attempts)} placements)"
        return (f"{'served' if state == 'met' else 'served late'}{where}: TTFT {_secs(r.ttft_s)} (SLO "
                f"{r.slo.ttft_s(r.prompt_len):.2f} s), TPOT {_secs(r.tpot_s)} (SLO {r.slo.tpot_s:.2f} s)")
    return f"{state}" + (f": {r.detail[:160]}" if r.detail else "")


def differences(live: Iterable[ServedRequest], twin: Iterable[ServedRequest]) -> list[Difference]:
    """Every request whose outcome differs, in arrival order (module docstring)."""
    twins = {r.request_id: r for r in twin}
    out = []
    for lr in sorted(live, key=lambda r: r.arrival_s):
        tr = twins.get(lr.request_id)
        if tr is None or _state(lr) == _state(tr):
            continue
        states = {_state(lr), _state(tr)}
        slo = lr.slo.ttft_s(lr.prompt_len)
        if "rejected" in states:
            decision = "admission"
            who, other = ("live", "the twin") if _state(lr) == "rejected" else ("the twin", "live")
            turned = lr if who == "live" else tr
            why = f"{who} turned it away ({turned.detail[:120] or 'no reason given'}); {other} served it"
        elif "failed" in states or "unfinished" in states:
            decision = "failure"
            lost = lr if _state(lr) in ("failed", "unfinished") else tr
            why = f"{'live' if lost is lr else 'the twin'} lost it after placing it: {lost.detail[:120] or 'no reason'}"
        elif (lr.ttft_s <= slo + 1e-9) != (tr.ttft_s <= slo + 1e-9):
            decision = "first token"
            if tr.ttft_s > slo:
                cause = (f"the twin started it behind a {tr.late_s:.1f} s cold start" if tr.late_s > 0
                         else f"the twin's first token came {tr.ttft_s - slo:.2f} s past its SLO on {tr.node_id}")
            else:
                cause = (f"live waited {lr.ttft_s:.2f} s for its first token; the twin placed it on {tr.node_id}"
                         + (f" behind a {tr.late_s:.1f} s cold start" if tr.late_s > 0 else " on a ready instance")
                         + f" and had it in {tr.ttft_s:.2f} s")
            why = cause
        else:
            decision = "pace"
            why = (f"mean TPOT live {_secs(lr.tpot_s)}, twin {_secs(tr.tpot_s)} (SLO {lr.slo.tpot_s:.2f} s): "
                   f"the node's iterations ran {'slower' if lr.tpot_s > tr.tpot_s else 'faster'} live than the twin's "
                   "profile predicts")
        out.append(Difference(lr.request_id, lr.model, round(lr.arrival_s, 3), decision, _told(lr, False),
                              _told(tr, True), why))
    return out


def report(diffs: list[Difference], total: int) -> str:
    """The list as text, with counts by decision."""
    if not diffs:
        return f"--explain: live and twin agree on every one of the {total} requests' outcomes"
    counts: dict[str, int] = {}
    for d in diffs:
        counts[d.decision] = counts.get(d.decision, 0) + 1
    lines = [f"--explain: {len(diffs)} of {total} requests differ between live and twin ("
             + ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) + "):"]
    for d in diffs:
        lines.append(f"  t={d.arrival_s:8.2f} s {d.request_id} [{d.decision}] {d.why}\n"
                     f"      live: {d.live}\n      twin: {d.twin}")
    return "\n".join(lines)
