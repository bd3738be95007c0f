"""`mesh bench control-plane`'s pieces: the latency histograms and the loop-lag probe
(mesh.control.latency), the ramp's stop rule and the step figures, and the load generator's
token counting against a small SSE server."""
from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
from aiohttp import web

from mesh.bench import control_plane as cp
from mesh.control.latency import (
    BUCKETS_PER_OCTAVE,
    FIRST_EDGE_S,
    NUM_BUCKETS,
    LogHistogram,
    LoopLagProbe,
    between,
    bucket_of,
    edge,
    export_buckets,
    quantile,
)

# ---- histograms -----------------------------------------------------------------------------------

def test_buckets_cover_their_values():
    assert bucket_of(0.0) == 0 and bucket_of(-1.0) == 0 and bucket_of(FIRST_EDGE_S) == 0
    assert bucket_of(math.inf) == NUM_BUCKETS - 1 and bucket_of(float("nan")) == NUM_BUCKETS - 1
    assert bucket_of(1e6) == NUM_BUCKETS - 1
    for value in (1.5e-6, 3.3e-5, 1e-3, 0.0123, 0.05, 0.999, 7.0):
        k = bucket_of(value)
        assert edge(k - 1) < value <= edge(k) * (1 + 1e-12), value
        assert edge(k) / edge(k - 1) == pytest.approx(2 ** (1 / BUCKETS_PER_OCTAVE))
    assert bucket_of(edge(40)) == 40  # an edge belongs to the bucket it closes


def test_quantiles_within_one_bucket():
    h = LogHistogram()
    values = [i / 1000 for i in range(1, 1001)]  # 1 ms .. 1 s
    for v in values:
        h.add(v)
    assert h.count == 1000 and h.total == pytest.approx(sum(values)) and h.max == 1.0
    width = 2 ** (1 / BUCKETS_PER_OCTAVE)
    for q, exact in ((0.5, 0.5), (0.99, 0.99), (0.01, 0.01)):
        got = h.quantile(q)
        assert exact <= got <= exact * width, (q, got)
    assert h.quantile(1.0) == 1.0  # capped at the largest value seen
    assert LogHistogram().quantile(0.5) is None
    assert quantile({}, 0.5) is None


def test_p99_sees_a_rare_stall():
    h = LogHistogram()
    for _ in range(980):
        h.add(0.0005)
    for _ in range(20):  # 2% of wake-ups 80 ms late
        h.add(0.080)
    assert h.quantile(0.5) < 0.001
    assert 0.080 <= h.quantile(0.99) <= 0.080 * 1.1


def test_between_two_snapshots_is_what_happened_in_between():
    h = LogHistogram()
    for _ in range(100):
        h.add(0.1)  # before the step: slow
    a = json.loads(json.dumps(h.snapshot()))  # as read over HTTP: bucket keys are strings
    for _ in range(50):
        h.add(0.001)
    b = json.loads(json.dumps(h.snapshot()))
    d = between(a, b)
    assert d["count"] == 50 and d["mean_s"] == pytest.approx(0.001)
    assert 0.001 <= d["p99_s"] <= 0.0011 and d["max_s"] is None  # the whole run's max is not the step's
    empty = between(b, b)
    assert empty["count"] == 0 and empty["p50_s"] is None and empty["mean_s"] is None
    assert between(None, a)["max_s"] == 0.1


def test_export_buckets_are_cumulative_and_exact():
    h = LogHistogram()
    for v in (5e-6, 1e-3, 1e-3, 0.02, 3.0, 500.0):
        h.add(v)
    buckets = export_buckets(h.snapshot())
    counts = [n for _le, n in buckets]
    assert counts == sorted(counts) and buckets[-1] == ("+Inf", 6.0)
    by_bound = {float(le): n for le, n in buckets[:-1]}
    assert by_bound[min(b for b in by_bound if b >= 1e-3)] == 3  # 5 us and both 1 ms
    assert h.cumulative([edge(80)])[0][1] == 3 and h.cumulative([1e-3])[0][1] == 1  # whole buckets only


