"""Pure placement rules of the cluster dispatcher (mesh.policy.dispatch_rules) and its waiting
queue (mesh.policy.queueing)."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.perf.load_times import ColdStart
from mesh.policy.dispatch_rules import (
    InstanceView,
    NodeView,
    candidate_order,
    concurrency_target,
    keep_alive_expired,
    new_instance_order,
    queue_expiry_s,
    sllm_pick,
    victim_order,
    wait_expiry_s,
)
from mesh.policy.queueing import WaitingQueue


def iv(iid: str, node: str, kind: str, batch: int, seq: int = 0, model: str = "m") -> InstanceView:
    return InstanceView(iid, node, kind, model, batch, seq)


def test_candidates_cpu_first_then_highest_batch():
    views = [iv("g5", "g", "gpu", 5, 0), iv("c1", "c1", "cpu", 1, 1), iv("c3", "c2", "cpu", 3, 2)]
    assert [v.instance_id for v in candidate_order(views)] == ["c3", "c1", "g5"]


def test_candidates_without_defrag_spread_lowest_batch_first():
    views = [iv("c3", "c2", "cpu", 3, 0), iv("c1", "c1", "cpu", 1, 1), iv("g5", "g", "gpu", 5, 2)]
    assert [v.instance_id for v in candidate_order(views, defrag=False)] == ["c1", "c3", "g5"]


def test_victims_only_lower_batch_neighbours_lowest_first():
    target = iv("x", "n", "cpu", 3)
    neighbours = [target, iv("a", "n", "cpu", 2, 1), iv("b", "n", "cpu", 1, 2), iv("c", "n", "cpu", 3, 3),
                  iv("d", "other", "cpu", 0, 4)]
    assert [v.instance_id for v in victim_order(target, neighbours)] == ["b", "a"]
    assert victim_order(iv("x", "n", "cpu", 0), neighbours) == []


def test_new_instance_order_packs_used_nodes_cpu_first():
    nodes = [NodeView("g0", "gpu", 2, 50, 100, 0), NodeView("c0", "cpu", 0, 0, 100, 1),
             NodeView("c1", "cpu", 1, 10, 100, 2), NodeView("c2", "cpu", 2, 60, 100, 3)]
    assert [n.node_id for n in new_instance_order(nodes, ("cpu", "gpu"))] == ["c2", "c1", "c0", "g0"]
    assert [n.node_id for n in new_instance_order(nodes, ("gpu",))] == ["g0"]
    assert [n.node_id for n in new_instance_order(nodes, ("cpu", "gpu"), exclusive=True)] == ["c0"]
    assert [n.node_id for n in new_instance_order(nodes, ("cpu",), exclude={"c2"})] == ["c1", "c0"]


def test_exclusive_order_is_first_fit_over_free_nodes_cpu_first():
    """ServerlessLLM's rule: the first node of the kinds with no instance, CPU first."""
    nodes = [NodeView("c0", "cpu", 1, 1, 9, 0), NodeView("g0", "gpu", 0, 0, 9, 1), NodeView("c1", "cpu", 0, 0, 9, 2)]
    assert [n.node_id for n in new_instance_order(nodes, ("cpu", "gpu"), exclusive=True)] == ["c1", "g0"]
    assert [n.node_id for n in new_instance_order(nodes, ("gpu",), exclusive=True)] == ["g0"]
    assert new_instance_order(nodes[:1], ("cpu",), exclusive=True) == []


def test_sllm_concurrency_targets_and_pick():
    assert [concurrency_target(m, "cpu") for m in ("llama-3.2-3b", "llama-2-7b", "llama-2-13b")] == [59, 15, 6]
    assert [concurrency_target(m, "gpu") for m in ("llama-3.2-3b", "llama-2-7b", "llama-2-13b")] == [160, 32, 16]
    with pytest.raises(ValueError, match="llama-3.2-3b, llama-2-7b, llama-2-13b"):
        concurrency_target("gpt-9", "gpu")
    with pytest.raises(ValueError, match="valid: cpu, gpu"):
        concurrency_target("llama-2-7b", "tpu")
    targets = {"cpu": 15, "gpu": 32}
    full_cpu, gpu = iv("c", "c", "cpu", 15, 0), iv("g", "g", "gpu", 31, 1)
    assert sllm_pick([gpu, full_cpu], targets).instance_id == "g"
    assert sllm_pick([full_cpu, iv("g", "g", "gpu", 32, 1)], targets) is None  # scale out


