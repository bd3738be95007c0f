"""Benchmark figures count every request: `mesh bench serve`'s summary and exit status, and
percentiles over all requests (a request never served counts as infinite)."""
from __future__ import annotations

import pytest

from mesh.bench.serve import Result, summarize, verdict
from mesh.replay.metrics import percentiles_all


def test_percentiles_over_all_requests_reach_the_unserved_ones():
    served = [0.1, 0.2, 0.3, 0.4]
    assert percentiles_all(served, 0, (50,))[50] == pytest.approx(0.25)
    over = percentiles_all(served, 4, (25, 50, 99))  # half never served
    assert over[25] == pytest.approx(0.275) and over[50] is None and over[99] is None
    assert percentiles_all([], 3, (50,)) == {50: None} and percentiles_all([], 0, (50,)) == {50: None}


def test_bench_serve_counts_429s_and_fails_below_min_completed():
    results = [Result("ok", ttft_s=0.1 * k, total_s=1.0, tokens=8) for k in range(1, 8)]
    results += [Result("rejected", detail="slo") for _ in range(3)]
    figures = summarize(results, wall=2.0, sent=10)
    assert (figures["completed"], figures["rejected_429"], figures["errors"], figures["lost"]) == (7, 3, 0, 0)
    assert figures["ttft_p99_s"] == pytest.approx(0.7) and figures["ttft_p99_all_s"] is None
    assert figures["ttft_p50_all_s"] == pytest.approx(0.55)  # the served requests are the faster 7 of 10
    code, why = verdict(figures, 0.9)
    assert code == 1 and "7 of 10" in why and "3 got a 429" in why
    assert verdict(figures, 0.7) == (0, None)


def test_bench_serve_counts_a_request_that_never_answered_as_lost():
    figures = summarize([Result("ok", ttft_s=0.1, total_s=0.2, tokens=4)], wall=1.0, sent=2)
    assert figures["lost"] == 1 and figures["completed_share"] == 0.5
    assert verdict(figures, 0.5)[0] == 1  # a lost stream fails the run whatever the share


def test_replay_figures_give_ttft_over_all_requests_and_both_slo_readings():
    from engines.protocol import EngineRequest, Sampling
    from mesh.policy.slo import SLO
    from mesh.replay.metrics import request_figures
    from mesh.runtime.request import Outcome, ServedRequest

    def req(rid: str) -> ServedRequest:
        return ServedRequest(EngineRequest(rid, 100, Sampling(max_tokens=11), output_len=11), "m", 0.0, SLO())

    fast, slow_pace, turned_away = req("a"), req("b"), req("c")
    fast.first_token_s, fast.tokens_out = 0.5, 11
    fast.end(Outcome.COMPLETED, 0.5 + 10 * 0.1)
    # first token early, then slower than the TPOT SLO: within Eq. 1's last deadline, not the strict mean
    slow_pace.first_token_s, slow_pace.tokens_out = 0.1, 11
    slow_pace.end(Outcome.COMPLETED, 2.0 + 10 * SLO().tpot_s - 0.01)
    turned_away.end(Outcome.REJECTED, 0.2, "rejected: queue full")
    f = request_figures([fast, slow_pace, turned_away], [(0.0, 1, 0)], 10.0)
    assert (f["requests"], f["slo_compliant"], f["slo_compliant_strict"], f["rejected"]) == (3, 2, 1, 1)
    assert f["slo_rate"] == pytest.approx(2 / 3) and f["slo_rate_strict"] == pytest.approx(1 / 3)
    assert f["ttft_p50_all_s"] == pytest.approx(0.5) and f["ttft_p99_all_s"] is None
    assert f["ttft_p99_s"] == pytest.approx(0.5, abs=0.01)  # over served requests only
