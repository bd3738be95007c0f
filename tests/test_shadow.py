"""Shadow validation (LLM-Mesh 5.3): each of Figure 6's three rejection cases, with
explicit times and hand-checkable iteration times (10% overestimate)."""
from dataclasses import dataclass

import pytest

from doubles import LinearTimes
from mesh.policy.batching import IterationKind
from mesh.policy.compute import ComputeSubsystem
from mesh.policy.shadow import FailureCase, Padding, shadow_validate
from mesh.policy.slo import SLO


def running(c: ComputeSubsystem, instance_id: str, request_id: str, prompt_len: int, start_s: float) -> None:
    c.add_request(instance_id, request_id, prompt_len, start_s)
    c.complete_iteration(instance_id, IterationKind.PREFILL, [request_id])


def test_accepts_when_everything_fits():
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.001, decode_base=0.05), SLO(), 4096)
    running(c, "i", "r1", 100, 0.0)
    v = shadow_validate(c, "i", "new", 200, start_s=0.0, now=0.0)
    assert v.ok, v.reason()
    assert v.candidate_first_token_s == pytest.approx(0.2 * 1.1)
    assert v.decode_round_s == pytest.approx(0.05 * 1.1)


def test_case1_own_prefill_late():
    """R5-P ends after R5's TTFT deadline: 3000 tokens at 3 ms/token = 9 s x 1.1 > 5.86 s."""
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.003), SLO(), 4096)
    v = shadow_validate(c, "i", "r5", 3000, start_s=0.0, now=0.0)
    f = v.failed(FailureCase.OWN_PREFILL_LATE)
    assert f is not None and f.request_id == "r5"
    assert f.by_s == pytest.approx(9.0 * 1.1 - 3000 / 512)
    assert v.failed(FailureCase.EXISTING_REQUEST_LATE) is None


def test_a_best_effort_request_may_be_late_itself_but_never_makes_others_late():
    """A request served late, best effort (ServedRequest.best_effort: a lost request past its
    SLO): its own 9.9 s prefill against a 5.86 s TTFT is no reason to refuse it (case 1, in
    quick_reject too); pushing a running request late still is (case 2)."""
    from mesh.policy.shadow import quick_reject

    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.003), SLO(), 4096)
    assert quick_reject(c, "i", 3000, 0.0, 0.0) is not None
    assert quick_reject(c, "i", 3000, 0.0, 0.0, own_late_ok=True) is None
    assert shadow_validate(c, "i", "r5", 3000, start_s=0.0, now=0.0, own_late_ok=True).ok

    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_base=0.15, prefill_per_token=0.0, decode_base=0.2), SLO(), 4096)
    running(c, "i", "r1", 10, start_s=-1.95)  # next token due at 0.3
    v = shadow_validate(c, "i", "r5", 10, start_s=-1.8, now=0.0, own_late_ok=True)
    assert v.failed(FailureCase.EXISTING_REQUEST_LATE) is not None


def test_case1_counts_the_iteration_in_flight():
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.001), SLO(), 4096)
    c.busy_until = 1.9  # another instance's iteration runs until then
    v = shadow_validate(c, "i", "r5", 100, start_s=0.0, now=0.0)
    assert v.failed(FailureCase.OWN_PREFILL_LATE).by_s == pytest.approx(1.9 + 0.11 - 2.0)


def test_case2_existing_request_pushed_late():
    """R5 (waited in a queue, due first) prefills before R1's next decode, which then
    ends past R1's deadline; without R5, R1 is on time."""
    c = ComputeSubsystem()
    times = LinearTimes(prefill_base=0.15, prefill_per_token=0.0, decode_base=0.2)
    c.add_instance("i", times, SLO(), 4096)
    running(c, "i", "r1", 10, start_s=-1.95)  # next token due at -1.95 + 2 + 0.25 = 0.3
    # R5 arrived 1.8 s ago: first token due at 0.2, before R1's 0.3 -> scheduled first.
    v = shadow_validate(c, "i", "r5", 10, start_s=-1.8, now=0.0)
    assert v.failed(FailureCase.OWN_PREFILL_LATE) is None  # 0.165 <= 0.2
    f = v.failed(FailureCase.EXISTING_REQUEST_LATE)
    assert f is not None and f.request_id == "r1" and f.instance_id == "i"
    assert f.by_s == pytest.approx(0.165 + 0.22 - 0.3)
    assert v.failed(FailureCase.DECODE_ROUND_OVER_TPOT) is None  # 0.2 x 1.1 <= 0.25


