"""Cold starts measured, not assumed (issue 23 item 3; issue 24's Retry-After and transfer):
the table of loads per node, model and source; the cluster predicting a node's next load from
what it measured (shared by the replay's LocalNode and the service's AgentNode); the weights
transfer counted where a node holds no copy, and copy holders tried first; Retry-After the
time left of the load under way; a replay taking its cold starts from an exported table."""
from __future__ import annotations

import asyncio
import json

import pytest

from cluster_doubles import GB, WEIGHTS, build, config, request, run_until, spec
from mesh.control.dispatcher import Dispatcher
from mesh.engines.simulated import SimulatedEngine
from mesh.perf.load_times import (
    ANY_MODEL,
    GIB,
    PARKED,
    PARKED_PRIOR_S,
    RESIZE_UP_S_PER_GIB,
    ColdStart,
    ColdStartTable,
    LoadRecord,
    cold_start_times,
)
from mesh.policy.dispatch_rules import NodeView, new_instance_order
from mesh.replay.simulator import simulated_cluster
from mesh.replay.virtual_loop import run_virtual
from mesh.service.errors import overloaded
from mesh.service.request_path import retry_after_s


# -- the pure table ----------------------------------------------------------------------------
def test_a_nodes_next_load_is_the_median_of_its_latest_source():
    t = ColdStartTable()
    assert t.expected_load_s("n0", "m") is None  # never loaded: the caller's prior
    t.record(LoadRecord("n0", "cpu", "m", "gguf", 7.5, 10.0))
    assert t.expected_load_s("n0", "m") == 7.5
    for s in (0.9, 0.4, 0.5):  # prepared since: the next loads read the node's IR
        t.record(LoadRecord("n0", "cpu", "m", "prepared", s, 20.0))
    assert t.expected_load_s("n0", "m") == 0.5  # median of the prepared loads, the gguf one left aside
    assert t.expected_load_s("n1", "m") is None
    assert t.expected_load_s("n1", "m", peers=["n0", "n1"]) == 0.5  # a peer's measure before its own
    assert t.expected_load_s("n1", "other", peers=["n0"]) is None
    with pytest.raises(ValueError):
        t.record(LoadRecord("n0", "cpu", "m", "gguf", -1.0, 0.0))


def test_a_parked_load_predicts_only_a_node_that_has_the_model_parked():
    t = ColdStartTable()
    t.record(LoadRecord("n0", "cpu", "m", "prepared", 3.7, 1.0))
    t.record(LoadRecord("n0", "cpu", "m", PARKED, 0.01, 2.0))  # adopted a parked worker
    assert t.expected_load_s("n0", "m") == 3.7  # the worker may be gone: the node's last real load
    assert t.expected_load_s("n0", "m", parked=True) == 0.01
    assert t.expected_load_s("n1", "m", peers=["n0"], parked=True) == 0.01  # a peer's parked loads
    assert t.expected_load_s("n1", "m", peers=["n0"]) == 3.7
    t.record(LoadRecord("n2", "cpu", "p", PARKED, 0.02, 3.0))  # only parked loads: nothing for an unparked node
    assert t.expected_load_s("n2", "p") is None and t.expected_load_s("n2", "p", parked=True) == 0.02
    # parked ahead of its first load (mesh.node.park_ahead): the parked tier's prior, not a build's
    assert t.expected_load_s("n3", "new", parked=True) == PARKED_PRIOR_S and t.expected_load_s("n3", "new") is None
    assert cold_start_times(t.to_dict()) == {("m", "cpu"): 3.7, (ANY_MODEL, "cpu"): 3.7}  # a replay parks nothing


def test_a_forgotten_node_predicts_from_its_peers_again():
    t = ColdStartTable()
    t.record(LoadRecord("n0", "cpu", "m", "prepared", 9.0, 1.0))
    t.record(LoadRecord("n1", "cpu", "m", "prepared", 2.0, 2.0))
    assert t.expected_load_s("n0", "m", peers=["n1"]) == 9.0
    t.forget_node("n0")
    assert t.node_load_s("n0", "m") is None
    assert t.expected_load_s("n0", "m", peers=["n1"]) == 2.0  # a new node under the same id: its peers'
    assert {r["node"] for r in t.to_dict()["loads"]} == {"n1"}


