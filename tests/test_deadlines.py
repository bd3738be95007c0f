"""The deadline rules (mesh.policy.slo.DeadlineRule): Eq. 1 and the pace rule, in the policy
core (token deadlines, the compute subsystem's bookkeeping, shadow validation), a resumed
request, a node runtime serving a client whose pace the rule protects, and the options that
choose the rule (replay, agent, service)."""
from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from doubles import LinearTimes
from mesh.control.dispatcher import eq1_slo_met
from mesh.control.fleet import ClusterConfig, ClusterError
from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.engines.simulated import SimulatedEngine
from mesh.node.runtime import NodeRuntime
from mesh.policy.batching import IterationKind
from mesh.policy.compute import ComputeSubsystem, Iteration
from mesh.policy.kv_demand import RunningMean
from mesh.policy.node_spec import NodeSpec
from mesh.policy.shadow import FailureCase, shadow_validate
from mesh.policy.slo import SLO, DeadlineRule
from mesh.replay.virtual_loop import run_virtual
from mesh.wire.served_request import Outcome, ServedRequest

EQ1, PACE = DeadlineRule.EQ1, DeadlineRule.PACE
times_s = st.floats(min_value=-100.0, max_value=100.0, allow_nan=False)


# -- the rule itself -------------------------------------------------------------------------
def test_token_deadlines_by_hand():
    slo = SLO()  # TTFT max(2, L/512), TPOT 0.25
    # Arrived at 10 with 1024 prompt tokens: first token due at 12 under both rules.
    assert EQ1.token_deadline_s(slo, 10.0, 1024, 1, None) == PACE.token_deadline_s(slo, 10.0, 1024, 1, None) == 12.0
    # First token came at 10.5: token 5 due at 12 + 1 under Eq. 1, 10.5 + 1 under pace.
    assert EQ1.token_deadline_s(slo, 10.0, 1024, 5, 10.5) == pytest.approx(13.0)
    assert PACE.token_deadline_s(slo, 10.0, 1024, 5, 10.5) == pytest.approx(11.5)
    with pytest.raises(ValueError, match="first token"):
        PACE.token_deadline_s(slo, 10.0, 1024, 2, None)
    with pytest.raises(ValueError, match="numbered from 1"):
        EQ1.token_deadline_s(slo, 10.0, 1024, 0, None)


def test_parse_names_the_valid_rules():
    assert DeadlineRule.parse("PACE") is PACE and DeadlineRule.parse(EQ1) is EQ1
    with pytest.raises(ValueError, match="valid: eq1, pace"):
        DeadlineRule.parse("strict")
    with pytest.raises(ClusterError, match="valid: eq1, pace"):
        ClusterConfig(deadlines="fast")
    assert ClusterConfig(deadlines="pace").deadlines is PACE


@given(start=times_s, prompt=st.integers(1, 20_000), ahead=st.floats(-50.0, 50.0, allow_nan=False),
       i=st.integers(2, 5000), tpot=st.floats(0.01, 2.0))
def test_pace_shifts_every_later_deadline_by_how_early_the_first_token_came(start, prompt, ahead, i, tpot):
    """Token i >= 2: pace - Eq. 1 = FT - (ST + TTFT_SLO), the same for every i: earlier
    deadlines when the first token came early (the slack is not carried), later when late;
    and token i - 1 -> i is always exactly one TPOT_SLO apart under both."""
    slo = SLO(tpot_s=tpot)
    ft = start + slo.ttft_s(prompt) - ahead  # `ahead` s before its TTFT deadline
    eq1 = EQ1.token_deadline_s(slo, start, prompt, i, ft)
    pace = PACE.token_deadline_s(slo, start, prompt, i, ft)
    assert pace - eq1 == pytest.approx(-ahead, abs=1e-6)
    if ahead > 1e-6:
        assert pace < eq1
    for rule in (EQ1, PACE):
        step = rule.token_deadline_s(slo, start, prompt, i, ft) - rule.token_deadline_s(slo, start, prompt, i - 1, ft)
        second = tpot if rule is EQ1 else ft + tpot - (start + slo.ttft_s(prompt))
        assert step == pytest.approx(tpot if i > 2 else second, abs=1e-6)