def test_case2_ignores_requests_late_anyway():
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.0, prefill_base=0.01, decode_base=0.2), SLO(), 4096)
    running(c, "i", "r1", 10, start_s=-2.2)  # due at 0.05: late whatever happens
    v = shadow_validate(c, "i", "r5", 10, start_s=0.0, now=0.0)
    assert v.failed(FailureCase.EXISTING_REQUEST_LATE) is None


def test_case3_decode_round_over_tpot():
    """Two instances decode 0.1 s per request each: adding R5 to instance a makes one
    round (0.2 + 0.1) x 1.1 = 0.33 s > 0.25 s."""
    c = ComputeSubsystem()
    times = LinearTimes(prefill_per_token=0.0001, decode_base=0.0, decode_per_request=0.1)
    for name in ("a", "b"):
        c.add_instance(name, times, SLO(), 4096)
        running(c, name, f"r-{name}", 10, start_s=0.0)
    v = shadow_validate(c, "a", "r5", 10, start_s=0.0, now=0.0)
    f = v.failed(FailureCase.DECODE_ROUND_OVER_TPOT)
    assert f is not None and f.instance_id == "a"
    assert f.by_s == pytest.approx(0.33 - 0.25)
    assert v.failed(FailureCase.OWN_PREFILL_LATE) is None
    assert v.failed(FailureCase.EXISTING_REQUEST_LATE) is None
    assert "decode_round_over_tpot" in v.reason()


def test_margin_is_configurable():
    """A 1.9 s prefill against a 2 s TTFT SLO: on time as predicted, late with 10% more."""
    c2 = ComputeSubsystem()
    c2.add_instance("i", LinearTimes(prefill_base=1.9, prefill_per_token=0.0), SLO(), 4096)
    assert shadow_validate(c2, "i", "x", 10, 0.0, 0.0, margin=0.0).ok  # 1.9 <= 2.0
    assert not shadow_validate(c2, "i", "x", 10, 0.0, 0.0, margin=0.10).ok  # 2.09 > 2.0


def test_loading_instance_delays_first_token():
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.001), SLO(), 4096, ready_at=1.5, loaded=False)
    v = shadow_validate(c, "i", "r", 100, 0.0, 0.0)
    assert v.ok and v.candidate_first_token_s == pytest.approx(1.5 + 0.11)
    c.instances["i"].ready_at = 1.95
    assert shadow_validate(c, "i", "r", 100, 0.0, 0.0).failed(FailureCase.OWN_PREFILL_LATE) is not None


def test_validation_changes_nothing():
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(), SLO(), 4096)
    running(c, "i", "r1", 10, 0.0)
    before = (dict(c.requests), c.instances["i"].context_sum, c.instances["i"].decode_rounds)
    shadow_validate(c, "i", "r5", 10, 0.0, 0.0)
    assert (dict(c.requests), c.instances["i"].context_sum, c.instances["i"].decode_rounds) == before
    assert "r5" not in c.instances["i"].pending


def test_an_instance_with_a_learnt_margin_is_validated_with_it():
    """Iteration times that learnt a margin (mesh.perf.times.AdaptiveTimes.margin) replace
    the node's 10% for that instance only; times without one keep the node's margin."""
    class Learnt(LinearTimes):
        margin = 0.3

    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.001, decode_base=0.05), SLO(), 4096)
    c.add_instance("j", Learnt(prefill_per_token=0.001, decode_base=0.05), SLO(), 4096)
    v_i = shadow_validate(c, "i", "a", 200, start_s=0.0, now=0.0)
    v_j = shadow_validate(c, "j", "b", 200, start_s=0.0, now=0.0)
    assert v_i.candidate_first_token_s == pytest.approx(0.2 * 1.1)
    assert v_j.candidate_first_token_s == pytest.approx(0.2 * 1.3)
    assert v_j.decode_round_s == pytest.approx(0.05 * 1.3)


