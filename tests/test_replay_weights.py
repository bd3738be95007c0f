"""Cold starts by weights source in replays (issue 7 item 6): the pure live-scaling model,
and the four modes on a small synthetic burst."""
from __future__ import annotations

import pytest

from mesh.perf.load_times import CostModel, estimate
from mesh.replay.driver import build_catalog
from mesh.replay.cold_start_modes import WeightsConfig, stop_the_world_s
from mesh.replay.weights_compare import compare, table
from workloads.workload import Arrival, Workload


def test_stop_the_world_times() -> None:
    cfg = WeightsConfig(ssd_bytes_per_s=2e9, pcie_bytes_per_s=20e9, fixed_s=0.5)
    assert stop_the_world_s(cfg, 10**10, False) == pytest.approx(5.5)
    assert stop_the_world_s(cfg, 10**10, True) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        WeightsConfig(mode="disk")


def _burst() -> Workload:
    """A trickle, then a burst that needs several new instances at once."""
    arrivals = [Arrival(f"a{i}", i * 2.0, "f000", "llama-2-7b/f000", 200, 50) for i in range(10)]
    arrivals += [Arrival(f"b{i}", 30.0 + i * 0.01, "f000", "llama-2-7b/f000", 1500, 100) for i in range(300)]
    return Workload(sorted(arrivals, key=lambda a: a.time_s), {"llama-2-7b/f000": "llama-2-7b"}, {"duration_s": 60.0})


def test_the_four_modes_on_a_burst() -> None:
    weight_bytes = build_catalog(["llama-2-7b"])["llama-2-7b"].profiles["gpu"].weight_bytes
    cfg = WeightsConfig(ssd_bytes_per_s=3e9, pcie_bytes_per_s=25e9, net_bytes_per_s=25e9, block_bytes=256 * 2**20)
    res = compare(_burst(), "llama-2-7b", ["ssd", "host", "multicast", "multicast-live"], cfg, gpu_nodes=6)
    ssd, host, mc, live = (res[m] for m in ("ssd", "host", "multicast", "multicast-live"))
    assert set(ssd["loads"]) == {"ssd"} and ssd["load_s_max"] == pytest.approx(weight_bytes / 3e9)
    assert host["loads"].get("ssd", 0) >= 1  # each node's first load reads its SSD
    # multicast: one host copy (the pool put it on a node), the others by network; a group of
    # n targets from s sources finishes no later than the planner's estimate for 1 source
    assert mc["loads"].get("multicast", 0) >= 2 and mc["multicasts"] >= 1
    one = estimate("binomial", weight_bytes, 1, CostModel(cfg.block_bytes, 25e9, cfg.latency_s)).total_s
    assert mc["load_s_max"] < weight_bytes / 3e9 and mc["load_s_max"] >= one * 0.99
    # live: serving from the first block on, for the instances that had a partner
    assert live["loads"].get("live", 0) >= 1
    # the first layer ends in block 1 (block 0: the first 256 MiB of 13 GB, under one layer's bytes)
    assert live["load_s_min"] == pytest.approx(2 * (cfg.block_bytes / 25e9 + cfg.latency_s))
    assert mc["load_s_min"] == pytest.approx(min(weight_bytes / 25e9, one))
    # the faster the weights, the shorter the tail
    assert mc["ttft_p99_s"] < ssd["ttft_p99_s"]
    assert live["ttft_p99_s"] <= mc["ttft_p99_s"] * 1.05
    assert all(r["requests"] == 310 for r in res.values())
    assert "multicast-live" in table(res)


def test_overlapping_multicasts_queue_on_the_source_uplink() -> None:
    import asyncio
    from types import SimpleNamespace

    from mesh.replay.cold_start_modes import WeightsModel

    nodes = [SimpleNamespace(node_id=f"gpu{i}") for i in range(4)]
    cluster = SimpleNamespace(nodes=nodes, config=SimpleNamespace(noise=0.0), instances_of=lambda model: [])
    cfg = WeightsConfig(mode="multicast", net_bytes_per_s=1e9, block_bytes=10**8, latency_s=0.0)

    def plan(i: int, node: str) -> SimpleNamespace:
        return SimpleNamespace(model="m", instance_id=f"m@{node}#{i}", weight_bytes=10**9, times=None)

    async def main() -> list[float]:
        w = WeightsModel(cfg, cluster)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = [plan(0, "gpu1"), plan(1, "gpu2")]  # one multicast of two targets, from gpu0's host copy
        for p in first:
            w._join(p, p.instance_id.split("@")[1].split("#")[0])
        ready = [w.loading(p, p.instance_id.split("@")[1].split("#")[0])[0] - t0 for p in first]
        await asyncio.sleep(0.5)
        late = plan(2, "gpu3")  # while gpu0 still sends: it waits for gpu0's uplink
        w._join(late, "gpu3")
        ready.append(w.loading(late, "gpu3")[0] - t0)
        assert w.pool.host_copies("m") == ["gpu0"] and w.stats.multicasts == 2
        return ready

    from mesh.replay.virtual_loop import run_virtual

    ready = run_virtual(main())
    # 10 blocks of 0.1 s: binomial 1 -> 2 takes b + 1 = 11 rounds for both, and gpu0 sends in
    # every round (its last send is round 10), so the second multicast (1 -> 1, 10 rounds) waits
    # for gpu0's uplink until 1.1 s and ends at 2.1 s, not at 0.5 + 1.0
    assert ready[:2] == pytest.approx([1.1, 1.1])
    assert ready[2] == pytest.approx(2.1)