def test_transfers_and_the_exported_table_for_a_replay():
    t = ColdStartTable()
    assert t.transfer_bytes_per_s() is None
    t.record_transfer(100 * 10**6, 2.0)
    t.record_transfer(100 * 10**6, 1.0)
    t.record_transfer(0, 1.0)  # nothing moved: not a measure
    assert t.transfer_bytes_per_s() == pytest.approx(75e6)
    t.record(LoadRecord("n0", "cpu", "a", "prepared", 0.6, 1.0))
    t.record(LoadRecord("n1", "cpu", "a", "prepared", 1.0, 2.0))
    t.record(LoadRecord("n1", "cpu", "b", "gguf", 7.0, 3.0))
    table = json.loads(json.dumps(t.to_dict()))
    assert {(r["node"], r["model"], r["source"]) for r in table["loads"]} == {
        ("n0", "a", "prepared"), ("n1", "a", "prepared"), ("n1", "b", "gguf")}
    times = cold_start_times(table)
    assert times[("a", "cpu")] == pytest.approx(0.8) and times[("b", "cpu")] == 7.0
    assert times[(ANY_MODEL, "cpu")] == pytest.approx(3.9)
    own_star = {"format": table["format"], "loads": [{"model": ANY_MODEL, "kind": "cpu", "median_s": 5.0}]}
    assert cold_start_times(own_star) == {(ANY_MODEL, "cpu"): 5.0}  # a table's own '*' row stands
    with pytest.raises(ValueError, match="not a cold-start table"):
        cold_start_times({"loads": []})
    cs = ColdStart(measured=times)
    assert cs.load_s(WEIGHTS, "cpu", "a") == pytest.approx(0.8)
    assert cs.load_s(WEIGHTS, "cpu", "unknown") == pytest.approx(3.9)  # any model of the kind
    assert cs.load_s(WEIGHTS, "gpu", "a") == pytest.approx(WEIGHTS / cs.pcie_bytes_per_s)  # none measured: the model


def test_nodes_holding_a_copy_go_first_among_equals():
    nodes = [NodeView("c0", "cpu", 0, 0, 10, 0), NodeView("c1", "cpu", 0, 0, 10, 1),
             NodeView("c2", "cpu", 1, 5, 10, 2), NodeView("g0", "gpu", 0, 0, 10, 3)]
    assert [n.node_id for n in new_instance_order(nodes, ("cpu", "gpu"))] == ["c2", "c0", "c1", "g0"]
    order = new_instance_order(nodes, ("cpu", "gpu"), holding={"c1", "g0"})
    assert [n.node_id for n in order] == ["c2", "c1", "c0", "g0"]  # in use first still (bin-packing, 7.2)
    assert [n.node_id for n in new_instance_order(nodes, ("cpu",), exclusive=True, holding={"c1"})] == ["c1", "c0"]


# -- the cluster: one brain for the replay and the service -----------------------------------------
def _kv0_s(cluster, model: str, kind: str) -> float:
    s = cluster.catalog[cluster.models[model]]
    return (s.min_bytes(kind, cluster.config.watermark) - s.profiles[kind].weight_bytes) / GIB * RESIZE_UP_S_PER_GIB