# ---- the loop-lag probe ----------------------------------------------------------------------------

def test_probe_records_how_late_it_woke():
    probe = LoopLagProbe(interval_s=0.02)
    assert probe.record(10.0, 10.02) == 0.0
    assert probe.record(10.0, 10.019) == 0.0  # early (timer resolution): no negative lag
    assert probe.record(10.0, 10.07) == pytest.approx(0.05)
    assert probe.lag.count == 3 and probe.lag.max == pytest.approx(0.05)
    assert probe.own_lag.count == 0  # without the thread's CPU time, no bound of the own part
    probe.record(10.0, 10.07, cpu_s=0.001)  # 50 ms late with 1 ms of CPU: the machine's, not the loop's
    probe.record(10.0, 10.07, cpu_s=0.065)  # busy the whole time: all of it may be the loop's own
    assert probe.own_lag.max == pytest.approx(0.05) and probe.own_lag.quantile(0.5) <= 0.0011
    with pytest.raises(ValueError):
        LoopLagProbe(0)


def _blocked(busy: bool) -> LoopLagProbe:
    async def main() -> LoopLagProbe:
        probe = LoopLagProbe(interval_s=0.005)
        probe.start()
        await asyncio.sleep(0.05)
        if busy:  # the loop's own work holds it for 60 ms of CPU
            start = time.thread_time()
            while time.thread_time() - start < 0.06:
                pass
        else:  # the thread holds the loop without using a core (as a process waiting for one)
            time.sleep(0.06)
        await asyncio.sleep(0.03)
        await probe.stop()
        return probe

    return asyncio.run(main())


def test_probe_sees_a_blocked_loop_and_whose_fault_it_was():
    busy, idle = _blocked(True), _blocked(False)
    for probe in (busy, idle):
        assert probe.lag.count >= 3
        assert probe.lag.max >= 0.04  # the wake-up due during the block came about 55 ms late
    assert busy.own_lag.max >= 0.04
    assert idle.own_lag.max < 0.02
    assert set(busy.view()) >= {"interval_s", "p99_s", "own"}


# ---- the ramp ----------------------------------------------------------------------------------------

def test_parse_streams():
    assert cp.parse_streams("32,64, 128") == [32, 64, 128]
    for bad in ("", "64,32", "0,4", "a,b", "8,8"):
        with pytest.raises(ValueError):
            cp.parse_streams(bad)


def test_the_ramp_stops_past_the_lag_limit_and_keeps_the_best_step_under_it():
    limit = 0.05
    steps = [{"streams": 32, "tokens_per_s": 4000.0, "loop_lag_p99_s": 0.004},
             {"streams": 64, "tokens_per_s": 9000.0, "loop_lag_p99_s": 0.049},
             {"streams": 128, "tokens_per_s": 12000.0, "loop_lag_p99_s": 0.051}]
    assert [cp.over_limit(s, limit) for s in steps] == [False, False, True]
    assert cp.over_limit({"loop_lag_p99_s": None}, limit)  # nothing measured: stop
    assert cp.best_under(steps, limit)["streams"] == 64
    assert cp.best_under(steps[2:], limit) is None


def _mark(tokens: int, client_cpu: float, service_cpu: float, frames: int, lag: LogHistogram,
          decisions: LogHistogram) -> dict:
    return {"client": {"tokens": tokens, "completed": tokens // 10, "rejected": 1, "errors": 0, "lost": 0,
                       "cpu_s": client_cpu},
            "service_cpu_s": service_cpu, "agents_cpu_s": service_cpu / 2, "service_rss_bytes": 200 * 2**20,
            "frames_in": frames, "loop_lag": json.loads(json.dumps(lag.snapshot())),
            "decisions": json.loads(json.dumps(decisions.snapshot())), "load_avg": (1.5, 1.0, 0.5)}


