"""Parked instances (mesh.engines.parking, issue 23): a stopped OpenVINO instance's worker kept
built and warm within the node's parking budget, and adopted by the next load of the same
model with the same settings; never a worker in the middle of a step."""
from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from mesh.engines.parking import Parked, ParkingLot


class FakeConn:
    """A worker connection's surface the lot uses: `dead` and `shutdown`."""

    def __init__(self) -> None:
        self.dead: str | None = None
        self.ended = False

    async def shutdown(self, timeout_s: float) -> None:
        self.ended = True


def test_the_lot_keeps_the_newest_within_its_budget():
    async def main() -> None:
        lot = ParkingLot(250)
        a, b, c = FakeConn(), FakeConn(), FakeConn()
        assert lot.park("a", Parked("ma", a, 100)) and lot.park("b", Parked("mb", b, 100))
        assert lot.park("c", Parked("mc", c, 100))  # over 250: the oldest goes
        await asyncio.sleep(0)
        assert a.ended and not b.ended and lot.models() == ["mb", "mc"] and lot.held_bytes == 200
        assert not lot.park("big", Parked("big", FakeConn(), 251))  # alone over the budget: the caller ends it
        assert lot.take("a") is None
        assert lot.take("b").conn is b and lot.take("b") is None  # taken: the caller's now
        c.dead = "it exited"
        assert lot.take("c") is None  # a dead worker is no use
        dead = FakeConn()
        dead.dead = "gone"
        assert not lot.park("d", Parked("md", dead, 1))
        e = FakeConn()
        assert lot.park("e", Parked("me", e, 1))
        await lot.close()
        assert e.ended and lot.models() == [] and not lot.park("f", Parked("mf", FakeConn(), 1))
        with pytest.raises(ValueError):
            ParkingLot(-1)

    asyncio.run(main())


@pytest.mark.slow
def test_a_stopped_instance_is_adopted_by_the_next_load_of_its_model(demo_gguf, tmp_path):
    """The real OpenVINO worker: parked on unload, adopted (same process) by a load with the
    same settings, and it generates what a fresh one does; a different window does not match;
    a worker caught in a step is ended, never parked."""
    from mesh.engines.engine_api import EngineRequest, Sampling
    from mesh.engines.openvino_process import OpenVINOProcessEngine

    async def generate(engine: Any, ids: list[int]) -> list[int]:
        engine.add_request(EngineRequest("r", len(ids), Sampling(max_tokens=8, temperature=0), ids))
        tokens: list[int] = []
        while engine.has_work():
            result = await engine.step()
            tokens += list(result.token_ids or ())
        return tokens

    async def main() -> None:
        lot = ParkingLot(1 << 30)
        kw: dict[str, Any] = dict(context_window=1024, max_num_seqs=8, log_dir=tmp_path, cache_root=tmp_path / "c",
                                  parking=lot)
        first = OpenVINOProcessEngine(demo_gguf, **kw)
        try:
            await first.load()
            ids = first.encode_prompt("The capital of France is")
            expected = await generate(first, ids)
            pid = first.worker_pid
            await first.unload()
            assert lot.models() == [first.model_name] and lot.held_bytes >= first.weight_bytes
            other = OpenVINOProcessEngine(demo_gguf, **{**kw, "context_window": 512})
            assert other._park_key() != first._park_key()  # another window: another build
            again = OpenVINOProcessEngine(demo_gguf, **kw, kv_capacity_bytes=1 << 20)
            await again.load()
            assert again.loaded_from == "parked" and again.worker_pid == pid and lot.models() == []
            assert await generate(again, ids) == expected
            again._stepping = True  # as a watchdog leaves a step it gave up on
            await again.unload()
            assert lot.models() == []
            await asyncio.sleep(0.5)
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        finally:
            await lot.close()

    asyncio.run(main())


