"""The twin counts a lost node as the service does: a replay with a node failure at a given
time (ReplayConfig.failures) hands every request that node held back to the same dispatcher
with its progress (mesh.replay.local_node LocalNode.lose, ClusterNode.hand_back_lost, as
AgentNode.lose live), places them again, and counts them lost and resumed by cause; the
node takes nothing until it is back."""
from __future__ import annotations

import pytest

from mesh.control.fleet import ClusterConfig
from mesh.perf.load_times import ANY_MODEL, ColdStart
from mesh.replay.driver import NodeFailure, ReplayConfig, build_catalog, run_policy
from workloads.workload import Arrival, Workload

BASE = "llama-3.2-3b"
MODEL = f"{BASE}/f000"
OUTPUT = 200
LOST_AT_S = 6.0


def _run(failures: tuple[NodeFailure, ...]):
    arrivals = [Arrival(f"r{i}", 0.5 * i, "f000", MODEL, 256, OUTPUT) for i in range(8)]
    arrivals.append(Arrival("late", 30.0, "f000", MODEL, 256, OUTPUT))  # after the node is back
    work = Workload(arrivals, {MODEL: BASE}, {"duration_s": 60.0})
    cluster = ClusterConfig(cpu_nodes=2, gpu_nodes=0, keep_alive_s=60.0,
                            cold_start=ColdStart(measured={(ANY_MODEL, "cpu"): 1.0}))
    return run_policy(work, "mesh", ReplayConfig(cluster=cluster, progress=False, failures=failures),
                      build_catalog([BASE]))


def held_at(run, node: str) -> set[str]:
    return {r.request_id for r in run.requests if any(a.startswith(f"lost on {node} ") for a in r.attempts)}


def test_a_replay_with_a_node_lost_resumes_every_request_it_held():
    calm = _run(())
    assert all(r.tokens_out == OUTPUT for r in calm.requests)
    # the undisturbed run's requests in flight at LOST_AT_S: they are the ones the lost node holds
    in_flight = {r.request_id for r in calm.requests if r.arrival_s <= LOST_AT_S < r.finish_s}
    assert len(in_flight) >= 4
    run = _run((NodeFailure("cpu0", LOST_AT_S, down_s=5.0),))
    lost = held_at(run, "cpu0")
    assert lost == in_flight  # reactive defragmentation (7.2): one instance, on cpu0, held them all
    d = run.dispatch
    assert d.lost["exited"] == d.resumed["exited"] == len(lost) and not d.lost_failed
    assert run.accounting["failed"] == run.accounting["rejected"] == 0
    for r in run.requests:
        assert r.tokens_out == OUTPUT, (r.request_id, r.attempts)  # max_tokens counted from the start
    by_id = {r.request_id: r for r in run.requests}
    for rid in lost:  # they went on elsewhere, and kept their arrival (SLO accounting) and first token
        assert by_id[rid].arrival_s == next(r.arrival_s for r in calm.requests if r.request_id == rid)
        assert by_id[rid].first_token_s is not None and by_id[rid].first_token_s < LOST_AT_S
    again = _run((NodeFailure("cpu0", LOST_AT_S, down_s=5.0),))  # the twin is deterministic
    assert held_at(again, "cpu0") == lost and [r.finish_s for r in again.requests] == [r.finish_s for r in run.requests]


def test_a_lost_node_takes_nothing_until_it_is_back():
    run = _run((NodeFailure("cpu0", LOST_AT_S, down_s=5.0), NodeFailure("cpu1", LOST_AT_S + 3.0, down_s=5.0)))
    # cpu1 took them, then was lost too while cpu0 was still down: they waited for cpu0's return
    lost0, lost1 = held_at(run, "cpu0"), held_at(run, "cpu1")
    assert lost0 and lost1 == lost0
    d = run.dispatch
    assert d.resumed["exited"] == 2 * len(lost0) and run.accounting["failed"] == 0
    assert all(r.tokens_out == OUTPUT for r in run.requests)
    assert all(r.finish_s > LOST_AT_S + 5.0 for r in run.requests if r.request_id in lost1)


def test_a_failure_of_a_node_the_cluster_lacks_is_refused():
    with pytest.raises(Exception, match="cpu9"):
        _run((NodeFailure("cpu9", 1.0),))


def _run_alone(down_s: float, queue_timeout_s: float = 10.0):
    """One node holding four requests, lost at 6 s for `down_s` (its agent restarting)."""
    arrivals = [Arrival(f"r{i}", 0.5 * i, "f000", MODEL, 256, OUTPUT) for i in range(4)]
    work = Workload(arrivals, {MODEL: BASE}, {"duration_s": 600.0})
    cluster = ClusterConfig(cpu_nodes=1, gpu_nodes=0, keep_alive_s=600.0,
                            cold_start=ColdStart(measured={(ANY_MODEL, "cpu"): 1.0}))
    config = ReplayConfig(cluster=cluster, progress=False, queue_timeout_s=queue_timeout_s,
                          failures=(NodeFailure("cpu0", LOST_AT_S, down_s=down_s),))
    return run_policy(work, "mesh", config, build_catalog([BASE]))


def test_lost_requests_wait_past_the_queue_timeout_while_their_node_recovers():
    """A restart (25 s) longer than the queue timeout (10 s): the lost requests wait on
    while the node is down (dispatch_rules.lost_wait_until) and all complete, their tokens
    counted from the start; a node down past 4 timeouts from the loss fails them then, each
    with the reason. (Before, they failed at the timeout, 16 s.)"""
    run = _run_alone(down_s=25.0)
    assert len(held_at(run, "cpu0")) == 4 and run.accounting["failed"] == 0, [r.detail for r in run.requests]
    assert all(r.tokens_out == OUTPUT and r.finish_s > LOST_AT_S + 25.0 for r in run.requests)
    run = _run_alone(down_s=10_000.0)
    assert run.accounting["failed"] == 4 and run.dispatch.lost_failed["exited"] == 4
    for r in run.requests:
        assert r.finish_s == pytest.approx(LOST_AT_S + 40.0, abs=0.01), r.finish_s
        assert "waited 40 s since its node was lost" in r.detail, r.detail


def test_requests_served_late_are_not_refused_for_their_own_lateness():
    """An SLO no prefill can meet (a 10 ms TTFT: a loaded machine's node against its
    profile's SLO) under the `queue` admission: past their SLO the requests are placed best
    effort (ServedRequest.best_effort) and all complete, late; a node lost under them changes
    nothing. (Before, every node refused them for their own first token being late, until
    they failed at the queue timeout.)"""
    from mesh.policy.slo import SLO

    arrivals = [Arrival(f"r{i}", 0.5 * i, "f000", MODEL, 256, OUTPUT) for i in range(4)]
    work = Workload(arrivals, {MODEL: BASE}, {"duration_s": 600.0})
    cluster = ClusterConfig(cpu_nodes=2, gpu_nodes=0, keep_alive_s=600.0, admission="queue",
                            slo=SLO(ttft_min_s=0.01, ttft_s_per_prompt_token=0.0, tpot_s=5.0),
                            cold_start=ColdStart(measured={(ANY_MODEL, "cpu"): 1.0}))
    config = ReplayConfig(cluster=cluster, progress=False, queue_timeout_s=10.0,
                          failures=(NodeFailure("cpu0", LOST_AT_S, down_s=10_000.0),))
    run = run_policy(work, "mesh", config, build_catalog([BASE]))
    assert run.accounting["completed"] == 4, [r.detail for r in run.requests]
    assert all(r.tokens_out == OUTPUT and r.best_effort for r in run.requests)
