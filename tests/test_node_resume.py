"""What the dispatcher needs from the node core: validation with preempted neighbours left
out, of groups and of instances not started yet; taking a request back with its progress and
resuming it elsewhere; and the two shadow-validation horizon rules (in-flight iteration,
prefills waiting on neighbour instances)."""
import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from doubles import LinearTimes
from mesh.engines.engine_api import EngineError, EngineRequest, Sampling
from mesh.engines.simulated import SimulatedEngine
from mesh.node.runtime import NodeRuntime
from mesh.policy.admission import InstancePlan
from mesh.policy.batching import IterationKind
from mesh.policy.compute import ComputeSubsystem, Iteration
from mesh.policy.kv_demand import RunningMean
from mesh.policy.node_spec import NodeSpec
from mesh.policy.shadow import FailureCase, quick_reject, shadow_validate
from mesh.policy.slo import SLO, DeadlineRule
from mesh.replay.virtual_loop import run_virtual
from mesh.wire.served_request import Outcome, ServedRequest

KV = 1000
W = 10**6


def engine(times: LinearTimes, window: int = 2048) -> SimulatedEngine:
    return SimulatedEngine("m", times, kv_bytes_per_token=KV, weight_bytes=W, context_window=window)


def req(rid: str, prompt: int, out: int, at: float, slo: SLO = SLO()) -> ServedRequest:
    return ServedRequest(EngineRequest(rid, prompt, Sampling(max_tokens=out), output_len=out), "m", at, slo)


def plan(iid: str, times: LinearTimes, load_s: float = 0.5, slo: SLO = SLO()) -> InstancePlan:
    return InstancePlan(iid, "m", times, slo, KV, W, 2048, 2048, 256, RunningMean(10), load_s)


