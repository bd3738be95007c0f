"""Compute subsystem: headroom (Eq. 1) and token-level selection (LLM-Mesh 5.1)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from doubles import LinearTimes
from mesh.policy.batching import IterationKind
from mesh.policy.compute import ComputeSubsystem
from mesh.policy.slo import SLO

SLO_PAPER = SLO()  # TTFT max(2, L/512) s, TPOT 0.25 s


def prefill_all(c: ComputeSubsystem, instance_id: str, now: float) -> None:
    it = c.next_iteration(now)
    assert it.instance_id == instance_id and it.kind is IterationKind.PREFILL
    c.complete_iteration(instance_id, it.kind, list(c.instances[instance_id].pending))


def test_figure5_headroom_update():
    """Figure 5: headroom 1.9 s, one 0.05 s decode iteration, TPOT 0.25 s -> 2.1 s."""
    c = ComputeSubsystem()
    c.add_instance("i2", LinearTimes(decode_base=0.05), SLO_PAPER, 4096)
    c.add_request("i2", "r", prompt_len=16, start_s=0.0)  # first token due at 2.0
    prefill_all(c, "i2", now=0.0)  # O = 1: next token due at 2.25
    assert c.headroom("r", now=0.35) == pytest.approx(1.9)
    it = c.next_iteration(0.35)
    assert it.kind is IterationKind.DECODE and it.predicted_s == pytest.approx(0.05)
    c.complete_iteration("i2", it.kind, ["r"])
    assert c.headroom("r", now=0.35 + 0.05) == pytest.approx(1.9 - 0.05 + 0.25)


def test_picks_instance_with_smallest_headroom():
    c = ComputeSubsystem()
    for name in ("a", "b", "c"):
        c.add_instance(name, LinearTimes(), SLO_PAPER, 4096)
    c.add_request("a", "ra", 16, start_s=0.0)  # due 2.0
    c.add_request("b", "rb", 16, start_s=-0.5)  # due 1.5: most urgent
    c.add_request("c", "rc", 16, start_s=0.2)
    assert c.next_iteration(0.0).instance_id == "b"
    prefill_all(c, "b", 0.0)  # rb now due at 1.75
    assert c.next_iteration(0.0).instance_id == "b"
    c.complete_iteration("b", IterationKind.DECODE, ["rb"])  # due 2.0, tie with ra: id order
    assert c.next_iteration(0.0).instance_id == "a"


def test_prefill_before_decode_and_token_budget():
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(prefill_per_token=0.001), SLO_PAPER, prefill_token_budget=1000)
    c.add_request("i", "r1", 600, 0.0)
    prefill_all(c, "i", 0.0)
    c.add_request("i", "r2", 600, 0.1)
    c.add_request("i", "r3", 300, 0.1)
    it = c.next_iteration(0.1)
    # r2 and r3 fit the 1000-token budget together: one prefill iteration, arrival order
    assert (it.kind, it.batch_size, it.tokens) == (IterationKind.PREFILL, 2, 900)
    c.add_request("i", "r4", 200, 0.1)
    assert c.next_iteration(0.1).tokens == 900  # r4 would exceed 1000: next prefill
    c.complete_iteration("i", IterationKind.PREFILL, ["r2", "r3"])
    it = c.next_iteration(0.2)
    assert (it.kind, it.batch_size) == (IterationKind.PREFILL, 1)
    c.complete_iteration("i", IterationKind.PREFILL, ["r4"])
    it = c.next_iteration(0.3)
    assert it.kind is IterationKind.DECODE and it.batch_size == 4
    assert it.tokens == round((601 + 601 + 301 + 201) / 4)


def test_finish_and_remove_keep_context_sum():
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(), SLO_PAPER, 4096)
    for k in range(3):
        c.add_request("i", f"r{k}", 10 * (k + 1), 0.0)
    prefill_all(c, "i", 0.0)
    c.complete_iteration("i", IterationKind.DECODE, ["r0", "r1", "r2"], finished=["r1"])
    state = c.instances["i"]
    assert state.context_sum == (10 + 2) + (30 + 2)
    assert c.tokens_out("r0") == 2
    c.remove_request("r2")
    assert state.context_sum == 12
    c.remove_request("r0")
    assert c.next_iteration(0.0) is None and state.context_sum == 0


def test_request_without_token_keeps_its_deadline():
    """An engine that skips a request in a decode round (preemption) leaves its deadline."""
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(), SLO_PAPER, 4096)
    c.add_request("i", "a", 10, 0.0)
    c.add_request("i", "b", 10, 0.0)
    prefill_all(c, "i", 0.0)
    before = c.headroom("b", 1.0)
    c.complete_iteration("i", IterationKind.DECODE, ["a"])
    assert c.headroom("b", 1.0) == pytest.approx(before)
    assert c.headroom("a", 1.0) == pytest.approx(before + 0.25)
    assert c.tokens_out("b") == 1 and c.tokens_out("a") == 2


def test_loading_instance_is_not_scheduled():
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(), SLO_PAPER, 4096, ready_at=5.0, loaded=False)
    c.add_request("i", "r", 10, 0.0)
    assert c.next_iteration(0.0) is None
    c.set_loaded("i", 3.0)
    assert c.next_iteration(3.0).instance_id == "i"
    with pytest.raises(ValueError, match="still has 1 requests"):
        c.remove_instance("i")


def test_headroom_of_waiting_request_is_ttft_deadline():
    c = ComputeSubsystem()
    c.add_instance("i", LinearTimes(), SLO_PAPER, 8192)
    c.add_request("i", "long", 4096, 1.0)  # TTFT SLO = 4096/512 = 8 s
    assert c.headroom("long", 1.0) == pytest.approx(8.0)


# -- property: the choice is always the instance holding the globally most urgent request --
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 3000), st.floats(-5.0, 5.0)),
        st.tuples(st.just("step"), st.integers(0, 3), st.just(0), st.just(0.0)),
        st.tuples(st.just("finish"), st.integers(0, 3), st.integers(0, 50), st.just(0.0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_choice_matches_brute_force_headroom(sequence):
    c = ComputeSubsystem()
    tpots = [0.25, 0.1, 0.5, 0.05]
    for k, tpot in enumerate(tpots):
        c.add_instance(f"i{k}", LinearTimes(), SLO(tpot_s=tpot), 4096)
    produced: dict[str, int] = {}  # what we expect tokens_out to be
    for n, (op, k, x, t) in enumerate(sequence):
        iid = f"i{k}"
        if op == "add":
            c.add_request(iid, f"r{n}", x, t)
            produced[f"r{n}"] = 0
        elif op == "step":
            it = c.next_iteration(0.0)
            if it is None:
                continue
            inst = c.instances[it.instance_id]
            batch = inst.prefill_batch() if it.kind is IterationKind.PREFILL else inst.running
            served = [r.request_id for r in batch]
            c.complete_iteration(it.instance_id, it.kind, served)
            for rid in served:
                produced[rid] += 1
        elif c.requests:
            rid = sorted(c.requests)[x % len(c.requests)]
            c.remove_request(rid)
            del produced[rid]
        # brute force: Eq. 1 for every request, straight from its definition
        def headroom(rid: str) -> float:
            r = c.requests[rid]
            slo = c.instances[r.instance_id].slo
            return r.start_s + slo.ttft_s(r.prompt_len) + slo.tpot_s * produced[rid] - 0.0

        for rid in c.requests:
            assert c.tokens_out(rid) == produced[rid]
            assert c.headroom(rid, 0.0) == pytest.approx(headroom(rid))
        it = c.next_iteration(0.0)
        if not c.requests:
            assert it is None
        else:
            best = min(headroom(rid) for rid in c.requests)
            chosen = [rid for rid in c.requests if c.requests[rid].instance_id == it.instance_id]
            assert min(headroom(rid) for rid in chosen) == pytest.approx(best)
            state = c.instances[it.instance_id]
            assert state.context_sum == sum(r.prompt_len + produced[r.request_id] for r in state.running)
