"""The reservation station (LLM-Mesh 6.3), by example and by property (hypothesis)."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mesh.policy.reservation import OpKind, ReservationStation

GB = 10**9


def test_scale_up_waits_for_scale_down_then_runs():
    rs = ReservationStation(100 * GB)
    a = rs.issue("a", 60 * GB)
    rs.complete(a.op.op_id)
    down = rs.issue("a", 20 * GB)  # budget drops to 20 at once, optimistically
    assert down.op.kind is OpKind.SCALE_DOWN and down.started == (down.op,)
    assert rs.budget == 20 * GB and rs.pessimistic == 60 * GB
    up = rs.issue("b", 70 * GB)  # admitted by the budget (90 <= 100) ...
    assert up.accepted and up.started == ()  # ... but 60 + 70 > 100 while a shrinks
    assert [op.holder for op in rs.waiting()] == ["b"]
    started = rs.complete(down.op.op_id)
    assert started == (up.op,) and rs.pessimistic == 90 * GB


def test_scale_up_refused_when_budget_is_full():
    rs = ReservationStation(100 * GB)
    rs.issue("a", 80 * GB)
    refused = rs.issue("b", 30 * GB)
    assert not refused.accepted and refused.shortfall_bytes == 10 * GB
    assert not rs.can_resize("b", 30 * GB) and rs.can_resize("b", 20 * GB)
    assert rs.budget == 80 * GB


def test_operations_on_one_holder_run_in_order():
    rs = ReservationStation(100 * GB)
    load = rs.issue("a", 10 * GB)
    grow = rs.issue("a", 30 * GB)
    assert grow.started == () and load.op.kind is OpKind.LOAD
    assert rs.complete(load.op.op_id) == (grow.op,)
    unload = rs.issue("a", 0)
    assert unload.op.kind is OpKind.UNLOAD and unload.started == ()
    rs.complete(grow.op.op_id)
    rs.complete(unload.op.op_id)
    assert rs.budget == 0 and rs.pessimistic == 0 and rs.size("a") == 0


class StationMachine(RuleBasedStateMachine):
    """Random loads, unloads, scale-ups and scale-downs, completed in random order."""

    CAP = 100

    def __init__(self) -> None:
        super().__init__()
        self.rs = ReservationStation(self.CAP)
        self.physical: dict[str, int] = {}  # what each holder really holds at most now

    def _track(self, ops) -> None:
        for op in ops:  # a started op may use up to max(old, new) until it completes
            self.physical[op.holder] = max(op.old_bytes, op.new_bytes)

    @rule(holder=st.sampled_from("abcde"), size=st.integers(0, 70))
    def resize(self, holder: str, size: int) -> None:
        before = self.rs.budget
        issued = self.rs.issue(holder, size)
        if issued.accepted:
            self._track(issued.started)
        else:
            assert before + size - self.rs.size(holder) > self.CAP  # refused only if it could not fit
            assert self.rs.budget == before

    @precondition(lambda self: self.rs.running())
    @rule(pick=st.integers(0, 10**6))
    def complete(self, pick: int) -> None:
        running = self.rs.running()
        op = running[pick % len(running)]
        started = self.rs.complete(op.op_id)
        self.physical[op.holder] = op.new_bytes
        self._track(started)

    @invariant()
    def physical_never_exceeds_capacity(self) -> None:
        assert sum(self.physical.values()) <= self.CAP
        assert self.rs.pessimistic <= self.CAP

    @invariant()
    def budget_never_exceeds_capacity(self) -> None:
        assert self.rs.budget <= self.CAP

    @invariant()
    def nothing_waits_while_it_could_start(self) -> None:
        busy = {op.holder for op in self.rs.running()}
        seen: set[str] = set()
        for op in self.rs.waiting():
            first_of_holder = op.holder not in busy and op.holder not in seen
            seen.add(op.holder)
            if first_of_holder:
                assert op.delta > 0 and self.rs.pessimistic + op.delta > self.CAP, op


StationMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestReservationStation = StationMachine.TestCase
