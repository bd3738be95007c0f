"""The node runtime: token-level loop, memory operations, eviction; virtual and real clocks."""
import asyncio

import pytest

from doubles import LinearTimes
from mesh.engines.engine_api import EngineRequest, FinishReason, Sampling
from mesh.engines.simulated import SimulatedEngine
from mesh.node.runtime import NodeRuntime
from mesh.policy.batching import IterationKind
from mesh.policy.kv_demand import RunningMean
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import SLO
from mesh.replay.virtual_loop import run_virtual
from mesh.wire.served_request import Outcome, ServedRequest

KV_PER_TOKEN = 1000
WEIGHTS = 10**6


def engine(name: str, times: LinearTimes, window: int = 1024, load_s: float = 0.0) -> SimulatedEngine:
    return SimulatedEngine(name, times, kv_bytes_per_token=KV_PER_TOKEN, weight_bytes=WEIGHTS, context_window=window,
                           load_s=load_s)


def request(rid: str, model: str, prompt: int, out: int, at: float, done: list, slo: SLO = SLO()) -> ServedRequest:
    return ServedRequest(EngineRequest(rid, prompt, Sampling(max_tokens=10_000), output_len=out), model, at, slo,
                         on_done=done.append)


async def scenario(tick: float) -> tuple[list, list]:
    """Three instances with different loads, all requests admitted at once; iteration times
    are multiples of `tick` so the same scenario runs quickly on the real clock."""
    node = NodeRuntime(NodeSpec("n", "cpu", 10**9), record_iterations=True)
    node.start()
    times = LinearTimes(prefill_per_token=tick / 100, decode_base=tick, decode_per_request=tick / 4)
    for k in range(3):
        node.memory_ops.start_instance(f"i{k}", f"m{k}", engine(f"m{k}", times), times, SLO(tpot_s=40 * tick),
                                       RunningMean(8), 0.0)
    await asyncio.sleep(tick)
    now = asyncio.get_running_loop().time()
    done: list[ServedRequest] = []
    reqs = [request(f"r{k}-{j}", f"m{k}", 50 + 30 * j, 3 + 2 * k + j, now - 0.3 * k,
                    done) for k in range(3) for j in range(k + 2)]
    for r in reqs:
        admission = node.admission.validate(r.model.replace("m", "i"), r)
        node.admit(r.model.replace("m", "i"), r, admission)
    while len(done) < len(reqs):
        await asyncio.sleep(tick)
    await node.stop()
    return [(it.instance_id, it.kind, it.batch_size) for it in node.iterations], reqs


def test_virtual_and_real_clock_give_the_same_iteration_order():
    virtual_order, virtual_reqs = run_virtual(scenario(tick=0.002))
    real_order, real_reqs = asyncio.run(scenario(tick=0.002))
    assert len(virtual_order) > 20
    assert virtual_order == real_order
    assert [r.tokens_out for r in virtual_reqs] == [r.tokens_out for r in real_reqs]


def test_virtual_time_skips_waiting():
    async def long_wait() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(3600.0)
        return loop.time() - start

    assert run_virtual(long_wait()) == pytest.approx(3600.0)


def test_requests_complete_with_ttft_and_tpot():
    async def main():
        node = NodeRuntime(NodeSpec("n", "gpu", 10**9))
        node.start()
        times = LinearTimes(prefill_per_token=0.001, decode_base=0.02)
        node.memory_ops.start_instance("i", "m", engine("m", times, load_s=0.5), times, SLO(), RunningMean(10), 0.5)
        done = []
        r = request("r", "m", 100, 5, 0.0, done)
        assert node.try_admit("i", r).ok  # validated against the predicted load time
        await asyncio.sleep(10)
        await node.stop()
        return r, node

    r, node = run_virtual(main())
    assert r.outcome is Outcome.COMPLETED and r.finish_reason is FinishReason.STOP
    assert r.ttft_s == pytest.approx(0.5 + 0.1, abs=1e-3)  # load (+ KV allocation), 100-token prefill
    assert r.tpot_s == pytest.approx(0.02) and r.tokens_out == 5 and r.slo_met
    assert node.instances["i"].memory.mean_output.value == 5
    assert node.iteration_count == 5


