"""The twin's cold-start tiers (issue 31 item 5): a replay's CPU nodes with a parking budget
park stopped instances and build ahead the models whose first host copy they hold, by the
rules of the service's OpenVINO nodes (mesh.replay.local_node), so the twin of a live run
serves a model's first request from a parked worker where the service does."""
from __future__ import annotations

import pytest

from mesh.control.fleet import ClusterConfig
from mesh.perf.load_times import ANY_MODEL, PARKED, ColdStart, ColdStartTable
from mesh.replay.driver import ReplayConfig, build_catalog, run_policy
from workloads.workload import Arrival, Workload

BASE = "llama-3.2-3b"
COLD_S = 10.0  # every build: a load from scratch, or a build ahead
PARKED_S = 0.05  # a load that adopts a parked worker


def _run(arrivals: list[tuple[float, str]], park_bytes: int, keep_alive_s: float = 5.0, policy: str = "mesh",
         host_copies: bool = True, functions: tuple[str, ...] = ("f000", "f001")):
    models = {f"{BASE}/{f}": BASE for f in functions}
    work = Workload([Arrival(f"r{i}", t, f, f"{BASE}/{f}", 64, 8) for i, (t, f) in enumerate(arrivals)],
                    models, {"duration_s": max(t for t, _ in arrivals) + 30})
    cluster = ClusterConfig(cpu_nodes=2, gpu_nodes=1, keep_alive_s=keep_alive_s, park_bytes=park_bytes,
                            host_copies=host_copies,
                            cold_start=ColdStart(measured={(ANY_MODEL, "cpu"): COLD_S, (ANY_MODEL, "gpu"): COLD_S},
                                                 parked_s=PARKED_S))
    return run_policy(work, policy, ReplayConfig(cluster=cluster, progress=False), build_catalog([BASE]))


def test_models_registered_a_minute_ahead_are_built_ahead_and_parked_where_their_first_copy_is():
    """f000's first host copy goes to cpu0 and f001's to cpu1 (the pool: most free host
    memory, ties by name); each is built there in COLD_S and parked, so their first
    requests, a minute later, adopt a parked worker instead of waiting a cold start."""
    run = _run([(60.0, "f000"), (61.0, "f001")], park_bytes=64 * 2**30)
    assert all(r.outcome is not None and r.first_token_s is not None for r in run.requests)
    assert max(r.ttft_s for r in run.requests) < 2.0
    assert run.instances_started == 2
    cold = _run([(60.0, "f000"), (61.0, "f001")], park_bytes=0)  # nodes that park nothing: a full cold start
    assert min(r.ttft_s for r in cold.requests) >= COLD_S


def test_a_request_during_the_build_ahead_adopts_it_and_a_stopped_instance_is_parked():
    """f000 at 4 s: its build ahead on cpu0 is under way, so the load adopts it (the rest of
    the build, then the parked tier), not a second build from scratch. Its instance stops
    after the keep-alive and is parked: f000 at 60 s is served at once."""
    run = _run([(4.0, "f000"), (60.0, "f000")], park_bytes=64 * 2**30)
    first, later = run.requests
    assert COLD_S - 4.0 <= first.ttft_s < COLD_S  # the build's 6 s left, not a new 10 s build
    assert later.ttft_s < 2.0 and run.instances_recycled >= 1 and run.instances_started == 2


def test_a_node_holding_the_first_host_copy_goes_first_among_empty_nodes():
    """sllm+cpu takes the first empty CPU node, those holding a host copy first (dispatch_rules.
    new_instance_order, as live): f001's first copy, and its build ahead, are on cpu1, so its
    request goes there and adopts the parked worker. A twin where every node holds every
    model (host_copies=False) sends it to cpu0, which has nothing parked: a cold start."""
    held = _run([(60.0, "f001")], park_bytes=64 * 2**30, policy="sllm+cpu")
    assert held.requests[0].ttft_s < 2.0
    everywhere = _run([(60.0, "f001")], park_bytes=64 * 2**30, policy="sllm+cpu", host_copies=False)
    assert everywhere.requests[0].ttft_s >= COLD_S


def test_a_build_ahead_uses_the_gaps_between_another_models_requests():
    """f002's first host copy lands on cpu0 (cpu0, cpu1, cpu0 in name order), which serves
    f000 from 1 s on, one short request every 4 s, its instance kept alive between them.
    The build runs only while cpu0 is idle (NodeRuntime.idle: no load, no request), so it
    takes the gaps and f002 is parked well before its first request at 80 s."""
    trickle = [(1.0 + 4 * i, "f000") for i in range(19)]
    run = _run([*trickle, (80.0, "f002")], park_bytes=64 * 2**30, keep_alive_s=60.0,
               functions=("f000", "f001", "f002"))
    first = next(r for r in run.requests if r.model.endswith("f002"))
    assert first.ttft_s < 2.0
    assert {r.node_id for r in run.requests if r.model.endswith("f000")} == {"cpu0"}  # the node it was built on


def test_the_node_is_idle_only_with_nothing_loading_and_no_request():
    """NodeRuntime.idle, what builds ahead may run in (the agents' and the twin's)."""
    from types import SimpleNamespace

    from mesh.node.runtime import NodeRuntime
    from mesh.policy.node_spec import NodeSpec

    runtime = NodeRuntime(NodeSpec("cpu0", "cpu", 2**34))
    assert runtime.idle()  # nothing at all
    runtime.instances = {"a": SimpleNamespace(loaded=False, requests={})}
    assert not runtime.idle()  # a load under way
    runtime.instances = {"a": SimpleNamespace(loaded=True, requests={})}
    assert runtime.idle()  # kept alive between requests: its cores are free
    runtime.instances["b"] = SimpleNamespace(loaded=True, requests={"r": object()})
    assert not runtime.idle()  # serving


def test_a_lot_too_small_parks_nothing():
    """A build ahead is parked only where the lot has room for it (weights and initial KV
    cache): a lot of one byte leaves every first request to a cold start."""
    run = _run([(60.0, "f000")], park_bytes=1)
    assert run.requests[0].ttft_s >= COLD_S


def test_the_twin_records_parked_loads_as_their_own_tier(monkeypatch):
    """A load that adopted a parked worker is recorded with the source 'parked', which the
    cold-start table keeps apart from builds, as the service's does."""
    seen: list[str] = []
    record = ColdStartTable.record
    monkeypatch.setattr(ColdStartTable, "record", lambda self, rec: (seen.append(rec.source), record(self, rec))[1])
    _run([(60.0, "f000")], park_bytes=64 * 2**30)
    assert seen == [PARKED]


def test_a_negative_parking_budget_is_refused():
    with pytest.raises(ValueError, match="parking budget"):
        ClusterConfig(park_bytes=-1)