def test_step_figures():
    lag, decisions = LogHistogram(), LogHistogram()
    a = _mark(1000, 1.0, 10.0, 100, lag, decisions)
    for _ in range(99):
        lag.add(0.002)
    lag.add(0.2)
    decisions.add(0.01)
    b = _mark(21000, 3.0, 14.0, 2100, lag, decisions)
    s = cp.step_figures(64, 10.0, a, b)
    assert s["tokens"] == 20000 and s["tokens_per_s"] == 2000.0
    assert s["service_cpu_per_1k_tokens_s"] == pytest.approx(0.2) and s["service_cpu_cores"] == pytest.approx(0.4)
    assert s["client_cpu_cores"] == pytest.approx(0.2) and s["agents_cpu_cores"] == pytest.approx(0.2)
    assert s["frames_per_s"] == 200.0 and s["tokens_per_frame"] == 10.0
    assert 0.002 <= s["loop_lag_p50_s"] < 0.0022 and s["loop_lag_p99_s"] < 0.0022  # 1 in 100: not past p99
    assert s["loop_lag_samples"] == 100 and s["decisions"] == 1 and s["rejected_429"] == 0
    assert s["service_rss_mb"] == 200 and s["load_avg_1m"] == 1.5
    assert cp.per_thousand(1.0, 0) is None


# ---- the load generator's counting ------------------------------------------------------------------

def test_the_load_counts_streamed_tokens_and_429s():
    served = {"n": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        served["n"] += 1
        if served["n"] % 4 == 0:
            return web.json_response({"error": {"message": "busy"}}, status=429, headers={"Retry-After": "0.01"})
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        # two tokens in one event once (a coalesced write), the rest one per event
        events = [" a b"] + [" c"] * (n - 2)
        for text in events:
            await resp.write(b"data: " + json.dumps({"choices": [{"text": text}], "usage": None}).encode() + b"\n\n")
        await resp.write(b'data: {"choices": [{"text": "", "finish_reason": "length"}], "usage": null}\n\n')
        await resp.write(b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": %d}}\n\n' % n)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> dict:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        load = cp.Load(f"http://127.0.0.1:{port}", "k", ["m0", "m1"], max_tokens=7, prompt_tokens=4, timeout_s=10)
        await load.open()
        try:
            load.set_streams(3)
            while load.counts["completed"] < 12:
                await asyncio.sleep(0.01)
            load.target = 0
            await asyncio.sleep(0.05)
            return load.mark()
        finally:
            await load.close()
            await runner.cleanup()

    mark = asyncio.run(main())
    assert mark["errors"] == 0 and mark["lost"] == 0 and mark["rejected"] >= 3
    assert mark["tokens"] == 7 * mark["completed"]  # each response's usage settles its count
    assert "busy" in mark["first_rejection"] and mark["cpu_s"] > 0


def test_metrics_export_the_loop_lag_and_decision_histograms():
    from mesh.service.prometheus import ServiceMetrics

    lag, decisions = LogHistogram(), LogHistogram()
    for v in (0.001, 0.002, 0.03):
        lag.add(v)
    decisions.add(0.005)
    dispatcher = {"waiting_by_tenant": {}, "placed_by_kind": {}, "preemptions": 0, "moved_requests": 0,
                  "evictions_rescheduled": 0, "new_instances": 0, "warm_ups": 0, "instances_recycled": 0,
                  "rejected": {}, "failed": {}, "decision_times": decisions.snapshot()}
    metrics = ServiceMetrics(lambda: {"nodes": [], "dispatcher": dispatcher})
    assert "mesh_event_loop_lag_seconds" not in metrics.render().decode()  # no probe yet
    metrics.loop_lag = lag
    text = metrics.render().decode()
    assert 'mesh_event_loop_lag_seconds_bucket{le="0.004096"} 2.0' in text
    assert "mesh_event_loop_lag_seconds_count 3.0" in text
    assert 'mesh_dispatcher_decision_seconds_bucket{le="+Inf"} 1.0' in text