@pytest.mark.parametrize("rule", [DeadlineRule.EQ1, DeadlineRule.PACE])
def test_take_back_keeps_progress_and_the_request_resumes_elsewhere(rule):
    """A request taken off one node after k tokens resumes on another: its prompt plus
    the k tokens are prefilled again, its deadline is its next token's (under Eq. 1 from its
    arrival, under pace from its first token), and it ends with exactly its output length
    and its original first-token time."""
    times = LinearTimes(prefill_per_token=0.001, decode_base=0.02)

    async def main():
        a, b = (NodeRuntime(NodeSpec(n, "gpu", 10**9), deadlines=rule) for n in ("a", "b"))
        a.start()
        b.start()
        for node in (a, b):
            node.memory_ops.start_instance("i", "m", engine(times), times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(0.01)
        r = req("r", 100, 30, asyncio.get_running_loop().time())
        assert a.try_admit("i", r).ok
        await asyncio.sleep(0.1 + 0.02 * 5 + 0.001)  # prefill, then 5 decodes
        done = a.progress("r")
        first = r.first_token_s
        prompt, start = r.resumed(done, rule)
        assert b.admission.validate("i", r, done=done).ok
        back = a.take_back("r", "test")
        assert back is r and r.tokens_out == done and r.node_id is None and r.outcome is None
        assert "r" not in a.compute.requests and not a.instances["i"].requests
        assert b.try_admit("i", r).ok
        assert b.compute.requests["r"].prompt_len == 100 + done
        anchor = r.arrival_s + 2.0 if rule is DeadlineRule.EQ1 else first
        assert b.compute.requests["r"].ttft_deadline_s == pytest.approx(anchor + 0.25 * done)
        await asyncio.sleep(5)
        await a.stop()
        await b.stop()
        return r, done, first, prompt, start

    r, done, first, prompt, start = run_virtual(main())
    anchor = r.arrival_s + 2.0 if rule is DeadlineRule.EQ1 else first
    assert done == 6 and prompt == 106 and start + SLO().ttft_s(106) == pytest.approx(anchor + 0.25 * 6)
    assert r.outcome is Outcome.COMPLETED and r.tokens_out == 30 and r.first_token_s == first
    assert r.node_id == "b" and r.slo_met


def test_take_back_waits_for_an_instance_in_the_middle_of_a_prefill():
    times = LinearTimes(prefill_per_token=0.01)

    async def main():
        node = NodeRuntime(NodeSpec("a", "cpu", 10**9))
        node.start()
        node.memory_ops.start_instance("i", "m", engine(times), times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(0.01)
        assert node.try_admit("i", req("r", 100, 5, 0.0)).ok
        await asyncio.sleep(0.5)  # the 1 s prefill is in flight
        assert not node.can_take_back("i")
        with pytest.raises(ValueError, match="middle of a prefill"):
            node.take_back("r", "test")
        # what a node agent does instead: wait for the prefill to end, then take it back
        back = await node.take_back_after_prefill("r", "test")
        now = asyncio.get_running_loop().time()
        await node.stop()
        return back, now

    back, now = run_virtual(main())
    assert back is not None and back.tokens_out == 1 and back.outcome is None  # its prefill gave the first token
    assert now == pytest.approx(0.01 + 100 * 0.01, abs=0.02)  # when the 1 s prefill ended


def test_validate_with_excluded_neighbours_frees_compute_and_memory():
    """Two instances decode 0.1 s each against a TPOT of 0.25 s: a request for the first
    fails case 3 ((0.2 + 0.1) x 1.1), and passes with the neighbour excluded (7.1). Memory:
    the node holds both instances; with the neighbour's bytes freed the KV scale-up fits."""
    times = LinearTimes(prefill_per_token=0.0001, decode_base=0.0, decode_per_request=0.1)

    async def main():
        # each instance loads W + 2000 tokens of KV (L_min, watermark 0); 500 tokens spare
        node = NodeRuntime(NodeSpec("a", "cpu", 2 * (W + 2000 * KV) + 500 * KV), watermark=0.0)
        node.start()
        for iid in ("x", "y"):
            node.memory_ops.start_instance(iid, "m", engine(times, window=2000), times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(0.01)
        assert node.try_admit("x", req("x1", 1000, 500, 0.0)).ok and node.try_admit("y", req("y1", 10, 500, 0.0)).ok
        await asyncio.sleep(0.5)
        r = req("r", 10, 5, asyncio.get_running_loop().time())
        plain, without_y = node.admission.validate("x", r), node.admission.validate("x", r, exclude=["y"])
        big = req("big", 1900, 5, asyncio.get_running_loop().time())  # x then needs ~2920 tokens of KV
        mem_plain, mem_without_y = node.admission.validate("x", big), node.admission.validate("x", big, exclude=["y"])
        await node.stop()
        return plain, without_y, mem_plain, mem_without_y

    plain, without_y, mem_plain, mem_without_y = run_virtual(main())
    assert plain.compute.failed(FailureCase.DECODE_ROUND_OVER_TPOT) is not None and without_y.ok
    assert not mem_plain.memory.ok and mem_without_y.memory.ok


def test_validate_new_counts_the_cold_start_and_changes_nothing():
    times = LinearTimes(prefill_per_token=0.001, decode_base=0.02)

    async def main():
        node = NodeRuntime(NodeSpec("a", "gpu", 10**9))
        node.start()
        r = req("r", 1000, 5, 0.0)
        quick = node.admission.validate_new(plan("new", times, load_s=0.5), [r])
        slow = node.admission.validate_new(plan("new", times, load_s=1.0), [r])  # 1 + 1.1 > 2 s
        group = node.admission.validate_new(plan("new", times, load_s=0.5), [r, req("r2", 500, 5, 0.0)])
        tiny = NodeRuntime(NodeSpec("t", "gpu", W + 100 * KV))
        no_memory = tiny.admission.validate_new(plan("new", times), [r])
        left = (list(node.compute.instances), list(node.compute.requests))
        await node.stop()
        return quick, slow, group, no_memory, left

    quick, slow, group, no_memory, left = run_virtual(main())
    assert quick.ok and quick.compute.candidate_first_token_s == pytest.approx(0.5 + 1.1)
    assert slow.compute.failed(FailureCase.OWN_PREFILL_LATE) is not None
    assert not group.ok  # the second prompt's prefill follows the first: 0.5 + 1.1 + 0.55 > 2
    assert not no_memory.ok and not no_memory.memory.ok
    assert left == ([], [])


def test_validate_group_adds_requests_one_after_another():
    times = LinearTimes(prefill_per_token=0.001, decode_base=0.02)

    async def main():
        node = NodeRuntime(NodeSpec("a", "gpu", 10**9))
        node.start()
        node.memory_ops.start_instance("i", "m", engine(times), times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(0.01)
        now = asyncio.get_running_loop().time()
        one = node.admission.validate_group("i", [req("a", 950, 5, now)], [0])
        two = node.admission.validate_group("i", [req("a", 950, 5, now), req("b", 950, 5, now)], [0, 0])
        await node.stop()
        return one, two, list(node.compute.requests)

    one, two, left = run_virtual(main())
    assert one.ok and not two.ok and left == []  # one prefill of 1900 tokens: 2.09 s with the margin


def test_shadow_counts_the_iteration_in_flight_as_done():
    """A 1 s prefill of r1 is in flight until t = 1.0: the simulation starts there with r1
    prefilled, instead of prefilling it a second time (which would show r2 late)."""
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.001, decode_base=0.05), SLO(), 4096)
    c.add_instance("j", LinearTimes(prefill_per_token=0.001, decode_base=0.05), SLO(), 4096)
    c.add_request("i", "r1", 1000, start_s=-0.9)  # TTFT deadline 1.1
    c.add_request("j", "r2", 700, start_s=0.0)  # deadline 2.0: after r1's prefill, 1.0 + 0.77 = 1.77
    c.busy_until = 1.0
    c.in_flight = Iteration("i", IterationKind.PREFILL, 1, 1000, 1.0)
    v = shadow_validate(c, "i", "r3", 10, start_s=0.0, now=0.1)
    assert v.ok, v.reason()
    c.in_flight = None  # the old reading: r1's prefill again from 1.0, r2 pushed past 2.0
    assert not shadow_validate(c, "i", "r3", 10, start_s=0.0, now=0.1).ok


def test_shadow_sees_a_neighbours_waiting_prefill_pushed_late():
    """r2 waits on instance j (deadline 2.0); the candidate on i is due sooner, so it goes
    first and r2's prefill ends past 2.0. The horizon must reach r2's prefill to see it."""
    c = ComputeSubsystem()
    times = LinearTimes(prefill_per_token=0.001, decode_base=0.05)
    c.add_instance("i", times, SLO(), 4096)
    c.add_instance("j", times, SLO(), 4096)
    c.add_request("j", "r2", 1000, start_s=0.0)  # alone: 1.1 s, on time
    # r3 is due at 1.5: prefill to 0.99, its decodes due 1.75 and 2.0 (ties go to i) to 1.1,
    # then r2's prefill to 2.2: 0.2 s late.
    v = shadow_validate(c, "i", "r3", 900, start_s=-0.5, now=0.0)
    f = v.failed(FailureCase.EXISTING_REQUEST_LATE)
    assert f is not None and f.request_id == "r2" and f.by_s == pytest.approx(0.2)


@settings(max_examples=60, deadline=None)
@given(
    loads=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 2000), st.floats(-2.0, 0.0), st.booleans()),
                   min_size=0, max_size=8),
    prompt=st.integers(1, 3000),
    start=st.floats(-2.5, 0.0),
    busy=st.floats(0.0, 1.0),
)
def test_quick_reject_only_rejects_what_full_validation_rejects(loads, prompt, start, busy):
    c = ComputeSubsystem()
    times = LinearTimes(prefill_per_token=0.0006, decode_base=0.03, decode_per_request=0.01)
    for k in range(3):
        c.add_instance(f"i{k}", times, SLO(), 4096)
    for n, (k, p, st_, run) in enumerate(loads):
        c.add_request(f"i{k}", f"r{n}", p, st_)
        if run:
            c.complete_iteration(f"i{k}", IterationKind.PREFILL, [f"r{n}"])
    c.busy_until = busy
    quick = quick_reject(c, "i0", prompt, start, 0.0)
    full = shadow_validate(c, "i0", "cand", prompt, start, 0.0)
    if quick is not None:
        assert not full.ok and full.failed(quick.case) is not None