@given(arrival=st.floats(0.0, 100.0), prompt=st.integers(1, 8000), ttft=st.floats(0.0, 10.0),
       n=st.integers(2, 2000), tpot=st.floats(0.001, 1.0))
def test_the_strict_reading_is_the_last_token_by_its_pace_deadline(arrival, prompt, ttft, n, tpot):
    """ServedRequest.slo_met (mean TPOT from the first token) holds exactly when TTFT is met
    and the last token meets its pace deadline; dispatcher.eq1_slo_met is the same with Eq. 1's."""
    slo = SLO()
    req = ServedRequest(EngineRequest("r", prompt, Sampling(max_tokens=n), output_len=n), "m", arrival, slo)
    req.first_token_s = arrival + ttft
    req.tokens_out = n
    req.end(Outcome.COMPLETED, req.first_token_s + tpot * (n - 1))
    on_time = ttft <= slo.ttft_s(prompt) + 1e-9
    last = req.finish_s
    assert req.slo_met == (on_time and last <= PACE.token_deadline_s(slo, arrival, prompt, n, req.first_token_s) + 1e-9)
    assert eq1_slo_met(req) == (on_time and last <= EQ1.token_deadline_s(slo, arrival, prompt, n,
                                                                         req.first_token_s) + 1e-9)



def test_an_slo_is_met_strictly_by_ttft_and_mean_tpot():
    """SLO.met, the one strict rule (a request's slo_met, the service's mesh_slo_met): TTFT by
    its SLO, and the mean TPOT after the first token by the TPOT SLO, unless there is none."""
    slo = SLO(ttft_min_s=2.0, ttft_s_per_prompt_token=0.01, tpot_s=0.25)
    assert slo.met(100, 2.0, 0.25) and slo.met(300, 3.0, 0.1) and slo.met(10, 1.0, None)
    assert not slo.met(100, 2.01, None) and not slo.met(300, 3.01, 0.1) and not slo.met(10, 1.0, 0.26)

# -- the compute subsystem keeps the rule's deadlines --------------------------------------------
@settings(max_examples=60, deadline=None)
@given(rule=st.sampled_from([EQ1, PACE]), data=st.data())
def test_compute_headroom_is_the_rules_next_token_deadline(rule, data):
    """Random arrivals, prefills at random times and decodes that skip random requests (an
    engine preempted them): every request's headroom + now is the rule's deadline of its next
    token, from its own arrival and first-token time."""
    slo = SLO()
    c = ComputeSubsystem(rule)
    c.add_instance("i", LinearTimes(), slo, prefill_token_budget=10**6)
    t = 0.0
    starts: dict[str, tuple[float, int]] = {}
    first: dict[str, float] = {}
    out: dict[str, int] = {}
    for step in range(data.draw(st.integers(1, 30))):
        t += data.draw(st.floats(0.0, 1.0))
        action = data.draw(st.sampled_from(["arrive", "prefill", "decode"]))
        inst = c.instances["i"]
        if action == "arrive" or not c.requests:
            rid = f"r{step}"
            prompt = data.draw(st.integers(1, 3000))
            start = t - data.draw(st.floats(0.0, 3.0))
            c.add_request("i", rid, prompt, start)
            starts[rid], out[rid] = (start, prompt), 0
        elif action == "prefill" and inst.pending:
            batch = [r.request_id for r in inst.prefill_batch()]
            c.complete_iteration("i", IterationKind.PREFILL, batch, now=t)
            for rid in batch:
                first[rid], out[rid] = t, 1
        elif inst.running:
            running = [r.request_id for r in inst.running]
            served = data.draw(st.lists(st.sampled_from(running), unique=True))
            c.complete_iteration("i", IterationKind.DECODE, served)
            for rid in served:
                out[rid] += 1
        for rid in c.requests:
            start, prompt = starts[rid]
            want = rule.token_deadline_s(slo, start, prompt, out[rid] + 1, first.get(rid))
            assert c.headroom(rid, t) + t == pytest.approx(want, abs=1e-6)


def test_pace_needs_the_time_of_a_prefill():
    c = ComputeSubsystem(PACE)
    c.add_instance("i", LinearTimes(), SLO(), 4096)
    c.add_request("i", "r", 10, 0.0)
    with pytest.raises(ValueError, match="needs `now`"):
        c.complete_iteration("i", IterationKind.PREFILL, ["r"])