def test_keep_alive():
    assert not keep_alive_expired(10.0, 10.9, 1.0)
    assert keep_alive_expired(10.0, 11.0, 1.0)


def test_cold_start_from_host_memory():
    cs = ColdStart()  # PCIe 4.0 x16 ~25 GB/s to the GPU; CPU pass at 50 GB/s
    assert cs.load_s(13_476_831_232, "gpu") == pytest.approx(0.539, abs=1e-3)
    assert cs.load_s(13_476_831_232, "cpu") == pytest.approx(0.270, abs=1e-3)
    assert ColdStart(fixed_s=1.0).load_s(25 * 10**9, "gpu") == pytest.approx(2.0)
    with pytest.raises(ValueError):
        ColdStart(pcie_bytes_per_s=0)


def test_queue_expiry_rules():
    assert queue_expiry_s(deadline_s=12.0, fastest_first_token_s=0.5) == 11.5
    # no timeout: every policy turns a request away once it cannot meet its SLO
    assert wait_expiry_s(now=3.0, slo_expiry_s=11.5, timeout_s=None, validates=False) == (11.5, "slo")
    # a client timeout: the baselines keep it waiting; Mesh knows sooner
    assert wait_expiry_s(now=3.0, slo_expiry_s=11.5, timeout_s=30.0, validates=False) == (33.0, "timeout")
    assert wait_expiry_s(now=3.0, slo_expiry_s=11.5, timeout_s=30.0, validates=True) == (11.5, "slo")
    assert wait_expiry_s(now=3.0, slo_expiry_s=11.5, timeout_s=5.0, validates=True) == (8.0, "timeout")
    with pytest.raises(ValueError):
        wait_expiry_s(0.0, 1.0, -1.0, False)
    # admission (issue 33): queue keeps a hopeless request up to the bound, late without one
    assert wait_expiry_s(now=3.0, slo_expiry_s=11.5, timeout_s=30.0, validates=True, admission="queue") == (33.0,
                                                                                                            "timeout")
    assert wait_expiry_s(now=3.0, slo_expiry_s=11.5, timeout_s=None, validates=True, admission="queue") == (math.inf,
                                                                                                            "timeout")
    assert wait_expiry_s(now=3.0, slo_expiry_s=11.5, timeout_s=30.0, validates=True, admission="late") == (math.inf,
                                                                                                           "timeout")
    assert wait_expiry_s(now=3.0, slo_expiry_s=11.5, timeout_s=30.0, validates=True, admission="reject") == (11.5,
                                                                                                             "slo")
    with pytest.raises(ValueError):
        wait_expiry_s(0.0, 1.0, 1.0, True, admission="wait")


def test_waiting_queue_fifo_capacity_and_expiry():
    q = WaitingQueue(capacity=2)
    assert q.push("a", "m1", 0.0, 5.0) and q.push("b", "m2", 0.0, 3.0)
    assert not q.push("c", "m1", 0.0, 9.0)  # full
    assert [e.request_id for e in q.in_order()] == ["a", "b"] and q.has_model("m1")
    assert q.next_expiry() == 3.0
    assert [e.request_id for e in q.pop_expired(4.0)] == ["b"]
    q.remove("a")
    assert len(q) == 0 and q.next_expiry() is None and not q.has_model("m1") and q.peak == 2
    with pytest.raises(ValueError):
        WaitingQueue(capacity=0)


def test_a_full_queue_gives_a_place_to_a_tenant_below_its_share():
    q = WaitingQueue(capacity=4)
    for i in range(4):  # a tenant alone may fill the queue
        assert q.push(f"a{i}", "ma", 0.0, 10.0, tenant="a")
    taken = q.make_room("b")
    assert taken is not None and taken.request_id == "a3"  # the largest holder's newest
    assert q.push("b0", "mb", 0.0, 10.0, tenant="b")
    assert q.make_room("b") is not None and q.push("b1", "mb", 0.0, 10.0, tenant="b")
    assert q.make_room("b") is None  # 2 and 2: b has its share; its next request is the one refused
    assert not q.push("b2", "mb", 0.0, 10.0, tenant="b")
    assert [e.request_id for e in q.in_order()] == ["a0", "a1", "b0", "b1"]