def test_the_cluster_predicts_a_load_from_the_measured_ones():
    """The prior says 7.5 s (--cold-start-s); the engines load in 1.5 s. After one load the
    node (and its CPU peer) predict the measure; a GPU node keeps its prior."""
    def engines(plan, kind, load_s, seed):
        return SimulatedEngine(plan.model, plan.times, kv_bytes_per_token=plan.kv_bytes_per_token,
                               weight_bytes=plan.weight_bytes, context_window=plan.context_window,
                               load_s=1.5, seed=seed)

    async def main():
        cfg = config(cpu=2, gpu=1, cold_start=ColdStart(fixed_s=7.5))
        cluster = simulated_cluster(cfg, {"b": spec("b")}, {"m": "b"}, {"b": 100.0}, engine_factory=engines)
        await cluster.start()
        cpu0, cpu1, gpu0 = cluster.node("cpu0"), cluster.node("cpu1"), cluster.node("gpu0")
        prior = cluster.expected_load_s("m", cpu0)
        assert prior == pytest.approx(7.5 + WEIGHTS / 50e9 + _kv0_s(cluster, "m", "cpu"))
        ref = await cluster.start_instance(cluster.plan("m", cpu0), cpu0)
        assert ref.ready_at == pytest.approx(prior)  # predicted at issue from the prior
        await run_until(lambda: ref.inst.loaded)
        rec = cluster.cold_starts.records[-1]
        assert (rec.node_id, rec.model, rec.source) == ("cpu0", "m", "weights")
        assert rec.load_s == pytest.approx(1.5 + _kv0_s(cluster, "m", "cpu"))  # the engine's load and its KV cache
        assert cluster.engine_load_s("m", cpu0) == pytest.approx(rec.load_s)
        assert cluster.engine_load_s("m", cpu1) == pytest.approx(rec.load_s)  # a CPU peer's measure
        assert cluster.engine_load_s("m", gpu0) == pytest.approx(7.5 + WEIGHTS / 25e9 + _kv0_s(cluster, "m", "gpu"))
        await cluster.stop()

    run_virtual(main())


def test_retry_after_is_the_time_left_of_the_load_under_way():
    """Issue 24: 5 s into a 7.5 s load, 2.5 s are left (it said 10.0 s: a whole load more)."""
    async def main():
        cfg = config(cpu=1, gpu=0, cold_start=ColdStart(cpu_load_bytes_per_s=1e18, fixed_s=7.5))
        cluster, _ = await build("mesh", {"m": "b"}, cfg, {"b": spec("b", cpu_kv_bytes_per_token=1)})
        node = cluster.node("cpu0")
        assert cluster.cold_start_left_s("m") is None  # nothing loading
        await cluster.start_instance(cluster.plan("m", node), node)
        await asyncio.sleep(5.0)
        left = cluster.cold_start_left_s("m")
        retry = retry_after_s(cluster, "m")
        await asyncio.sleep(3.0)  # loaded: a second
        after = retry_after_s(cluster, "m")
        await cluster.stop()
        return left, retry, after

    left, retry, after = run_virtual(main())
    assert left == pytest.approx(2.5, abs=1e-3) and retry == pytest.approx(2.5, abs=1e-3) and after == 1.0
    assert overloaded("cannot meet its SLO", retry).headers["Retry-After"] == "3"  # whole seconds, rounded up


def test_the_weights_transfer_is_counted_and_copy_holders_go_first():
    """A node without a copy pays the model's bytes at the transfer throughput before its
    load; a new instance goes to the node holding a copy though it comes later in the
    cluster; a request that only the holder serves in time is placed there."""
    async def main():
        cfg = config(cpu=2, gpu=0, cold_start=ColdStart(cpu_load_bytes_per_s=40 * GB, net_bytes_per_s=1 * GB))
        cluster, d = await build("mesh", {"m": "b"}, cfg)
        cluster.holds_copy = lambda model, node: node.node_id == "cpu1"
        cpu0, cpu1 = cluster.node("cpu0"), cluster.node("cpu1")
        assert cluster.transfer_s("m", cpu0) == pytest.approx(WEIGHTS / GB) and cluster.transfer_s("m", cpu1) == 0
        assert cluster.expected_load_s("m", cpu0) == pytest.approx(cluster.expected_load_s("m", cpu1) + WEIGHTS / GB)
        r = request("r", "m", prompt=100)  # TTFT SLO 2 s: a 2 s transfer would not make it
        d.submit(r)
        await run_until(lambda: r.outcome is not None)
        await cluster.stop()
        return r

    r = run_virtual(main())
    assert r.slo_met and r.node_id == "cpu1"