def test_shadow_refuses_to_push_an_already_late_request_further_behind():
    """r1 is late anyway (due at -0.3, decode 0.2 s): a candidate whose prefill goes first
    (prefill before decode within an instance) delays it further. Up to one TPOT late that
    is tolerated (tests/test_shadow.py::test_case2_ignores_requests_late_anyway); beyond,
    the candidate is refused, or a node that fell behind would take ever more load."""
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.0, prefill_base=0.01, decode_base=0.2), SLO(), 4096)
    c.add_request("i", "r1", 10, -2.55)
    c.complete_iteration("i", IterationKind.PREFILL, ["r1"])  # next token due at -2.55 + 2 + 0.25 = -0.3
    v = shadow_validate(c, "i", "r5", 10, start_s=0.0, now=0.0)
    f = v.failed(FailureCase.EXISTING_REQUEST_LATE)
    assert f is not None and f.request_id == "r1" and f.by_s == pytest.approx(0.011 + 0.22 + 0.3)
    # The same request handed back by a node that died (load taken on already, not new) is
    # not refused for r1, late anyway: refusing it would only fail it (the soak's failure).
    back = shadow_validate(c, "i", "r5", 10, start_s=0.0, now=0.0, resumed=True, handed_back=True)
    assert back.ok, back.reason()
    # ... but it still may not make late a request on time without it.
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.0, prefill_base=0.01, decode_base=0.2), SLO(), 4096)
    c.add_request("i", "r2", 10, -2.025)
    c.complete_iteration("i", IterationKind.PREFILL, ["r2"])  # next token due at 0.225: alone it decodes by 0.22
    on_time = shadow_validate(c, "i", "r5", 10, start_s=0.0, now=0.0, resumed=True, handed_back=True)
    f = on_time.failed(FailureCase.EXISTING_REQUEST_LATE)
    assert f is not None and f.request_id == "r2", on_time.reason()