# --- Mesh with cold starts longer than the TTFT SLO (issue 7: the policy never scaled out) ---

def _steady(n: int, every_s: float, start_s: float = 0.0, duration_s: float = 60.0) -> Workload:
    arrivals = [Arrival(f"s{i}", start_s + i * every_s, "f000", "llama-2-7b/f000", 200, 50) for i in range(n)]
    return Workload(arrivals, {"llama-2-7b/f000": "llama-2-7b"}, {"duration_s": duration_s})


def test_warm_up_rule() -> None:
    from mesh.policy.placement import warm_up_allowed

    assert warm_up_allowed(4.5, 1.8, True, 0)  # SSD load longer than any fresh request can wait
    assert not warm_up_allowed(0.6, 1.8, True, 0)  # it fits: a fresh request starts it as usual
    assert not warm_up_allowed(4.5, 1.8, False, 0)  # not the cold start alone (memory, context...)
    assert not warm_up_allowed(4.5, 1.8, True, 1)  # one unvalidated load of the model at a time


def test_a_warm_up_never_builds_beside_requests_a_cpu_node_serves() -> None:
    from mesh.policy.placement import warm_up_node_allowed

    assert warm_up_node_allowed("cpu", False, True) and warm_up_node_allowed("gpu", True, True)
    assert not warm_up_node_allowed("cpu", True, True)  # a scale-out: its build would take the cores they run on
    assert warm_up_node_allowed("cpu", True, False)  # the model's first instance: else it is never served


@pytest.mark.parametrize("policy", ["mesh-no-cpu", "mesh"])
def test_mesh_scales_out_when_the_ssd_load_exceeds_the_slo(policy: str) -> None:
    """7B from SSD at 3 GB/s: 4.5 s, past the 2 s TTFT SLO. Mesh used to refuse every new
    instance and turn the whole stream away; now the first request starts one and the
    requests that validate on it (those arriving after its load, and the last ones of the
    load) are served within SLO, while those that cannot are still turned away."""
    weight_bytes = build_catalog(["llama-2-7b"])["llama-2-7b"].profiles["gpu"].weight_bytes
    assert weight_bytes / 3e9 > 4.0
    cfg = WeightsConfig(ssd_bytes_per_s=3e9)
    r = compare(_steady(120, 0.5), "llama-2-7b", ["ssd"], cfg, gpu_nodes=2, policy=policy)["ssd"]
    assert r["requests"] == 120 and r["failed"] == 0
    assert r["slo_rate"] >= 0.9  # was 0 %
    assert r["completed"] >= 108 and r["rejected"] <= 12  # about the 4.5 s of the load, turned away
    assert r["warm_ups"] >= 1 and r["instances_started"] <= 2  # a trickle needs one instance
    # a burst while the model is cold: one unvalidated load, not one per request
    burst = compare(_steady(40, 0.01), "llama-2-7b", ["ssd"], cfg, gpu_nodes=4, policy=policy)["ssd"]
    assert burst["warm_ups"] == 1 and burst["instances_started"] == 1


def test_an_unused_warm_up_is_recycled_after_its_load() -> None:
    """One request, then nothing for a while: its instance loads (4.5 s), idles keep-alive
    (1 s) from the end of its load, then goes; it is not recycled in the middle of its load."""
    from mesh.perf.load_times import ColdStart
    from mesh.replay.driver import ReplayConfig, run_policy
    from mesh.replay.cold_start_modes import Engines
    from mesh.control.cluster_view import ClusterConfig

    catalog = build_catalog(["llama-2-7b"])
    weight_bytes = catalog["llama-2-7b"].profiles["gpu"].weight_bytes
    cfg = WeightsConfig(ssd_bytes_per_s=3e9)
    cluster = ClusterConfig(cpu_nodes=0, gpu_nodes=1, cold_start=ColdStart(3e9, 3e9), keep_alive_s=1.0,
                            cold_start_choice="reject")  # unused: its requests are turned away
    workload = _steady(2, 20.0, start_s=1.0, duration_s=30.0)  # at 1 s and at 21 s
    run = run_policy(workload, "mesh-no-cpu", ReplayConfig(cluster=cluster, engines=Engines(cfg)), catalog, None)
    gpus = [(t, g) for t, _, g in run.usage]
    assert gpus[1] == (1.0, 1) and gpus[2][1] == 0
    assert run.accounting["rejected"] == 2 and run.policy_stats.warm_ups == 2
    loaded = 1.0 + weight_bytes / 3e9  # the weights are in (the KV cache's allocation is quick)
    assert loaded + 1.0 <= gpus[2][0] <= loaded + 1.2