# -- a cold model's request that cannot make its TTFT: serve late, or reject -----------------
@pytest.mark.parametrize("choice", ["serve_late", "reject"])
def test_a_cold_models_request_is_served_late_or_rejected_by_its_choice(choice):
    """A 7.5 s cold start and a 2 s TTFT SLO: no instance can make it. serve_late (the
    default): admitted on the instance warming up for it, its first token about one cold
    start late, its SLO counted as missed; a second request arriving during the load is
    served late too. reject: both are turned away, the instance still warms up."""
    async def main():
        cfg = config(cpu=1, gpu=0, cold_start=ColdStart(cpu_load_bytes_per_s=1e18, fixed_s=7.5))
        cluster, d = await build("mesh", {"m": "b"}, cfg, {"b": spec("b", cpu_kv_bytes_per_token=1)})
        if choice == "reject":
            cluster.set_cold_start_choice("m", "reject")
        first = request("r1", "m", prompt=100, out=5)
        d.submit(first)
        await asyncio.sleep(3.0)
        second = request("r2", "m", prompt=100, out=5)
        d.submit(second)
        await run_until(lambda: first.outcome is not None and second.outcome is not None)
        await cluster.stop()
        return first, second, d.policy.stats

    first, second, stats = run_virtual(main())
    assert stats.warm_ups == 1
    if choice == "serve_late":
        assert first.outcome.value == second.outcome.value == "completed" and stats.served_late == 2
        assert first.late_s == pytest.approx(7.5, abs=0.01) and second.late_s == pytest.approx(4.5, abs=0.01)
        assert 7.5 < first.ttft_s < 7.5 + 2.0 and not first.slo_met  # late: judged from its arrival
    else:
        assert first.outcome.value == second.outcome.value == "rejected" and stats.served_late == 0
    with pytest.raises(ValueError, match="cold_start"):
        config(cold_start_choice="sometimes")


def test_a_late_request_is_served_late_on_a_load_that_runs_over_its_prediction():
    """A load predicted at 4 s takes 10. A request that arrived at 3 s and reaches the
    dispatcher at 6 s (its prompt tokenized late) is served late on the loading instance, its
    deadlines from now: from the predicted ready time, already past, it could never be on
    time, and it was turned away ("no instance could take it in time")."""
    def engines(plan, kind, load_s, seed):
        return SimulatedEngine(plan.model, plan.times, kv_bytes_per_token=plan.kv_bytes_per_token,
                               weight_bytes=plan.weight_bytes, context_window=plan.context_window,
                               load_s=10.0, seed=seed)

    async def main():
        cfg = config(cpu=1, gpu=0, cold_start=ColdStart(cpu_load_bytes_per_s=1e18, fixed_s=4.0))
        cluster = simulated_cluster(cfg, {"b": spec("b", cpu_kv_bytes_per_token=1)}, {"m": "b"}, {"b": 100.0},
                                    engine_factory=engines)
        d = Dispatcher.for_policy(cluster, "mesh")
        await cluster.start()
        first = request("r1", "m", prompt=100, out=5)
        d.submit(first)
        await asyncio.sleep(6.0)
        now = asyncio.get_running_loop().time()
        late = request("r2", "m", prompt=100, out=5, at=now - 3.0)
        d.submit(late)
        await run_until(lambda: first.outcome is not None and late.outcome is not None)
        await cluster.stop()
        return first, late, d.policy.stats

    first, late, stats = run_virtual(main())
    assert first.outcome.value == "completed" and late.outcome.value == "completed", late.detail
    assert stats.served_late == 2 and late.late_s == pytest.approx(3.0, abs=0.05)


def test_a_cold_models_request_that_reached_the_dispatcher_late_still_starts_its_instance():
    """Issue 23's single-node workload: the service tokenizes a prompt before placing it, and
    for a model with no instance that builds the tokenizer first (seconds, more on a busy
    machine), so the first requests reach the dispatcher already past their 2 s TTFT. The
    warm-up must still start (the cold start, tokenizer included, is the only obstacle) and
    the request be served late on it; before, the warm-up's check validated the request
    with its own, already missed, deadline, no instance started, and every such request
    was turned away until one came through quickly."""
    async def main():
        cfg = config(cpu=1, gpu=0, cold_start=ColdStart(cpu_load_bytes_per_s=1e18, fixed_s=7.5))
        cluster, d = await build("mesh", {"m": "b"}, cfg, {"b": spec("b", cpu_kv_bytes_per_token=1)})
        now = asyncio.get_running_loop().time()
        late = request("r1", "m", prompt=100, out=5, at=now - 3.0)  # arrived 3 s ago, tokenized only now
        d.submit(late)
        await run_until(lambda: late.outcome is not None)
        await cluster.stop()
        return late, d.policy.stats

    late, stats = run_virtual(main())
    assert stats.warm_ups == 1 and stats.served_late == 1
    assert late.outcome.value == "completed" and late.late_s == pytest.approx(3.0 + 7.5, abs=0.01)