def test_a_resumed_requests_deadlines_stay_those_of_its_history():
    """A request preempted after its first token is prefilled again on a new node: that
    prefill is not its first token, so under pace its later tokens stay due from its real
    first token (folded into its effective start), not from the recompute."""
    slo = SLO()
    req = ServedRequest(EngineRequest("r", 100, Sampling(max_tokens=50), output_len=50), "m", 0.0, slo)
    req.first_token_s, req.tokens_out = 0.5, 4  # tokens 1-4 out; token 5 due at 0.5 + 4 x 0.25 = 1.5 under pace
    prompt, start = req.resumed(4, PACE)
    assert prompt == 104 and start + slo.ttft_s(prompt) == pytest.approx(1.5)
    prompt, start = req.resumed(4, EQ1)
    assert start + slo.ttft_s(prompt) == pytest.approx(2.0 + 1.0)
    c = ComputeSubsystem(PACE)
    c.add_instance("i", LinearTimes(), slo, 4096)
    c.add_request("i", "r", *req.resumed(4, PACE), resumed=True)
    c.complete_iteration("i", IterationKind.PREFILL, ["r"], now=1.2)  # token 5 came at 1.2, early
    assert c.headroom("r", 1.2) + 1.2 == pytest.approx(1.75)  # token 6: 0.5 + 5 x 0.25, not 1.2 + 0.25


# -- shadow validation protects the pace -----------------------------------------------------
def _node_with_a_started_request(rule: DeadlineRule) -> ComputeSubsystem:
    """r1 arrived at 0 and got its first token at 0.1 (1.9 s early), then 4 more by 0.3."""
    c = ComputeSubsystem(rule)
    c.add_instance("i", LinearTimes(prefill_per_token=0.001, decode_base=0.05), SLO(), 4096)
    c.add_request("i", "r1", 100, 0.0)
    c.complete_iteration("i", IterationKind.PREFILL, ["r1"], now=0.1)
    for _ in range(4):
        c.complete_iteration("i", IterationKind.DECODE, ["r1"])
    return c


def test_shadow_validation_rejects_a_prefill_that_breaks_a_started_requests_pace():
    """A 1500-token prompt prefills first (engines' rule) for 1.65 s with the margin: r1's
    token 6 then comes at ~2.0 s. Eq. 1 has it due at 2 + 5 x 0.25 = 3.25: admitted. Pace
    has it due at 0.1 + 5 x 0.25 = 1.35: rejected for r1's sake."""
    eq1 = shadow_validate(_node_with_a_started_request(EQ1), "i", "r2", 1500, start_s=0.3, now=0.3)
    assert eq1.ok, eq1.reason()
    pace = shadow_validate(_node_with_a_started_request(PACE), "i", "r2", 1500, start_s=0.3, now=0.3)
    f = pace.failed(FailureCase.EXISTING_REQUEST_LATE)
    assert f is not None and f.request_id == "r1"
    assert f.by_s == pytest.approx(0.3 + 1.65 + 0.055 - 1.35)
    assert pace.failed(FailureCase.OWN_PREFILL_LATE) is None and pace.failed(FailureCase.DECODE_ROUND_OVER_TPOT) is None
    # A short prompt fits r1's pace: admitted under both.
    assert shadow_validate(_node_with_a_started_request(PACE), "i", "r3", 200, start_s=0.3, now=0.3).ok


