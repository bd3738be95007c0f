"""Multicast plans (BlitzScale 5.1, lambdaScale 4.2): validity, round counts against theory,
the cost model (mesh.perf.load_times); hypothesis property tests over random N, b and sources."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.perf.load_times import BLOCK_TIME, CostModel, estimate, schedule
from mesh.policy.multicast import (
    InvalidPlan,
    Plan,
    Transfer,
    binomial,
    chain,
    chains,
    k_way_orders,
    lower_bound_rounds,
    make_plan,
    naive,
    repair,
    validate,
)


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# --- round counts against theory ---------------------------------------------------------

@pytest.mark.parametrize("n,b", [(1, 1), (1, 7), (3, 1), (4, 10), (8, 64), (13, 5)])
def test_chain_takes_b_plus_n_minus_1_rounds(n, b):
    p = chain(["s"], names("t", n), b)
    validate(p)
    assert p.rounds == b + n - 1
    # target p of the chain finishes after b + p - 1 rounds
    assert sorted(p.completion_rounds().values()) == [b + i for i in range(n)]


@pytest.mark.parametrize("n,b", [(1, 4), (2, 3), (8, 64)])
def test_naive_takes_n_times_b_rounds(n, b):
    p = naive(["s"], names("t", n), b)
    validate(p)
    assert p.rounds == n * b


@pytest.mark.parametrize("d", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("b", [1, 2, 5, 16, 63])
def test_binomial_pipeline_on_a_hypercube(d, b):
    """lambdaScale 4.2: "1 -> N takes b + ceil(log N) - 1 steps", N counting every node of
    the hypercube, the source included: 2^d nodes are 2^d - 1 receivers."""
    p = binomial(["s"], names("t", 2**d - 1), b)
    validate(p)
    assert p.rounds == b + d - 1 == lower_bound_rounds(2**d, b)


@pytest.mark.parametrize("d", [1, 2, 3, 4])
@pytest.mark.parametrize("b", [1, 3, 63])
def test_binomial_pipeline_to_a_power_of_two_receivers(d, b):
    """With N = 2^d receivers there are 2^d + 1 nodes, so the bound is b + d, one round more
    than the paper's formula read with N receivers: no plan can do b + d - 1 (the last block
    leaves the source in round b - 1 at the earliest; its holders at most double per round). A relay feeding a 2^d
    hypercube reaches b + d."""
    p = binomial(["s"], names("t", 2**d), b)
    validate(p)
    assert p.rounds == b + d == lower_bound_rounds(2**d + 1, b)


def test_binomial_beats_chain_and_naive_for_eight_receivers():
    b = 63
    rounds = {name: make_plan(name, ["s"], names("t", 8), b).rounds for name in ("naive", "chain", "binomial")}
    assert rounds == {"naive": 8 * b, "chain": b + 7, "binomial": b + 3}


def test_several_sources_make_several_chains():
    bw = {"s0": 2.0, "s1": 1.0, "a": 1.0, "b": 3.0, "c": 2.0, "d": 0.5}
    assert chains(["s1", "s0"], ["a", "b", "c", "d"], bw) == [["s0", "b", "a"], ["s1", "c", "d"]]
    p = chain(["s0", "s1"], ["a", "b", "c", "d"], 10, bw)
    validate(p)
    assert p.rounds == 10 + 2 - 1


def test_chain_orders_targets_by_decreasing_bandwidth():
    """BlitzScale Figure 13b: S -> T2 -> T1 when T2's link is twice as fast: T2 is ready in
    half the time, T1 no later."""
    bw = {"s": 2.0, "t1": 1.0, "t2": 2.0}
    p = chain(["s"], ["t1", "t2"], 8, bw)
    assert chains(["s"], ["t1", "t2"], bw) == [["s", "t2", "t1"]]
    sched = schedule(p, CostModel(1, 1.0, node_bandwidth=bw))
    slow_first = schedule(Plan("x", 8, p.holdings, p.targets, tuple(
        Transfer(t.round, {"t2": "t1", "t1": "t2"}.get(t.sender, t.sender), {"t2": "t1", "t1": "t2"}[t.receiver],
                 t.block)
        for t in p.transfers)), CostModel(1, 1.0, node_bandwidth=bw))
    assert sched.completion_s["t2"] == 4.0 < slow_first.completion_s["t2"]
    assert sched.total_s <= slow_first.total_s


def test_k_way_order_is_algorithm_1():
    """Figure 5: 4 blocks, k = 2: sub-group 1 sends blocks 1-2 then 3-4, sub-group 2 the
    circular shift 3-4 then 1-2 (0-based here)."""
    assert k_way_orders(4, 2) == [[0, 1, 2, 3], [2, 3, 0, 1]]
    assert k_way_orders(7, 3) == [[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 0, 1, 2], [6, 0, 1, 2, 3, 4, 5]]
    assert k_way_orders(5, 1) == [[0, 1, 2, 3, 4]]


def test_k_way_sub_groups_hold_a_whole_model_together_early():
    """2 -> 8 as in Figure 5 (2 sources, 6 receivers, 2 sub-groups): after the first chunk's
    rounds the two sub-groups together hold every block, long before any node does."""
    b = 16
    p = binomial(["s0", "s1"], names("t", 6), b)
    validate(p)
    assert p.rounds == b + 2 - 1  # each sub-group: 1 source + 3 receivers = 4 nodes, d = 2
    held: dict[str, set[int]] = {t: set() for t in p.targets}
    groups = [p.targets[0::2], p.targets[1::2]]
    for r, transfers in enumerate(p.by_round()):
        for t in transfers:
            held[t.receiver].add(t.block)
        if all(set().union(*(held[n] for n in g)) >= set(range(b // 2 * i, b // 2 * (i + 1))) for i,
               g in enumerate(groups)):
            break
    assert r + 1 <= b // 2 + 2
    assert all(len(h) < b for h in held.values())


# --- validation ----------------------------------------------------------------------------

def _plan(transfers, blocks=2, targets=("a", "b")):
    holdings = {"s": frozenset(range(blocks)), **{t: frozenset() for t in targets}}
    return Plan("test", blocks, holdings, tuple(targets), tuple(Transfer(*t) for t in transfers))


def test_validate_accepts_a_hand_written_plan():
    validate(_plan([(0, "s", "a", 0), (1, "s", "a", 1), (1, "a", "b", 0), (2, "a", "b", 1)]))


@pytest.mark.parametrize("transfers,message", [
    ([(0, "a", "b", 0)], "does not hold the block yet"),
    ([(0, "s", "a", 0), (0, "a", "b", 0)], "does not hold the block yet"),  # same round: not yet
    ([(0, "s", "a", 0), (0, "s", "b", 1)], "sends twice in one round"),
    ([(0, "s", "a", 0), (1, "s", "a", 1), (1, "a", "b", 0), (1, "s", "b", 1)], "sends twice"),
    ([(0, "s", "a", 0), (1, "s", "b", 0), (1, "a", "b", 1)], "does not hold"),
    ([(0, "s", "a", 0), (1, "a", "b", 0), (1, "s", "b", 1)], "receives twice in one round"),
    ([(0, "s", "a", 0), (1, "s", "a", 0)], "already holds"),
    ([(0, "s", "a", 0), (1, "s", "a", 1)], "target 'b' ends without block 0"),
    ([(0, "s", "x", 0)], "unknown node"),
    ([(0, "s", "a", 5)], "no such block"),
    ([(0, "s", "s", 0)], "sends to itself"),
])
def test_validate_names_the_broken_rule(transfers, message):
    with pytest.raises(InvalidPlan, match=message):
        validate(_plan(transfers))


@pytest.mark.parametrize("call,message", [
    (lambda: chain([], ["a"], 3), "at least one source"),
    (lambda: chain(["s"], ["a"], 0), "at least one block"),
    (lambda: naive(["s"], ["a", "s"], 3), "both a source and a target"),
    (lambda: binomial(["s"], ["a", "a"], 3), "distinct"),
    (lambda: make_plan("tree", ["s"], ["a"], 3), "unknown plan 'tree'"),
    (lambda: chain(["s"], ["a"], 3, {"s": 1.0}), "no bandwidth given for node 'a'"),
    (lambda: chain(["s"], ["a"], 3, {"s": 1.0, "a": 0}), "must be > 0"),
    (lambda: k_way_orders(4, 0), "k must be >= 1"),
])
def test_bad_input_is_refused_clearly(call, message):
    with pytest.raises(InvalidPlan, match=message):
        call()


def test_plan_round_trips_through_json_form():
    p = binomial(["s"], names("t", 5), 7)
    assert Plan.from_dict(p.to_dict()) == p


# --- repair --------------------------------------------------------------------------------

def test_repair_completes_from_partial_holdings():
    p = repair({"s": range(10), "a": range(6), "c": [8, 9]}, ["a", "b", "c"], 10)
    validate(p)
    assert p.holdings["b"] == frozenset() and set(p.targets) == {"a", "b", "c"}
    # a target can also forward what it already holds
    assert any(t.sender in ("a", "c") for t in p.transfers)


def test_repair_refuses_when_a_block_has_no_holder():
    with pytest.raises(InvalidPlan, match="block 3 is held by no live node"):
        repair({"a": [0, 1, 2], "b": [4]}, ["a", "b"], 5)


# --- cost model ----------------------------------------------------------------------------

def test_self_timed_schedule_equals_rounds_with_equal_links():
    for name in ("naive", "chain", "binomial"):
        p = make_plan(name, ["s"], names("t", 6), 12)
        s = schedule(p, BLOCK_TIME)
        assert s.total_s == p.rounds
        assert s.completion_s == {t: float(r) for t, r in p.completion_rounds().items()}


def test_cost_model_bytes_bandwidth_latency():
    cost = CostModel(block_bytes=8 << 20, bandwidth=1e9, latency_s=1e-3)
    p = chain(["s"], names("t", 3), 10)
    s = schedule(p, cost)
    assert s.total_s == pytest.approx((10 + 3 - 1) * ((8 << 20) / 1e9 + 1e-3))
    assert cost.block_s == pytest.approx((8 << 20) / 1e9 + 1e-3)
    e = estimate("chain", 80 << 20, 3, cost)  # same model, built from its size
    assert e.total_s == pytest.approx(s.total_s)
    assert estimate("naive", 100, 0, cost).total_s == 0.0
    with pytest.raises(ValueError):
        CostModel(block_bytes=0, bandwidth=1.0)


def test_schedule_uses_real_block_sizes():
    p = naive(["s"], ["a"], 3)
    s = schedule(p, CostModel(1, 2.0), block_sizes=[4, 4, 2])
    assert s.total_s == pytest.approx(5.0)


# --- properties ----------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(["naive", "chain", "binomial"]),
    receivers=st.integers(1, 20),
    blocks=st.integers(1, 40),
    sources=st.integers(1, 4),
    bws=st.lists(st.sampled_from([1.0, 2.0, 5.0]), min_size=24, max_size=24),
)
def test_every_plan_is_valid_and_meets_its_round_count(name, receivers, blocks, sources, bws):
    srcs, tgts = names("s", sources), names("t", receivers)
    bandwidth = dict(zip(srcs + tgts, bws))
    p = make_plan(name, srcs, tgts, blocks, bandwidth)
    validate(p)
    k = min(sources, receivers)
    longest = math.ceil(receivers / k)  # the largest chain or sub-group
    if name == "naive":
        assert p.rounds == longest * blocks
    elif name == "chain":
        assert p.rounds == blocks + longest - 1
    else:
        lb = lower_bound_rounds(longest + 1, blocks)
        assert lb <= p.rounds <= lb + max(0, math.ceil(math.log2(longest + 1)) - 1)
    assert schedule(p).total_s == p.rounds


@settings(max_examples=100, deadline=None)
@given(
    blocks=st.integers(1, 30),
    receivers=st.integers(1, 8),
    data=st.data(),
)
def test_repair_is_valid_from_any_reachable_state(blocks, receivers, data):
    """Run a binomial plan part way, drop a random target, repair the rest."""
    tgts = names("t", receivers)
    p = binomial(["s"], tgts, blocks)
    cut = data.draw(st.integers(0, p.rounds))
    held = {n: set(h) for n, h in p.holdings.items()}
    for t in p.transfers:
        if t.round < cut:
            held[t.receiver].add(t.block)
    dead = data.draw(st.sampled_from(tgts))
    live = [t for t in tgts if t != dead]
    r = repair({n: h for n, h in held.items() if n != dead}, live, blocks)
    validate(r)
    assert r.rounds <= (blocks * len(live) if live else 0)
