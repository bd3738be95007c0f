"""`mesh bench closed-loop`'s counting (issue 23): a tiny aiohttp server in the test's own loop
answers some requests with 429 or 503 (turned away), some with 500 or an error event inside
the stream (failed), and streams the others (served); the bench's figures must count each
kind, keep at most N requests in flight, and compute the TTFT percentiles over served
requests by nearest rank."""
from __future__ import annotations

import asyncio
import json
import math

import pytest

pytest.importorskip("openai")
from aiohttp import web  # noqa: E402 - after the skip when openai is missing

from mesh.bench.closed_loop import (  # noqa: E402 - likewise
    FAILED,
    SERVED,
    TURNED_AWAY,
    RequestResult,
    checks,
    closed_loop,
    percentile,
    summarize,
    table,
    targets_for,
)

MODELS = ["bench/copy-0", "bench/copy-1", "bench/copy-2"]


def _chunk(model: str, content: str | None = None, finish: str | None = None, usage: int | None = None) -> bytes:
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [] if usage is not None else
            [{"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = {"prompt_tokens": 5, "completion_tokens": usage, "total_tokens": 5 + usage}
    return f"data: {json.dumps(body)}\n\n".encode()


class Server:
    """Answers request number n (in arrival order) by `plan[n % len(plan)]`."""

    def __init__(self, plan: list[str], tokens: int = 4, delay_s: float = 0.01):
        self.plan, self.tokens, self.delay_s = plan, tokens, delay_s
        self.n = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        kind = self.plan[self.n % len(self.plan)]
        self.n += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            if kind in ("429", "503", "500"):
                return web.json_response({"error": {"message": f"status {kind}", "type": "x", "code": kind}},
                                         status=int(kind), headers={"Retry-After": "1"})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            model = body["model"]
            if kind == "error_event":
                await resp.write(_chunk(model, "a"))
                await resp.write(b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n')
                await resp.write(b"data: [DONE]\n\n")
                return resp
            for i in range(self.tokens):
                await resp.write(_chunk(model, f"t{i} "))
                await asyncio.sleep(0.001)
            if kind == "truncated":  # no finish reason, no [DONE]
                return resp
            await resp.write(_chunk(model, finish="length"))
            await resp.write(_chunk(model, usage=self.tokens))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


async def _serve(server: Server) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_counts_every_request_once_by_kind():
    # 10-request cycle: 5 served, 2 turned away (429, 503), 3 failed (500, error event, truncated)
    plan = ["ok", "429", "ok", "503", "ok", "500", "ok", "error_event", "ok", "truncated"]
    server = Server(plan, tokens=4)

    async def go():
        runner, url = await _serve(server)
        try:
            return await closed_loop(targets_for([url], MODELS), clients=4, requests=30, max_tokens=4)
        finally:
            await runner.cleanup()

    outcomes, wall = asyncio.run(go())
    assert server.n == 30  # no client retries: one HTTP request per request
    assert server.max_in_flight <= 4
    assert [o.index for o in outcomes] == list(range(30))
    assert [o.model for o in outcomes[:4]] == MODELS + MODELS[:1]  # round-robin over the models
    assert all(b["temperature"] == 0 and b["stream"] and b["ignore_eos"] and b["max_tokens"] == 4
               for b in server.bodies)
    f = summarize(outcomes, wall)
    assert (f["requests"], f["served"], f["turned_away"], f["failed"]) == (30, 15, 6, 9)
    assert f["turned_away_fraction"] == pytest.approx(0.2)
    assert f["by_status"] == {"failed_http_500": 3, "failed_http_200": 6, "turned_away_http_429": 3,
                              "turned_away_http_503": 3}
    assert sum(sum(v.values()) for v in f["by_model"].values()) == 30
    assert f["tokens"] == 15 * 4  # served requests only, from the usage chunk
    assert f["tokens_per_s"] == pytest.approx(60 / wall)
    served = [o for o in outcomes if o.status == SERVED]
    assert all(o.ttft_s is not None and 0 < o.ttft_s <= o.latency_s for o in served)
    assert f["ttft_p99_s"] == max(o.ttft_s for o in served)  # 15 values: the 99th percentile is the largest
    assert f["ttft_p99_all_s"] == math.inf  # half the requests were never served
    assert {o.status for o in outcomes if o.http_status == 200 and o.status != SERVED} == {FAILED}
    assert "engine died" in " ".join(o.detail for o in outcomes)
    assert sum(f["reasons"].values()) == 15 and any("engine died" in r for r in f["reasons"])
    detail = f["requests_detail"]  # the round's timeline: every request, in the order sent
    assert sorted(d["index"] for d in detail) == list(range(30))
    assert [d["sent_s"] for d in detail] == sorted(d["sent_s"] for d in detail) and 0 <= detail[0]["sent_s"] < wall
    assert sum(d["status"] == SERVED for d in detail) == 15 and all(("reason" in d) == (d["status"] != SERVED)
                                                                    for d in detail)


def test_one_url_per_model_and_a_connection_error():
    server = Server(["ok"], tokens=3)

    async def go():
        runner, url = await _serve(server)
        try:
            targets = targets_for([url, url, "http://127.0.0.1:9"], MODELS)  # port 9: nothing listens
            return await closed_loop(targets, clients=2, requests=6, max_tokens=3)
        finally:
            await runner.cleanup()

    outcomes, wall = asyncio.run(go())
    f = summarize(outcomes, wall)
    assert (f["served"], f["turned_away"], f["failed"]) == (4, 0, 2)
    assert f["by_model"]["bench/copy-2"] == {SERVED: 0, TURNED_AWAY: 0, FAILED: 2}
    assert f["by_status"] == {"failed_no_http": 2}
    with pytest.raises(ValueError):
        targets_for(["a", "b"], MODELS)


def test_percentiles_nearest_rank_and_never_served():
    assert percentile([], 0.5) != percentile([], 0.5)  # nan
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0.50) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(list(reversed(values)), 0.99) == 99.0  # order does not matter
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert percentile([1.0], 0.5) == 1.0
    # 48 requests, 46 served with TTFT 0.1..4.6 s, 2 turned away
    outcomes = [RequestResult(i, "m", "u", SERVED, 200, ttft_s=0.1 * (i + 1), latency_s=5.0, tokens=48)
                for i in range(46)]
    outcomes += [RequestResult(46 + i, "m", "u", TURNED_AWAY, 429) for i in range(2)]
    f = summarize(outcomes, wall_s=10.0)
    assert f["ttft_p50_s"] == pytest.approx(2.3)  # ceil(0.5 * 46) = 23rd of 46
    assert f["ttft_p99_s"] == pytest.approx(4.6)  # ceil(0.99 * 46) = 46th
    assert f["ttft_p99_all_s"] == math.inf  # 2 of 48 never served: beyond the 99th percentile's rank 48
    assert f["tokens_per_s"] == pytest.approx(46 * 48 / 10.0)
    assert f["turned_away_fraction"] == pytest.approx(2 / 48)
    # a request sent without an outcome counts as failed
    assert summarize(outcomes, 10.0, sent=50)["failed"] == 2


def test_checks_follow_the_issue_bounds():
    def rnd(away, p99, tps, n=48):
        return {"turned_away": away, "turned_away_fraction": away / n, "ttft_p99_s": p99, "tokens_per_s": tps}

    ok = checks({"mesh-cold": rnd(4, 20.0, 10.0), "mesh-warm": rnd(0, 1.5, 50.0), "vllm": rnd(0, 14.0, 11.0)})
    assert all(c["ok"] for c in ok.values()) and set(ok) == {
        "cold_turned_away_fraction", "warm_turned_away", "warm_ttft_p99_s", "warm_vs_vllm_tokens_per_s"}
    bad = checks({"mesh-cold": rnd(5, 20.0, 10.0), "mesh-warm": rnd(1, 2.5, 30.0), "vllm": rnd(0, 14.0, 16.0)})
    assert not any(c["ok"] for c in bad.values())  # 5/48 > 10%, one turned away, p99 > 2 s, 1.875x < 2x
    assert not checks({"mesh-warm": rnd(0, math.nan, 0.0)})["warm_ttft_p99_s"]["ok"]
    text = table({"mesh-warm": dict(rnd(0, 1.5, 50.0), requests=48, served=48, failed=0, ttft_p50_s=0.5,
                                    wall_s=46.0, load_before=[1.0, 1.0, 1.0])})
    assert "mesh-warm" in text and "50.00" in text