@pytest.mark.parametrize("in_flight", [False, True])
def test_pace_counts_a_pending_requests_later_tokens_from_its_simulated_first_token(in_flight):
    """r1 (100 tokens) waits for prefill, or is being prefilled (the iteration in flight ends
    at 0.1); the candidate r2 (1500 tokens) on the same instance does not fit the same
    prefill batch (budget 1000), so it prefills right after r1, for 1.65 s. Under pace r1's
    token 2 is due 0.25 s after its (simulated) first token, and comes 1.7 s after it:
    rejected. Under Eq. 1 it is due at 2.25: admitted."""
    def node(rule: DeadlineRule) -> ComputeSubsystem:
        c = ComputeSubsystem(rule)
        c.add_instance("a", LinearTimes(prefill_per_token=0.001, decode_base=0.05), SLO(), 1000)
        c.add_request("a", "r1", 100, 0.0)
        if in_flight:
            c.in_flight = Iteration("a", IterationKind.PREFILL, 1, 100, 0.1)
            c.busy_until = 0.1
        return c
    first = 0.1 if in_flight else 0.11  # r1's first token in the simulation
    eq1 = shadow_validate(node(EQ1), "a", "r2", 1500, start_s=0.0, now=0.0)
    assert eq1.ok, eq1.reason()
    pace = shadow_validate(node(PACE), "a", "r2", 1500, start_s=0.0, now=0.0)
    assert pace.failed(FailureCase.OWN_PREFILL_LATE) is None
    late = pace.failed(FailureCase.EXISTING_REQUEST_LATE)
    assert late is not None and late.request_id == "r1"
    assert late.by_s == pytest.approx(first + 1.65 + 0.055 - (first + 0.25))


# -- a node runtime: the client's measured pace ------------------------------------------------
async def _serve(rule: DeadlineRule) -> tuple[ServedRequest, bool, str]:
    """r1 (7 tokens) arrives at 0; r2 with a 1500-token prompt at 0.32, on the same instance,
    when r1 has 5 tokens and its 6th is being decoded."""
    loop = asyncio.get_running_loop()
    node = NodeRuntime(NodeSpec("n", "cpu", 10**9), deadlines=rule)
    node.start()
    times = LinearTimes(prefill_per_token=0.001, decode_base=0.05)
    eng = SimulatedEngine("m", times, kv_bytes_per_token=1000, weight_bytes=10**6, context_window=4096)
    node.memory_ops.start_instance("i", "m", eng, times, SLO(), RunningMean(8), 0.0)
    await asyncio.sleep(0.0)
    t0 = loop.time()
    r1 = ServedRequest(EngineRequest("r1", 100, Sampling(max_tokens=7), output_len=7), "m", t0, SLO())
    assert node.try_admit("i", r1).ok
    await asyncio.sleep(0.32)
    r2 = ServedRequest(EngineRequest("r2", 1500, Sampling(max_tokens=2), output_len=2), "m", loop.time(), SLO())
    admission = node.try_admit("i", r2)
    await asyncio.sleep(10.0)
    await node.stop()
    return r1, admission.ok, admission.reason()


def test_under_eq1_the_client_sees_a_slow_pace_and_under_pace_it_does_not():
    r1, admitted, _ = run_virtual(_serve(EQ1))
    assert admitted and r1.outcome is Outcome.COMPLETED and r1.tokens_out == 7
    assert eq1_slo_met(r1)  # Eq. 1 calls it compliant ...
    assert r1.tpot_s > r1.slo.tpot_s and not r1.slo_met  # ... the client measured > 0.25 s per token
    r1, admitted, why = run_virtual(_serve(PACE))
    assert not admitted and FailureCase.EXISTING_REQUEST_LATE.value in why and "r1" in why
    assert r1.slo_met and r1.tpot_s <= r1.slo.tpot_s and math.isfinite(r1.tpot_s)


arrivals = st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(10, 2500), st.integers(2, 80), st.integers(0, 1)),
                   min_size=1, max_size=40)


async def _admit_all(rule: DeadlineRule, plan: list[tuple[float, int, int, int]]) -> list[ServedRequest]:
    """Requests arrive on two instances of one node whose engines take exactly the predicted
    times; those shadow validation admits are served to the end."""
    loop = asyncio.get_running_loop()
    node = NodeRuntime(NodeSpec("n", "cpu", 10**12), deadlines=rule)
    node.start()
    times = LinearTimes(prefill_per_token=0.0005, decode_base=0.03, decode_per_request=0.004,
                        decode_per_context_token=1e-6)
    for k in range(2):
        eng = SimulatedEngine(f"m{k}", times, kv_bytes_per_token=1000, weight_bytes=10**6, context_window=4096)
        node.memory_ops.start_instance(f"i{k}", f"m{k}", eng, times, SLO(), RunningMean(50), 0.0)
    await asyncio.sleep(0.0)
    admitted = []
    for j, (gap, prompt, out, k) in enumerate(plan):
        await asyncio.sleep(gap)
        r = ServedRequest(EngineRequest(f"r{j}", prompt, Sampling(max_tokens=out), output_len=out), f"m{k}",
                          loop.time(), SLO())
        if node.try_admit(f"i{k}", r).ok:
            admitted.append(r)
    await asyncio.sleep(300.0)
    await node.stop()
    return admitted


