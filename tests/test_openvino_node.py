"""The node runtime driving the real OpenVINO engine (slow): outputs that outgrow the KV
estimate (LLM-Mesh 6.4), arrivals while the node is busy, and the fidelity and engine
benchmarks end to end on tiny workloads (their keys, not their speed)."""
from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from doubles import LinearTimes
from mesh.engines.engine_api import EngineRequest, FinishReason, Sampling
from mesh.engines.openvino_engine import OpenVINOEngine
from mesh.node.runtime import NodeRuntime
from mesh.policy.kv_demand import RunningMean
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import SLO
from mesh.wire.served_request import Outcome, ServedRequest

PROMPT, OUTPUT = 40, 80
WINDOW = 128  # L_min: the initial KV estimate covers 128 tokens


def _engine(demo_gguf: Path) -> OpenVINOEngine:
    return OpenVINOEngine(demo_gguf, model_name="smol", context_window=WINDOW, max_num_seqs=8, ignore_eos=True)


def _request(engine: OpenVINOEngine, rid: str, arrival: float, done: list) -> ServedRequest:
    ids = engine.encode_prompt("The lighthouse keeper climbed the spiral stairs every evening. " * 8)[:PROMPT]
    er = EngineRequest(rid, PROMPT, Sampling(max_tokens=OUTPUT), ids, output_len=OUTPUT)
    return ServedRequest(er, "smol", arrival, SLO(tpot_s=10.0), on_done=done.append)


async def _serve_two(demo_gguf: Path, kv_tokens: int) -> tuple[NodeRuntime, list, list, int]:
    """Two requests whose outputs (80 tokens each) far exceed the estimate (O_avg = 4) on a
    node with weights + `kv_tokens` tokens of KV. An evicted request is rescheduled on the
    same node once the other has finished (a one-node stand-in for the dispatcher)."""
    engine = _engine(demo_gguf)
    evicted: list[ServedRequest] = []
    done: list[ServedRequest] = []
    loop = asyncio.get_running_loop()
    node = NodeRuntime(NodeSpec("n", "cpu", engine.weight_bytes + kv_tokens * engine.kv_bytes_per_token),
                       watermark=0.0, on_evict=evicted.append)
    node.start()
    times = LinearTimes(prefill_per_token=1e-3, decode_base=0.02)
    assert node.memory_ops.start_instance("i", "smol", engine, times, SLO(tpot_s=10.0), RunningMean(4), 5.0).accepted
    while not node.instances["i"].loaded:
        await asyncio.sleep(0.05)
    initial_kv = node.memory.kv_bytes("i")
    now = loop.time()
    urgent = _request(engine, "urgent", now - 1.0, done)  # arrived earlier: less headroom
    relaxed = _request(engine, "relaxed", now, done)
    for r in (urgent, relaxed):
        assert node.try_admit("i", r).ok
    while len(done) < 2:
        await asyncio.sleep(0.02)
        if evicted and not node.instances["i"].requests:
            again = evicted.pop()
            assert node.try_admit("i", again).ok, "the rescheduled request fits once the node is free"
    await node.stop()
    await engine.unload()
    return node, [urgent, relaxed], done, initial_kv


@pytest.mark.slow
def test_output_beyond_the_estimate_evicts_and_reschedules(demo_gguf: Path) -> None:
    """Weights + 200 tokens of KV: the two requests need 2 x 120; the scale-ups stop at
    the node's memory, the request with the longest headroom is evicted, rescheduled when
    memory frees, and both complete with all their tokens."""
    node, (urgent, relaxed), done, initial_kv = asyncio.run(_serve_two(demo_gguf, kv_tokens=200))
    assert urgent.outcome is Outcome.COMPLETED and urgent.tokens_out == OUTPUT and urgent.evictions == 0
    assert urgent.finish_reason is FinishReason.LENGTH
    assert relaxed.evictions == 1 and "outgrew its estimate" in relaxed.attempts[0]
    assert relaxed.outcome is Outcome.COMPLETED and relaxed.tokens_out == OUTPUT
    assert [r.request_id for r in done] == ["urgent", "relaxed"]
    assert node.memory.station.pessimistic <= node.spec.memory_bytes


@pytest.mark.slow
def test_output_beyond_the_estimate_scales_up_when_memory_allows(demo_gguf: Path) -> None:
    node, (urgent, relaxed), done, initial_kv = asyncio.run(_serve_two(demo_gguf, kv_tokens=400))
    assert urgent.evictions == relaxed.evictions == 0
    assert all(r.outcome is Outcome.COMPLETED and r.tokens_out == OUTPUT for r in (urgent, relaxed))
    grown = max(node.memory.kv_bytes("i"), initial_kv)
    assert initial_kv == WINDOW * node.instances["i"].engine.kv_bytes_per_token  # L_min, watermark 0
    assert grown >= initial_kv