class HangingEngine(SimulatedEngine):
    """A simulated engine whose worker stops (SIGSTOP) after its first iterations."""

    def __init__(self, *args, steps_before_hang: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps_left = steps_before_hang

    async def step(self):
        if self.steps_left == 0:
            await asyncio.Event().wait()  # never answers
        self.steps_left -= 1
        return await super().step()


@pytest.mark.parametrize("watchdog", [True, False])
def test_the_watchdog_evicts_the_requests_of_a_hung_engine(watchdog):
    times = LinearTimes(prefill_per_token=0.001, decode_base=0.05)

    async def main():
        evicted, hung = [], []
        node = NodeRuntime(NodeSpec("a", "cpu", 10**9), on_evict=evicted.append, watchdog=watchdog)
        node.on_hung = lambda iid, why: hung.append((iid, why))
        node.start()
        eng = HangingEngine("m", times, kv_bytes_per_token=KV, weight_bytes=W, context_window=2048,
                            steps_before_hang=5)
        node.memory_ops.start_instance("i", "m", eng, times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(0.01)
        r = req("r", 100, 50, 0.0)
        assert node.try_admit("i", r).ok
        await asyncio.sleep(200)
        state = (list(evicted), list(hung), "i" in node.instances)
        await node.stop()
        return r, state

    r, (evicted, hung, still_there) = run_virtual(main())
    if not watchdog:  # without one the request waits for ever, on an instance that stays
        assert evicted == [] and hung == [] and still_there and r.outcome is None
        return
    # a prefill and 4 decodes, then the hang: after HUNG_MIN_S (30 s > 20 x 0.05 s) the request
    # goes back to the dispatcher with its 5 tokens, and the instance is gone
    assert evicted == [r] and r.tokens_out == 5 and r.outcome is None and r.evictions == 1
    assert [iid for iid, _ in hung] == ["i"] and "ran over 30 s" in hung[0][1] and not still_there


class KillableHangingEngine(HangingEngine):
    """HangingEngine whose worker can be killed (as a real one's `kill_worker`): its hung
    step then fails, as a real worker's step does when its socket closes."""

    killed = False

    async def step(self):
        if self.steps_left == 0:
            self._kill = asyncio.Event()
            await self._kill.wait()
            raise EngineError("the worker was killed")
        return await super().step()

    def kill_worker(self) -> None:
        self.killed = True
        if hasattr(self, "_kill"):
            self._kill.set()


@pytest.mark.parametrize("steps_before_hang", [0, 5])
def test_a_stuck_worker_fails_its_instance_the_watchdogs_way_even_mid_iteration(steps_before_hang):
    """mesh.node.runtime.worker_stuck (a vLLM tokenize ran past its deadline: the worker is
    stuck): at once, long before any watchdog, the instance's requests go back with their
    progress, even from the middle of a prefill (0 tokens) or a decode (5), its worker is
    killed, the instance is gone, and the node goes on serving its other instances."""
    times = LinearTimes(prefill_per_token=0.001, decode_base=0.05)

    async def main():
        evicted, hung = [], []
        node = NodeRuntime(NodeSpec("a", "cpu", 10**9), on_evict=evicted.append, watchdog=False)
        node.on_hung = lambda iid, why: hung.append((iid, why))
        node.start()
        stuck = KillableHangingEngine("m", times, kv_bytes_per_token=KV, weight_bytes=W, context_window=2048,
                                      steps_before_hang=steps_before_hang)
        node.memory_ops.start_instance("i", "m", stuck, times, SLO(), RunningMean(10), 0.0)
        node.memory_ops.start_instance("j", "m", engine(times), times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(0.01)
        r = req("r", 100, 50, 0.0)
        assert node.try_admit("i", r).ok
        await asyncio.sleep(5)
        assert node.stepping == "i" and node.can_take_back("i") == (steps_before_hang > 0)  # 0: a prefill
        assert node.worker_stuck("i", "its tokenizer is stuck")
        assert node.stepping is None and "i" not in node.instances and stuck.killed
        assert not node.worker_stuck("i", "again")  # gone: nothing to fail
        other = req("o", 10, 3, asyncio.get_running_loop().time())
        assert node.try_admit("j", other).ok
        await asyncio.sleep(5)
        await node.stop()
        return r, other, evicted, hung, node.failure()

    r, other, evicted, hung, crash = run_virtual(main())
    assert evicted == [r] and r.tokens_out == steps_before_hang and r.outcome is None and r.evictions == 1 and r.fault
    assert hung == [("i", "its tokenizer is stuck")]
    assert other.outcome is Outcome.COMPLETED and crash is None  # the loop went on


def test_a_stuck_idle_worker_fails_its_instance():
    times = LinearTimes(prefill_per_token=0.001, decode_base=0.05)

    async def main():
        hung = []
        node = NodeRuntime(NodeSpec("a", "cpu", 10**9), watchdog=True)
        node.on_hung = lambda iid, why: hung.append((iid, why))
        node.start()
        stuck = KillableHangingEngine("m", times, kv_bytes_per_token=KV, weight_bytes=W, context_window=2048,
                                      steps_before_hang=0)
        node.memory_ops.start_instance("i", "m", stuck, times, SLO(), RunningMean(10), 0.0)
        await asyncio.sleep(1)
        assert node.worker_stuck("i", "its tokenizer is stuck")
        await node.stop()
        return hung, "i" in node.instances, stuck.killed

    assert run_virtual(main()) == ([("i", "its tokenizer is stuck")], False, True)