@settings(max_examples=40, deadline=None)
@given(plan=arrivals)
def test_what_validation_admits_meets_the_reading_of_its_rule(plan):
    """With exact iteration times, every request admitted under `pace` meets the strict
    reading (mean TPOT from its first token), and every one admitted under `eq1` meets Eq. 1.
    (Over 200 random runs of this kind, eq1 admitted 2651 requests of which 287 failed the
    strict reading; pace admitted 2414, none failing either.)"""
    for r in run_virtual(_admit_all(PACE, plan)):
        assert r.outcome is Outcome.COMPLETED and r.slo_met, (r.request_id, r.ttft_s, r.tpot_s)
    for r in run_virtual(_admit_all(EQ1, plan)):
        assert r.outcome is Outcome.COMPLETED and eq1_slo_met(r), (r.request_id, r.ttft_s, r.tpot_s)


# -- the service's agents ---------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["pace", "eq1"])
def test_a_local_agent_process_runs_the_rule_it_is_given(rule):
    """The supervisor starts a real agent process with the service's rule (AgentSettings,
    from `mesh serve --deadlines`, default pace); its hello and stats say which it runs."""
    from mesh.control.supervisor import AgentSettings, LocalAgent

    async def main() -> tuple[str, str]:
        agent = LocalAgent(NodeSpec("cpu-0", "cpu", 10**9), lambda a: None, lambda a, why: None, lambda a, m: None,
                           AgentSettings(deadlines=rule))
        await agent.start()
        try:
            assert await agent.wait_up(60.0), agent.last_error
            stats = await agent.client.call_message({"t": "stats"}, 10.0)
            hello = await agent.client.call_message({"t": "hello", "token": agent.token}, 10.0)
        finally:
            await agent.stop()
        return stats["deadlines"], hello["deadlines"]

    assert asyncio.run(main()) == (rule, rule)


# -- moved deadlines: a value passed, not a change to the request ---------------------------------
def test_a_request_tried_with_moved_deadlines_keeps_them_only_once_admitted():
    """A request that arrived 10 s ago can no longer make its TTFT (2 s) on its own deadlines.
    Tried with deadlines still in the past it is refused and left as it was; tried with
    deadlines from now (Deadlines.from_at_least) it is admitted and keeps them."""
    async def main():
        loop = asyncio.get_running_loop()
        node = NodeRuntime(NodeSpec("n", "cpu", 10**9))
        node.start()
        times = LinearTimes(prefill_per_token=0.001, decode_base=0.05)
        eng = SimulatedEngine("m", times, kv_bytes_per_token=1000, weight_bytes=10**6, context_window=4096)
        node.memory_ops.start_instance("i", "m", eng, times, SLO(), RunningMean(8), 0.0)
        await asyncio.sleep(10.0)
        now = loop.time()
        r = ServedRequest(EngineRequest("r", 100, Sampling(max_tokens=3), output_len=3), "m", now - 10.0, SLO())
        own = node.try_admit("i", r)
        still_late = node.try_admit("i", r, deadlines=r.deadlines.from_at_least(now - 5.0))
        late_s_after_refusal = r.late_s
        from_now = node.try_admit("i", r, deadlines=r.deadlines.from_at_least(now))
        await asyncio.sleep(5.0)
        await node.stop()
        return r, own.ok, still_late.ok, late_s_after_refusal, from_now.ok

    r, own, still_late, late_s_after_refusal, from_now = run_virtual(main())
    assert not own and not still_late and late_s_after_refusal == 0.0
    assert from_now and r.late_s == pytest.approx(10.0) and r.outcome is Outcome.COMPLETED
    assert r.deadlines.start_s == pytest.approx(r.arrival_s + 10.0) and not r.slo_met  # judged from arrival
