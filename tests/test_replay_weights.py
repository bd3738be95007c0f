"""Cold starts by weights source in replays (issue 7 item 6): the pure live-scaling model,
and the four modes on a small synthetic burst."""
from __future__ import annotations

import pytest

from mesh.control.load_timing import WeightsConfig, stop_the_world_s
from mesh.perf.load_times import CostModel, estimate
from mesh.replay.driver import build_catalog
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
    from mesh.policy.dispatch_rules import warm_up_allowed

    assert warm_up_allowed(4.5, 1.8, True, 0)  # SSD load longer than any fresh request can wait
    assert not warm_up_allowed(0.6, 1.8, True, 0)  # it fits: a fresh request starts it as usual
    assert not warm_up_allowed(4.5, 1.8, False, 0)  # not the cold start alone (memory, context...)
    assert not warm_up_allowed(4.5, 1.8, True, 1)  # one unvalidated load of the model at a time


def test_a_warm_up_never_builds_beside_requests_a_cpu_node_serves() -> None:
    from mesh.policy.dispatch_rules import warm_up_node_allowed

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
    from mesh.control.fleet import ClusterConfig
    from mesh.perf.load_times import ColdStart
    from mesh.replay.cold_start_modes import Engines
    from mesh.replay.driver import ReplayConfig, run_policy

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


# --- live scaling by mesh.policy.live_scaling's rules -------------------------------------------

def _azure_minute():
    from pathlib import Path

    from mesh.replay.driver import trace_mean_output
    from workloads.azure_llm import load_lengths
    from workloads.datasets import CONVERSATION_FILE, DATA_DIR
    from workloads.workload import bursty_single_model

    lengths = load_lengths(Path(DATA_DIR) / CONVERSATION_FILE)
    max_total = build_catalog(["llama-2-13b"])["llama-2-13b"].profiles["gpu"].max_context
    workload = bursty_single_model(lengths, model="llama-2-13b", minutes=1.0, seed=0, max_total=max_total)
    return workload, {"llama-2-13b": trace_mean_output(lengths, max_total)}


@pytest.mark.parametrize("policy", ["sllm", "mesh-no-cpu"])
def test_live_scaling_cuts_the_tail_of_a_burst_and_never_serves_a_validated_request_late_for_layers(
        policy: str) -> None:
    """The bursty Azure minute (docs/multicast.md's replay, 13B, 8 GPUs): instances that
    serve from their first layer, with ZigZag pulls by their partner, cut TTFT p99 against
    stop-the-world multicast (1.92 -> 1.25 s under sllm, 1.67 -> 1.25 s under Mesh); under
    Mesh, whose shadow validation predicts live instances from their layers, no request
    admitted to be on time is served late after waiting for layers."""
    workload, prior = _azure_minute()
    res = compare(workload, "llama-2-13b", ["multicast", "multicast-live"], WeightsConfig(), gpu_nodes=8,
                  policy=policy, prior=prior)
    mc, live = res["multicast"], res["multicast-live"]
    assert live["loads"].get("live", 0) >= 1 and live["live_pulls"] >= 1 and live["activation_bytes"] > 0
    assert live["ttft_p99_s"] < 0.8 * mc["ttft_p99_s"]
    assert live["slo_rate"] >= mc["slo_rate"]
    assert live["late_missing_layers"] == 0 and mc["late_missing_layers"] == 0


