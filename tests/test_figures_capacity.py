"""Figures that count every request (issue 13 item 6) and the capacity search (item 7), on
tiny constructed cases."""
import json
import math

import pytest

from mesh.bench.serve_load import Result, exit_status
from mesh.bench.serve_load import summarize as serve_summarize
from mesh.cli import main
from mesh.replay.capacity import MAX_FACTOR, RunCache, search_capacity
from mesh.replay.metrics import json_ready, table, ttft_all_percentiles
from test_replay import traces  # noqa: F401 - the tiny trace fixture, used by name


def test_replay_all_request_ttft_counts_the_unserved_as_infinite():
    # 3 served (1, 2, 3 s) + 1 rejected: p50 over all is the 2nd of 4 = 2 s; p90 and p99
    # fall on the rejected one.
    p = ttft_all_percentiles([3.0, 1.0, 2.0], 1)
    assert p[50] == 2.0 and math.isinf(p[90]) and math.isinf(p[99])
    # nobody unserved: the served values
    assert ttft_all_percentiles([1.0, 2.0], 0) == {50: 1.0, 90: 2.0, 99: 2.0}
    # half rejected: the median is still a served value, p90 is not
    p = ttft_all_percentiles([0.5, 0.7], 2)
    assert p[50] == 0.7 and math.isinf(p[90])
    assert json_ready({"ttft_p99_all_s": math.inf, "x": 1.0}) == {"ttft_p99_all_s": None, "x": 1.0}
    assert "inf" in table({"p": {"requests": 1, "ttft_p99_all_s": math.inf}})


def test_bench_serve_counts_a_429_as_never_served():
    results = [Result("ok", ttft_s=0.2), Result("ok", ttft_s=0.4), Result("rejected", detail="queued"),
               Result("error", detail="HTTP 500")]
    f = serve_summarize(results, 1.0, 4)
    assert (f["completed"], f["rejected_429"], f["errors"], f["lost"]) == (2, 1, 1, 0)
    assert f["completed_fraction"] == 0.5
    assert f["ttft_p50_served_s"] == 0.2 and f["ttft_p99_served_s"] == 0.4
    assert f["ttft_p50_all_s"] == 0.4  # 2nd of 4
    assert math.isinf(f["ttft_p99_all_s"])
    # a request sent but never answered is unserved too
    f = serve_summarize([Result("ok", ttft_s=0.1)], 1.0, 2)
    assert f["lost"] == 1 and math.isinf(f["ttft_p99_all_s"]) and f["ttft_p50_all_s"] == 0.1


def test_bench_serve_exit_status_follows_min_completed():
    ok = [Result("ok", ttft_s=0.1)] * 9
    f = serve_summarize(ok + [Result("rejected")], 1.0, 10)  # 90% completed, no errors
    assert exit_status(f, 0.9) == 0
    assert exit_status(f, 0.95) == 1
    f = serve_summarize(ok[:2] + [Result("rejected")] * 8, 1.0, 10)  # "0 errors" but 20% served
    assert f["errors"] == 0 and exit_status(f, 0.9) == 1 and exit_status(f, 0.1) == 0
    f = serve_summarize(ok + [Result("error")], 1.0, 10)
    assert exit_status(f, 0.0) == 1  # an error always fails


def _step(threshold: float, calls: list[float]):
    def evaluate(f: float) -> dict[str, float]:
        calls.append(f)
        # attainment falls with load: eq1 passes up to `threshold`, strict up to threshold / 2
        return {"eq1": 1.0 if f <= threshold else 0.5, "strict": 0.95 if f <= threshold / 2 else 0.6}
    return evaluate


@pytest.mark.parametrize("growth", [2.0, 1.5])
@pytest.mark.parametrize("threshold", [0.07, 0.3, 1.0, 3.3, 17.0])
def test_capacity_search_finds_a_known_threshold(threshold, growth):
    calls: list[float] = []
    cache = RunCache(_step(threshold, calls))
    res = search_capacity(cache, "eq1", target=0.9, rel_tol=0.05, growth=growth)
    assert res.bounded
    assert res.factor in cache.results and res.upper in cache.results  # reported factors are runs
    assert res.factor <= threshold < res.upper
    assert res.upper - res.factor <= 0.05 * res.factor
    assert len(calls) == len(set(calls)) == res.runs  # no factor run twice
    assert res.runs <= 16
    # the second reading reuses the first one's runs
    before = len(calls)
    strict = search_capacity(cache, "strict", target=0.9, rel_tol=0.05, growth=growth)
    assert strict.factor in cache.results and strict.upper in cache.results
    assert strict.factor <= threshold / 2 < strict.upper
    assert strict.upper - strict.factor <= 0.05 * strict.factor
    assert len(calls) - before == strict.runs <= res.runs


def test_capacity_search_limits():
    res = search_capacity(RunCache(lambda f: {"eq1": 1.0}), "eq1")
    assert not res.bounded and res.factor == MAX_FACTOR and res.upper is None
    res = search_capacity(RunCache(lambda f: {"eq1": 0.0}), "eq1")
    assert not res.bounded and res.factor == 0.0
    with pytest.raises(ValueError):
        search_capacity(RunCache(lambda f: {"eq1": 1.0}), "eq1", target=1.5)


def test_replay_json_carries_the_new_keys(traces, tmp_path, capsys):  # noqa: F811 - the fixture imported above
    trace, lengths = traces
    out = tmp_path / "r.json"
    assert main(["replay", "--trace", str(trace), "--lengths", str(lengths), "--no-progress", "--functions", "4",
                 "--minutes", "2", "--rate-scale", "3", "--policies", "mesh,sllm", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(Eq. 1)" in printed and "(strict)" in printed and "all p99" in printed
    data = json.loads(out.read_text())
    for m in data.values():
        for key in ("ttft_p50_all_s", "ttft_p99_all_s", "slo_rate", "slo_rate_strict", "rejected"):
            assert key in m
        assert m["slo_rate_strict"] <= m["slo_rate"]
        if m["ttft_p99_all_s"] is not None and m["ttft_p99_s"] is not None:
            assert m["ttft_p99_all_s"] >= m["ttft_p99_s"]


def test_replay_capacity_on_a_tiny_trace(traces, tmp_path, capsys):  # noqa: F811 - likewise
    trace, lengths = traces
    out = tmp_path / "c.json"
    assert main(["replay", "--trace", str(trace), "--lengths", str(lengths), "--no-progress", "--functions", "4",
                 "--minutes", "2", "--policies", "sllm", "--capacity", "--capacity-tol", "0.25",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "capacity rps (Eq. 1)" in printed
    r = json.loads(out.read_text())["sllm"]
    runs = {x["factor"]: x for x in r["capacity_runs"]}
    assert r["capacity_factor"] in runs or r["capacity_factor"] == 0.0
    if r["capacity_bounded"]:
        # the capacity's own run met the target; the bracket's upper end, also run, did not
        best = runs[r["capacity_factor"]]
        assert best["slo_rate"] >= 0.9 and r["capacity_rps"] == best["mean_rps"]
        above = [x for f, x in runs.items() if f > r["capacity_factor"]]
        assert above and min(above, key=lambda x: x["factor"])["slo_rate"] < 0.9
    assert r["capacity_rps_strict"] <= r["capacity_rps"] + 1e-9 or not r["capacity_bounded_strict"]
    assert main(["replay", "--trace", str(trace), "--lengths", str(lengths), "--no-progress", "--capacity",
                 "--capacity-target", "2"]) == 2
