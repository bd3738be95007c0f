"""`mesh replay --live --explain` (issue 31 item 5): every request whose outcome differs
between live and twin, with the decision that differed and why."""
from __future__ import annotations

from mesh.bench.explain import differences, report
from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.policy.slo import SLO
from mesh.wire.served_request import Outcome, ServedRequest


def _req(rid: str, arrival: float, outcome: Outcome, first: float | None = None, finish: float | None = None,
         tokens: int = 10, node: str | None = None, late: float = 0.0, detail: str = "") -> ServedRequest:
    r = ServedRequest(EngineRequest(rid, 100, Sampling(max_tokens=tokens)), "m", arrival, SLO())
    r.outcome, r.first_token_s, r.finish_s, r.tokens_out, r.node_id, r.late_s, r.detail = (
        outcome, first, finish, tokens, node, late, detail)
    return r


def test_each_differing_request_is_named_with_the_decision_that_differed():
    C, R, F = Outcome.COMPLETED, Outcome.REJECTED, Outcome.FAILED
    live = [_req("same", 0.0, C, 0.5, 2.0),  # met on both sides: not listed
            _req("turned", 1.0, R, detail="429: cannot meet its SLO"),
            _req("cold", 2.0, C, 10.0, 11.0),  # TTFT 8 s > 2 s live
            _req("lost", 3.0, F, detail="node agent cpu-1 went down"),
            _req("slow", 4.0, C, 4.5, 4.5 + 9 * 0.4)]  # TPOT 0.4 s > 0.25 s live
    twin = [_req("same", 0.0, C, 0.4, 1.9, node="cpu-0"),
            _req("turned", 1.0, C, 1.3, 2.0, node="cpu-0"),
            _req("cold", 2.0, C, 2.6, 3.5, node="cpu-1"),
            _req("lost", 3.0, C, 3.2, 4.0, node="cpu-0"),
            _req("slow", 4.0, C, 4.5, 4.5 + 9 * 0.1, node="cpu-0")]
    diffs = differences(live, twin)
    assert [(d.request_id, d.decision) for d in diffs] == [
        ("turned", "admission"), ("cold", "first token"), ("lost", "failure"), ("slow", "pace")]
    assert "live turned it away (429: cannot meet its SLO)" in diffs[0].why
    assert "live waited 8.00 s" in diffs[1].why and "on cpu-1 on a ready instance" in diffs[1].why
    assert "cpu-1 went down" in diffs[2].why and "slower" in diffs[3].why
    assert diffs[1].twin.startswith("served on cpu-1: TTFT 0.60 s")
    text = report(diffs, len(live))
    assert text.startswith("--explain: 4 of 5 requests differ") and "[pace]" in text
    # the other way round: the twin late behind a cold start, live on time
    back = differences([_req("x", 0.0, C, 0.5, 1.0)], [_req("x", 0.0, C, 9.0, 9.5, node="cpu-0", late=8.0)])
    assert back[0].decision == "first token" and "behind a 8.0 s cold start" in back[0].why
    assert report([], 3) == "--explain: live and twin agree on every one of the 3 requests' outcomes"