def test_a_scale_from_zero_forms_an_execution_pipeline_and_switches() -> None:
    """lambdaScale 4.3-4.4: three receivers of one binomial multicast from the pool's host
    copy, no loaded instance: they form one pipeline (Algorithm 2, one sub-group), serve
    from the instant their blocks together cover the model, before any of them holds it all,
    and the switch to full instances comes when all of them do."""
    from types import SimpleNamespace

    from mesh.replay.cold_start_modes import WeightsModel
    from mesh.replay.virtual_loop import run_virtual

    nodes = [SimpleNamespace(node_id=f"gpu{i}") for i in range(4)]
    cluster = SimpleNamespace(nodes=nodes, config=SimpleNamespace(noise=0.0), instances_of=lambda model: [])
    cfg = WeightsConfig(mode="multicast-live", net_bytes_per_s=1e9, block_bytes=10**8, latency_s=0.0, layers=40)

    async def main():
        w = WeightsModel(cfg, cluster)
        w.pool.register("m", 10**9)
        host = w.pool.host_copies("m")[0]
        targets = [n.node_id for n in nodes if n.node_id != host]
        plans = [SimpleNamespace(model="m", instance_id=f"m@{n}#0", weight_bytes=10**9, times=None) for n in targets]
        for p, n in zip(plans, targets):
            w._join(p, n)
        return w, [w.loading(p, n) for p, n in zip(plans, targets)]

    w, out = run_virtual(main())
    roles = [role for _, role in out]
    assert all(r is not None and r.pipeline is not None for r in roles) and w.stats.pipelines == 1
    pipe = roles[0].pipeline
    ready = out[0][0]
    assert all(t == ready for t, _ in out) and ready == pytest.approx(pipe.cover_s())
    assert ready < min(r.arrivals.full_s for r in roles)  # before any member holds the model
    assert pipe.switch_s() == pytest.approx(max(r.arrivals.full_s for r in roles))
    assert w.stats.loads == {"pipeline": 3}


def test_pipeline_members_serve_through_the_pipeline_then_recompute_their_kv() -> None:
    """Engines of a pipeline: an iteration before the switch takes W plus one activation
    hop per stage boundary (or the member alone, if sooner); after the switch each member
    first recomputes the KV cache of its requests (prompt + tokens so far) as a prefill."""
    import asyncio
    from types import SimpleNamespace

    from doubles import LinearTimes
    from mesh.engines.engine_api import EngineRequest, Sampling
    from mesh.policy.live_scaling import pipeline_iteration_s, solo_finish
    from mesh.replay.cold_start_modes import WeightsModel
    from mesh.replay.virtual_loop import run_virtual

    nodes = [SimpleNamespace(node_id=f"gpu{i}") for i in range(4)]
    cluster = SimpleNamespace(nodes=nodes, config=SimpleNamespace(noise=0.0), instances_of=lambda model: [])
    cfg = WeightsConfig(mode="multicast-live", net_bytes_per_s=1e9, block_bytes=10**8, latency_s=0.0, layers=40)
    times = LinearTimes(prefill_per_token=1e-4, decode_base=0.02)

    async def main():
        loop = asyncio.get_running_loop()
        w = WeightsModel(cfg, cluster)
        w.pool.register("m", 10**9)
        targets = [n.node_id for n in nodes if n.node_id not in w.pool.host_copies("m")]
        make = w.factory()
        engines = [make(SimpleNamespace(model="m", instance_id=f"m@{n}#0", weight_bytes=10**9, times=times,
                                        kv_bytes_per_token=1, context_window=4096, prefill_token_budget=4096,
                                        max_batch=8), "gpu", 0.0, 0) for n in targets]
        await asyncio.gather(*(e.load() for e in engines))
        e = engines[0]
        start = loop.time()
        e.add_request(EngineRequest("r", 1000, Sampling(max_tokens=50), output_len=50))
        await e.step()  # the prefill, through the pipeline
        first = loop.time() - start
        stages = e.role.pipeline.stages(start)
        alone = solo_finish(start, 0.1, e.role.arrivals) - start
        switch = e.role.pipeline.switch_s()
        await asyncio.sleep(max(0.0, switch - loop.time()))
        before = loop.time()
        await e.step()  # the switch's recompute (1001 tokens), then one decode
        return first, stages, alone, loop.time() - before, w.stats

    first, stages, alone, after, stats = run_virtual(main())
    hop = 4096 * 1000 * 2 / 1e9
    assert stages is not None and len(stages) >= 2
    assert first == pytest.approx(pipeline_iteration_s(0.1, stages, hop, 1), rel=1e-6)  # one batch in flight
    assert 0.1 <= first < alone and stats.activation_bytes == (len(stages) - 1) * 4096 * 1000 * 2
    assert stats.recompute_tokens == 1001
    assert after == pytest.approx(1001 * 1e-4 + 0.02, rel=1e-6)