@pytest.mark.slow
def test_arrivals_are_admitted_while_the_node_is_busy(demo_gguf: Path) -> None:
    """A request arriving during a long generation joins the next iteration: the engine
    yields to the event loop after every step, so the node does not starve its loop."""

    async def main():
        engine = _engine(demo_gguf)
        node = NodeRuntime(NodeSpec("n", "cpu", 2**34))
        node.start()
        times = LinearTimes(prefill_per_token=1e-3, decode_base=0.02)
        node.memory_ops.start_instance("i", "smol", engine, times, SLO(tpot_s=10.0), RunningMean(16), 5.0)
        while not node.instances["i"].loaded:
            await asyncio.sleep(0.05)
        done: list[ServedRequest] = []
        loop = asyncio.get_running_loop()
        first = _request(engine, "first", loop.time(), done)
        node.try_admit("i", first)
        second = _request(engine, "second", 0.0, done)
        arrived = []

        def arrive() -> None:
            second.arrival_s = loop.time()
            arrived.append(first.tokens_out if first.outcome else node.compute.tokens_out("first"))
            node.try_admit("i", second)

        loop.call_later(0.3, arrive)
        while len(done) < 2:
            await asyncio.sleep(0.02)
        await node.stop()
        await engine.unload()
        return first, second, arrived

    first, second, arrived = asyncio.run(main())
    assert arrived and 0 < arrived[0] < OUTPUT  # it arrived while "first" was generating
    assert second.first_token_s < first.finish_s  # and was served before "first" ended
    assert second.ttft_s < 1.0


@pytest.mark.slow
def test_fidelity_bench_end_to_end(demo_gguf: Path, tmp_path: Path) -> None:
    from mesh.bench import fidelity
    from mesh.calibration.openvino_calibration import OpenVINOTarget
    from mesh.calibration.runner import Settings, calibrate

    profile = tmp_path / "tiny.json"
    calibrate(OpenVINOTarget(demo_gguf, context_window=fidelity.WINDOW, max_batch=2), Settings(32, 2, 32, reps=1,
                                                                                               warmup=0),
              profile, progress=False)
    figures = fidelity.run(n=6, duration_s=1.0, scale=32.0, seed=1, profile=str(profile), model=str(demo_gguf),
                           max_prompt=48, max_output=6, wait_quiet_s=0, tries=1, live_repeats=2,
                           trace_out=tmp_path / "trace", prompt_scale=2.0)
    for key in ("ttft_p50_err", "tpot_p50_err", "ttft_p99_err", "tpot_p99_err", "over_margin_fraction",
                "ttft_p50_live_s", "ttft_p50_sim_s", "tpot_p50_live_s", "tpot_p50_sim_s"):
        assert math.isfinite(figures[key]) and figures[key] >= 0, key
    assert 0 <= figures["over_margin_fraction"] <= 1
    assert figures["completed_live"] == figures["completed_sim"] == 6
    assert figures["iterations_live"] > 0 and figures["iterations_sim"] > 0
    assert len(figures["live_runs"]) == 2 and math.isfinite(figures["live_to_live_ttft_p50_diff"])
    assert 0 <= figures["over_margin_fraction_fixed"] <= 1 and math.isfinite(figures["iterations_err"])
    # --trace-out: both iteration logs, the divergence report, the two figures
    trace = tmp_path / "trace"
    live = (trace / "live.jsonl").read_text().splitlines()
    sim = (trace / "sim.jsonl").read_text().splitlines()
    assert len(live) == figures["iterations_live"] and len(sim) == figures["iterations_sim"]
    assert "First difference" in (trace / "divergence.md").read_text() or figures["first_divergence"] == -1
    assert (trace / "predicted_vs_live.png").stat().st_size > 0 and (trace / "cumulative_tokens.png").stat().st_size > 0


@pytest.mark.slow
def test_engine_bench_end_to_end(demo_gguf: Path) -> None:
    from mesh.bench import engine as engine_bench

    figures = engine_bench.run(n=3, output_len=4, rounds=1, model=str(demo_gguf), wait_quiet_s=0)
    assert figures["mesh_tokens_per_s"] > 0 and figures["bare_tokens_per_s"] > 0
    assert figures["ratio"] == pytest.approx(figures["mesh_tokens_per_s"] / figures["bare_tokens_per_s"])
    assert figures["tokens_per_run"] == 3 * 4
    assert figures["mesh_iterations"] == figures["bare_steps"]  # the same iterations both ways