@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), max_size=60), st.integers(1, 8))
def test_fair_share_never_refuses_a_tenant_below_an_equal_split(ops, capacity):
    """Whatever the arrivals and departures: the queue never holds more than its capacity, a
    tenant alone is never refused below capacity, and a refused tenant held at least as many
    entries as the largest holder minus one (no room is taken from one with fewer)."""
    q = WaitingQueue(capacity=capacity)
    held: dict[str, list[str]] = {"a": [], "b": [], "c": []}
    for n, (tenant, leave) in enumerate(ops):
        if leave and held[tenant]:
            q.remove(held[tenant].pop(0))
            continue
        rid = f"{tenant}{n}"
        taken = q.make_room(tenant)
        if taken is not None:
            held[taken.tenant].remove(taken.request_id)
        if q.push(rid, "m" + tenant, 0.0, 1.0, tenant=tenant):
            held[tenant].append(rid)
        else:
            assert len(q) == capacity
            assert max(len(v) for v in held.values()) <= len(held[tenant]) + 1
        assert len(q) <= capacity and sum(map(len, held.values())) == len(q)
        assert all(q.held(t) == len(v) for t, v in held.items())


@given(st.floats(0.001, 0.1), st.floats(0.0, 0.01), st.floats(0.01, 1.0))
def test_tailored_concurrency_target_is_the_largest_batch_within_the_tpot(base, per_seq, tpot):
    from mesh.policy.dispatch_rules import tailored_concurrency_target

    def decode(b: int) -> float:
        return base + per_seq * b

    b = tailored_concurrency_target(decode, tpot)
    assert 1 <= b <= 512
    assert b == 1 or decode(b) <= tpot
    assert b == 512 or decode(b + 1) > tpot or b == 1 and decode(1) > tpot


def test_admission_a_models_own_then_its_tenants_then_the_clusters():
    from mesh.control.fleet import ClusterConfig, ClusterError, Fleet

    cluster = Fleet(ClusterConfig(cpu_nodes=1, gpu_nodes=0, admission="reject"))
    assert cluster.admission("m", "t") == "reject"
    cluster.set_tenant_admission("t", "queue")
    assert cluster.admission("m", "t") == "queue" and cluster.admission("m", "other") == "reject"
    cluster.set_admission("m", "late")
    assert cluster.admission("m", "t") == "late"
    cluster.set_admission("m", None)
    cluster.set_tenant_admission("t", None)
    assert cluster.admission("m", "t") == "reject"
    with pytest.raises(ClusterError):
        cluster.set_tenant_admission("t", "wait")


def test_a_lost_request_waits_on_while_the_cluster_recovers_for_it():
    from mesh.policy.dispatch_rules import LOST_WAIT_LIMIT, lost_wait_until

    lost, timeout = 100.0, 30.0
    # a load under way with 12 s left: looked at again when it should end; overdue: each second
    assert lost_wait_until(130.0, lost, timeout, 12.0, 130.0) == 142.0
    assert lost_wait_until(150.0, lost, timeout, 0.0, 150.0) == 151.0
    # the recovery ended (last seen at 151 s): a whole timeout from then to be placed, then it fails
    assert lost_wait_until(152.0, lost, timeout, None, 151.0) == 181.0
    assert lost_wait_until(181.0, lost, timeout, None, 151.0) is None
    # never recovering: it fails at its timeout, as before
    assert lost_wait_until(130.0, lost, timeout, None, lost) is None
    # never past LOST_WAIT_LIMIT timeouts from the loss, nor without a timeout
    limit = lost + LOST_WAIT_LIMIT * timeout
    assert lost_wait_until(limit - 5.0, lost, timeout, 60.0, limit - 5.0) == limit
    assert lost_wait_until(limit, lost, timeout, 60.0, limit) is None
    assert lost_wait_until(130.0, lost, None, 12.0, 130.0) is None


def test_an_expired_entry_that_waits_on_keeps_its_place():
    q = WaitingQueue()
    for rid, expiry in (("a", 3.0), ("b", 5.0), ("c", 4.0)):
        assert q.push(rid, "m", 0.0, expiry)
    later = {"a": 9.0}  # a waits on until 9 s; c's time is up
    assert [e.request_id for e in q.pop_expired(4.0, lambda e: later.get(e.request_id))] == ["c"]
    assert [e.request_id for e in q.in_order()] == ["a", "b"] and q.next_expiry() == 5.0
    assert [e.request_id for e in q.pop_expired(9.0)] == ["b", "a"]