def test_a_request_served_late_on_an_instance_loading_for_20_s_validates_behind_many_decodes():
    """Served late (dispatch_rules.SERVE_LATE): the candidate's instance is ready in 20 s, its
    deadlines run from then, and meanwhile a loaded neighbour decodes 50 ms steps, 400 of them
    before the candidate can prefill: more than the horizon's iteration budget (256 + ...).
    Those iterations must not exhaust it, or the candidate is "late by inf" however late its
    deadline (issue 23's single-node workload refused every request served late this way)."""
    c = ComputeSubsystem()
    c.add_instance("loaded", LinearTimes(prefill_per_token=0.0001, decode_base=0.05), SLO(), 4096)
    for k in range(4):
        running(c, "loaded", f"r{k}", 50, 0.0)
    c.add_instance("loading", LinearTimes(prefill_per_token=0.0001, decode_base=0.05), SLO(), 4096, ready_at=20.0,
                   loaded=False)
    v = shadow_validate(c, "loading", "late", 50, start_s=20.0, now=0.0)  # deadlines from the ready time
    assert v.ok, v.reason()
    assert 20.0 <= v.candidate_first_token_s <= 20.0 + 0.2
    # still refused when it cannot make it even from the ready time
    v = shadow_validate(c, "loading", "late", 50, start_s=15.0, now=0.0)
    f = v.failed(FailureCase.OWN_PREFILL_LATE)
    assert f is not None and f.by_s == pytest.approx(20.0 - (15.0 + SLO().ttft_s(50)), abs=0.1)


def test_a_margin_up_to_the_papers_pads_every_iteration_in_full():
    pad = Padding()
    assert sum(pad.add(0.5, 0.10) for _ in range(4)) == pytest.approx(4 * 0.5 * 1.10)
    assert Padding().add(0.5, 0.05) == pytest.approx(0.5 * 1.05)


def test_a_learnt_margin_pads_one_iteration_in_full_and_a_run_by_its_spread_in_quadrature():
    assert Padding().add(0.3, 0.4) == pytest.approx(0.3 * 1.4)
    pad = Padding()
    total = sum(pad.add(0.3, 0.4) for _ in range(5))
    assert total == pytest.approx(1.5 * 1.1 + 0.3 * 0.3 * 5 ** 0.5)
    assert total < 1.5 * 1.4


@dataclass(frozen=True)
class NoisyTimes(LinearTimes):
    margin: float = 0.4  # learnt, as mesh.perf.times.AdaptiveTimes has it on a busy machine


def test_a_burst_behind_a_learnt_margin_is_not_predicted_at_its_tail_on_every_prefill():
    """Four 100-token prompts wait (0.3 s each, one per iteration); a fifth arrives with
    them. Each prefill at its 95th percentile (x1.4) puts its first token at 2.1 s, past its
    2 s TTFT SLO; the run of five, 10% each plus 30% in quadrature, at 1.85 s."""
    c = ComputeSubsystem()
    c.add_instance("i", NoisyTimes(prefill_per_token=0.003, decode_base=0.0), SLO(), 100)
    for k in range(4):
        c.add_request("i", f"r{k}", 100, 0.0)
    v = shadow_validate(c, "i", "new", 100, start_s=0.0, now=0.0)
    assert v.ok, v.reason()
    assert v.candidate_first_token_s == pytest.approx(1.5 * 1.1 + 0.3 * 0.3 * 5 ** 0.5)
    c.add_request("i", "r4", 100, 0.0)
    c.add_request("i", "r5", 100, 0.0)
    late = shadow_validate(c, "i", "new", 100, start_s=0.0, now=0.0)  # seventh: 2.1 x 1.1 > 2 s
    assert late.failed(FailureCase.OWN_PREFILL_LATE) is not None


def test_a_live_instance_is_predicted_from_the_layers_it_holds():
    """LLM-Mesh 5.3 with BlitzScale 5.2: a live instance holding 4 of 40 layers, the rest due
    at 3 s, cannot prefill a 1000-token prompt before its 2 s TTFT deadline; the same
    instance with every layer admits it (1.1 s). Once the layers are in, full speed again."""
    from mesh.policy.live_scaling import LayerArrivals

    times = LinearTimes(prefill_per_token=0.001)
    full, live = ComputeSubsystem(), ComputeSubsystem()
    full.add_instance("i", times, SLO(), 4096)
    live.add_instance("i", times, SLO(), 4096, ready_at=0.0, loaded=False)
    live.set_loaded("i", 0.0, LayerArrivals(40, ((0.0, 4), (3.0, 40))))
    assert shadow_validate(full, "i", "r", 1000, 0.0, 0.0).ok
    v = shadow_validate(live, "i", "r", 1000, 0.0, 0.0)
    f = v.failed(FailureCase.OWN_PREFILL_LATE)
    # layers 0-3 by 0.11 s, layers 4-39 from 3 s: 36 x 1.1 s / 40 = 0.99 s more
    assert f is not None and v.candidate_first_token_s == pytest.approx(3.0 + 1.1 * 36 / 40)
    later = shadow_validate(live, "i", "r", 1000, start_s=3.0, now=3.0)
    assert later.ok and later.candidate_first_token_s == pytest.approx(3.0 + 1.1)