@pytest.mark.parametrize("choice", ["serve_late", "reject"])
def test_a_request_late_on_arrival_is_served_late_on_a_loaded_instance_by_its_choice(choice):
    """A request that reached the dispatcher 3 s after it arrived (its model's tokenizer was
    built first) when its model's instance had loaded meanwhile: past its 2 s TTFT, the queue
    would turn it away at once. serve_late: admitted on the loaded instance, deadlines from
    now; reject: turned away. A request on time is placed as before, not late."""
    async def main():
        cfg = config(cpu=1, gpu=0, cold_start=ColdStart(cpu_load_bytes_per_s=1e18, fixed_s=7.5))
        cluster, d = await build("mesh", {"m": "b"}, cfg, {"b": spec("b", cpu_kv_bytes_per_token=1)})
        cluster.set_cold_start_choice("m", choice)
        node = cluster.node("cpu0")
        await cluster.start_instance(cluster.plan("m", node), node)
        await asyncio.sleep(8.0)  # loaded
        now = asyncio.get_running_loop().time()
        late = request("late", "m", prompt=100, out=5, at=now - 3.0)
        fresh = request("fresh", "m", prompt=100, out=5)
        d.submit(late)
        d.submit(fresh)
        await run_until(lambda: late.outcome is not None and fresh.outcome is not None)
        await cluster.stop()
        return late, fresh, d.policy.stats

    late, fresh, stats = run_virtual(main())
    assert fresh.outcome.value == "completed" and fresh.late_s == 0.0 and fresh.slo_met
    if choice == "serve_late":
        assert late.outcome.value == "completed" and stats.served_late == 1 and not late.slo_met
        assert late.late_s == pytest.approx(3.0, abs=0.01)
    else:
        assert late.outcome.value == "rejected" and stats.served_late == 0


def test_requests_late_on_arrival_while_their_models_decision_is_under_way_are_served_late():
    """Issue 23's single-node workload, cold: the first request of a model starts its
    instance (live, a decision that takes a while), and the model's next requests reach the
    dispatcher meanwhile, already past their TTFT (their tokenizer was built first). The
    queue would turn them away at once ("no instance could take it in time", 4 of 48 in the
    workload); they get the model's next decision instead, as they would with none under
    way, and are served late. A request on time waits in the queue as before."""
    async def main():
        cfg = config(cpu=1, gpu=0, cold_start=ColdStart(cpu_load_bytes_per_s=1e18, fixed_s=7.5))
        cluster, d = await build("mesh", {"m": "b"}, cfg, {"b": spec("b", cpu_kv_bytes_per_token=1)})
        lock = d._decisions.setdefault("m", asyncio.Lock())  # a decision for "m" under way (live: seconds)
        await lock.acquire()
        now = asyncio.get_running_loop().time()
        late = [request(f"late{k}", "m", prompt=100, out=5, at=now - 8.0) for k in range(2)]
        fresh = request("fresh", "m", prompt=100, out=5)
        for r in (*late, fresh):
            d.submit(r)
        queued = d.queue.held("m")
        await asyncio.sleep(0.5)
        lock.release()
        await run_until(lambda: all(r.outcome is not None for r in (*late, fresh)))
        await cluster.stop()
        return late, fresh, queued, d.policy.stats

    late, fresh, queued, stats = run_virtual(main())
    assert queued == 1  # the request on time waited in the bounded queue, the late ones for a decision
    assert [r.outcome.value for r in late] == ["completed", "completed"], [r.detail for r in late]
    assert stats.served_late >= 2 and all(not r.slo_met for r in late)
    assert fresh.outcome.value == "completed"