async def _one_agent_cluster(demo_gguf: Any) -> tuple[Any, Any]:
    """A started Fleet over one AgentNode (a real agent process) that loads the demo
    model as "smol" (8 requests at most, window 2048)."""
    from agent_doubles import ClusterOnly
    from mesh.control.agent_node import AgentNode
    from mesh.control.fleet import ClusterConfig, Fleet, ModelSpec
    from mesh.control.supervisor import AgentSettings, LocalAgent
    from mesh.engines.openvino_engine import OpenVINOEngine
    from mesh.perf.times import prior_profile
    from mesh.policy.node_spec import NodeSpec
    from mesh.policy.slo import SLO
    from mesh.wire.agent_protocol import InstanceSpec

    gib = 2**30
    shape = OpenVINOEngine(demo_gguf)

    async def load_spec(plan: Any, node: Any) -> InstanceSpec:
        return InstanceSpec(plan.instance_id, plan.model, str(demo_gguf), plan.context_window, max_num_seqs=8)

    profile = prior_profile("smol", "cpu", shape.weight_bytes, shape.kv_bytes_per_token, 2048)
    cluster = Fleet(ClusterConfig(cpu_nodes=1, gpu_nodes=0, cpu_memory_bytes=4 * gib, slo=SLO(60.0, 5.0)),
                          {"smol": ModelSpec("smol", {"cpu": profile})}, {"smol": "smol"}, {"smol": 64.0})
    node = AgentNode(NodeSpec("cpu0", "cpu", 4 * gib), LocalAgent,
                     AgentSettings(models_roots=(str(demo_gguf.parent),)), load_spec, ClusterOnly(cluster))
    cluster.add_node(node)
    await cluster.start()
    return node, cluster


async def _until_parked(node: Any, model: str) -> None:
    for _ in range(600):
        await node.refresh()
        if node.parked(model):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"never parked: {node.stats.get('parked')}, {node.stats.get('parked_ahead')}")


@pytest.mark.slow
def test_a_real_agent_parks_a_stopped_instance_and_the_cluster_predicts_its_next_load(demo_gguf):
    """Through the service's AgentNode and a real agent process: the second instance of a
    model adopts the first one's worker, the agent reports it parked in between, and the
    cluster's cold-start prediction follows (the parked load only while one is parked)."""
    from agent_doubles import until

    async def main() -> None:
        node, cluster = await _one_agent_cluster(demo_gguf)
        try:
            assert await node.agent.wait_up(60), node.agent.last_error
            first = await cluster.start_instance(cluster.plan("smol", node), node)
            await until(lambda: first.inst.loaded, 120)
            assert node.loaded_from(first.instance_id) in ("gguf", "prepared")
            cold = cluster.engine_load_s("smol", node)
            await cluster.stop_instance(first)
            await _until_parked(node, "smol")
            second = await cluster.start_instance(cluster.plan("smol", node), node)
            await until(lambda: second.inst.loaded, 30)
            assert node.loaded_from(second.instance_id) == "parked"
            await node.refresh()
            assert not node.parked("smol")  # adopted: nothing parked now
            assert cluster.engine_load_s("smol", node) == pytest.approx(cold)  # the real load's measure
            await cluster.stop_instance(second)
            await _until_parked(node, "smol")
            assert cluster.engine_load_s("smol", node) < min(1.0, cold)  # parked again: its measured adoption
        finally:
            await cluster.stop()

    asyncio.run(main())


@pytest.mark.slow
def test_a_model_described_on_a_real_agent_is_parked_ahead_and_its_first_load_adopts_it(demo_gguf):
    """mesh.node.park_ahead: describing a model (what registration does) builds the instance
    a load would build, with the load's settings, and parks it; the cluster predicts the
    parked tier's load there, and the model's first load adopts the worker."""
    from agent_doubles import until
    from mesh.perf.load_times import PARKED_PRIOR_S

    async def main() -> None:
        node, cluster = await _one_agent_cluster(demo_gguf)
        try:
            assert await node.agent.wait_up(60), node.agent.last_error
            assert not node.parked("smol")
            await node.agent.client.call_message({"t": "describe", "model": "smol", "path": str(demo_gguf),
                                                  "engine": "openvino",
                                          "context_window": 2048, "max_num_seqs": 8}, 60)  # as the loads load it
            await _until_parked(node, "smol")
            assert node.stats["parked_ahead"]["parked"] == ["smol"]
            assert cluster.engine_load_s("smol", node) == PARKED_PRIOR_S  # no build predicted
            first = await cluster.start_instance(cluster.plan("smol", node), node)
            await until(lambda: first.inst.loaded, 30)
            assert node.loaded_from(first.instance_id) == "parked"  # its first load built nothing
        finally:
            await cluster.stop()

    asyncio.run(main())