def test_max_tokens_gives_length_reason():
    async def main():
        node = NodeRuntime(NodeSpec("n", "gpu", 10**9))
        node.start()
        times = LinearTimes()
        node.memory_ops.start_instance("i", "m", engine("m", times), times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(0.01)
        done = []
        r = ServedRequest(EngineRequest("r", 10, Sampling(max_tokens=3), output_len=50), "m", 0.0, SLO(),
                          on_done=done.append)
        node.try_admit("i", r)
        await asyncio.sleep(5)
        await node.stop()
        return r

    r = run_virtual(main())
    assert r.tokens_out == 3 and r.finish_reason is FinishReason.LENGTH


def test_kv_underestimate_evicts_longest_headroom_request():
    """6.4: outputs far beyond O_avg overflow the KV cache; memory is short, so the
    request with the longest headroom is evicted and handed back for rescheduling."""
    evicted: list[ServedRequest] = []

    async def main():
        # weights + 300 tokens of KV at most
        node = NodeRuntime(NodeSpec("n", "cpu", WEIGHTS + 300 * KV_PER_TOKEN), on_evict=evicted.append, watermark=0.0)
        node.start()
        times = LinearTimes(prefill_per_token=0.0001, decode_base=0.01)
        node.memory_ops.start_instance("i", "m", engine("m", times, window=256), times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(0.01)
        done = []
        urgent = request("urgent", "m", 50, 120, -1.0, done)  # arrived earlier: less headroom
        relaxed = request("relaxed", "m", 50, 120, 0.0, done)
        for r in (urgent, relaxed):
            assert node.try_admit("i", r).ok
        await asyncio.sleep(10)
        await node.stop()
        return node, urgent, relaxed

    node, urgent, relaxed = run_virtual(main())
    assert [r.request_id for r in evicted] == ["relaxed"]
    assert relaxed.outcome is None and relaxed.evictions == 1 and "outgrew" in relaxed.attempts[0]
    assert urgent.outcome is Outcome.COMPLETED and urgent.tokens_out == 120
    assert node.memory.station.pessimistic <= node.spec.memory_bytes


def test_memory_ops_are_ordered_by_the_station():
    """A second load waits while the first holds the memory; it starts once the first
    instance is unloaded, and its instance is only scheduled once loaded."""

    async def main():
        node = NodeRuntime(NodeSpec("n", "gpu", 2 * WEIGHTS + 1100 * KV_PER_TOKEN))
        node.start()
        times = LinearTimes()
        a = engine("a", times, window=512, load_s=1.0)
        b = engine("b", times, window=512, load_s=1.0)
        assert node.memory_ops.start_instance("a", "a", a, times, SLO(), RunningMean(1), 1.0).accepted
        await asyncio.sleep(2.0)
        assert node.instances["a"].loaded
        assert not node.memory_ops.can_start("b", b, RunningMean(1))  # budget full
        node.memory_ops.stop_instance("a")
        issued = node.memory_ops.start_instance("b", "b", b, times, SLO(), RunningMean(1), 1.0)
        assert issued.accepted
        await asyncio.sleep(0.5)
        loaded_midway = node.instances["b"].loaded
        await asyncio.sleep(2.0)
        await node.stop()
        return loaded_midway, node

    loaded_midway, node = run_virtual(main())
    assert not loaded_midway and node.instances["b"].loaded
    assert "a" not in node.instances and node.memory.station.size("a") == 0


def test_simulated_engine_batching_and_kv_bytes():
    async def main():
        e = engine("m", LinearTimes(prefill_per_token=0.001, decode_base=0.01), window=1000)
        e.prefill_token_budget = 500
        e.add_request(EngineRequest("a", 300, Sampling(max_tokens=100), output_len=2))
        e.add_request(EngineRequest("b", 300, Sampling(max_tokens=100), output_len=3))
        kinds = []
        while e.has_work():
            res = await e.step()
            kinds.append((res.kind, list(res.request_ids), dict(res.finished)))
            if len(kinds) == 2:
                kv = e.kv_bytes_in_use()
        return kinds, kv, e

    kinds, kv, e = run_virtual(main())
    assert kinds == [
        (IterationKind.PREFILL, ["a"], {}),
        (IterationKind.PREFILL, ["b"], {}),
        (IterationKind.DECODE, ["a", "b"], {"a": FinishReason.STOP}),
        (IterationKind.DECODE, ["b"], {"b": FinishReason.STOP}),
    ]
    assert kv == 2 * 301 * KV_PER_TOKEN and e.kv_bytes_in_use() == 0


def test_admission_refuses_beyond_max_batch_and_context_window():
    async def main():
        node = NodeRuntime(NodeSpec("n", "gpu", 10**9))
        node.start()
        times = LinearTimes(decode_base=0.001)
        eng = SimulatedEngine("m", times, kv_bytes_per_token=KV_PER_TOKEN, weight_bytes=WEIGHTS,
                              context_window=512, max_batch=2)
        node.memory_ops.start_instance("i", "m", eng, times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(0.01)
        done = []
        results = [node.try_admit("i", request(f"r{k}", "m", 10, 50, 0.0, done)) for k in range(3)]
        too_long = node.try_admit("i", request("long", "m", 512, 5, 0.0, done))
        await node.stop()
        return results, too_long

    results, too_long = run_virtual(main())
    assert [a.ok for a in results] == [True, True, False]
    assert "maximum batch of 2" in results[2].reason()
    assert not too_long.ok and "context window of 512" in too_long.reason()


def test_simulated_engine_abort_during_an_iteration():
    """An abort that lands while an iteration runs: the request gets no token and the
    engine's accounting stays exact."""

    async def main():
        e = engine("m", LinearTimes(prefill_per_token=0.01, decode_base=0.1), window=1000)
        e.add_request(EngineRequest("a", 100, Sampling(max_tokens=100), output_len=5))
        e.add_request(EngineRequest("b", 100, Sampling(max_tokens=100), output_len=5))
        step = asyncio.ensure_future(e.step())
        await asyncio.sleep(0.5)  # inside the 2 s prefill
        e.abort("a")
        prefill = await step
        step = asyncio.ensure_future(e.step())
        await asyncio.sleep(0.05)
        e.add_request(EngineRequest("c", 10, Sampling(max_tokens=100), output_len=5))
        e.abort("b")
        decode = await step
        return prefill, decode, e

    prefill, decode, e = run_virtual(main())
    assert list(prefill.request_ids) == ["b"]
    assert list(decode.request_ids) == [] and e.kv_bytes_in_use() == 0


def test_overheads_are_charged_by_the_simulated_engine_exactly_as_the_node_predicts_them():
    """mesh-profile/2 overheads (decode after prefill, changed decode batch, new prefill shape,
    instance switch, step overhead): in virtual time every iteration takes exactly its prediction."""
    from dataclasses import dataclass

    from mesh.engines.simulated import SharedCore

    @dataclass(frozen=True)
    class WithOverheads(LinearTimes):
        decode_after_prefill_s: float = 0.005
        decode_batch_change_s: float = 0.002
        prefill_new_shape_s: float = 0.003
        instance_switch_s: float = 0.001
        step_overhead_s: float = 0.0005

    async def main():
        node = NodeRuntime(NodeSpec("n", "cpu", 10**9), record_iterations=True)
        node.start()
        times = WithOverheads(prefill_per_token=0.0001, decode_base=0.01)
        core = SharedCore()
        for k in range(2):
            e = SimulatedEngine(f"m{k}", times, kv_bytes_per_token=KV_PER_TOKEN, weight_bytes=WEIGHTS,
                                context_window=1024, core=core)
            node.memory_ops.start_instance(f"i{k}", f"m{k}", e, times, SLO(), RunningMean(8), 0.0)
        await asyncio.sleep(0.01)
        done: list = []
        now = asyncio.get_running_loop().time()
        reqs = [request(f"r{k}{j}", f"m{k}", 40 + 10 * j, 3 + 4 * j, now, done) for k in range(2) for j in range(3)]
        for j, r in enumerate(reqs):
            await asyncio.sleep(0.013 * j)
            node.admit(r.model.replace("m", "i"), r, node.admission.validate(r.model.replace("m", "i"), r))
        while len(done) < len(reqs):
            await asyncio.sleep(0.01)
        await node.stop()
        return node.iterations

    its = run_virtual(main())
    assert len(its) > 20
    for it in its:
        assert it.duration_s == pytest.approx(it.predicted_s, abs=1e-9)
    base = LinearTimes(prefill_per_token=0.0001, decode_base=0.01)
    extra = [it.duration_s - (base.decode_s(it.batch_size, 0) if it.kind is IterationKind.DECODE else
                              base.prefill_s(it.tokens)) for it in its]
    assert {round(x, 6) for x in extra} >= {0.0005, 0.0015, 0.0055}  # step; + switch; + after prefill
    assert any(round(x, 6) in (0.0035, 0.0045) for x in extra)  # a new prefill shape (+ a switch)


def test_a_crashed_token_level_loop_is_logged_places_its_requests_again_and_restarts(caplog):
    """A bug that ends the token-level loop (an exception that is no EngineError) must not
    leave its streams waiting while the node still answers pings: the requests are evicted
    as a fault (to be placed again), the crash stays in failure(), and the node serves on."""

    class Crashing(SimulatedEngine):
        crashes = 1

        async def step(self):
            if self.crashes:
                self.crashes -= 1
                raise KeyError("a bug")
            return await super().step()

    async def main():
        evicted: list[ServedRequest] = []
        node = NodeRuntime(NodeSpec("n", "cpu", 10**9), on_evict=evicted.append)
        node.start()
        times = LinearTimes(prefill_per_token=0.001, decode_base=0.02)
        eng = Crashing("m", times, kv_bytes_per_token=KV_PER_TOKEN, weight_bytes=WEIGHTS, context_window=1024)
        node.memory_ops.start_instance("i", "m", eng, times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(0.1)
        done: list[ServedRequest] = []
        first = request("r1", "m", 50, 5, asyncio.get_running_loop().time(), done)
        assert node.try_admit("i", first).ok
        await asyncio.sleep(1.0)
        assert [r.request_id for r in evicted] == ["r1"] and evicted[0].fault
        assert isinstance(node.failure(), KeyError)
        second = request("r2", "m", 50, 5, asyncio.get_running_loop().time(), done)
        assert node.try_admit("i", second).ok
        await asyncio.sleep(1.0)
        await node.stop()
        return second

    with caplog.at_level("ERROR", logger="mesh.node.runtime"):
        second = run_virtual(main())
    assert second.outcome is Outcome.COMPLETED and second.tokens_out == 5
    assert "token-level loop crashed" in caplog.text
