"""Two real node agent processes with the real OpenVINO engine and the demo model, driven
by the replay's Dispatcher and Mesh policy through AgentNode: a running greedy stream taken
off one node (the step a preemption or an eviction takes, 7.1, 6.4) and placed again by the
dispatcher resumes on the other node, prompt plus produced tokens recomputed there, and its
tokens and text are exactly those of a stream that never moved."""
from __future__ import annotations

import asyncio

import pytest

from engines.protocol import EngineRequest, Sampling
from mesh.agent.engines import prior_profile
from mesh.agent.protocol import InstanceSpec
from mesh.agent.supervisor import AgentSettings, LocalAgent
from mesh.policy.slo import SLO
from mesh.runtime.cluster import Cluster, ClusterConfig, ModelSpec
from mesh.runtime.dispatcher import Dispatcher
from mesh.runtime.node import NodeSpec
from mesh.runtime.request import Outcome, ServedRequest
from mesh.service.agent_node import AgentNode

pytestmark = pytest.mark.slow

GIB = 2**30
SLO_LOOSE = SLO(ttft_min_s=120.0, tpot_s=5.0)  # this test is about tokens, not time
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow and say one thing about each."}]


def test_a_stream_moved_to_another_real_agent_keeps_its_greedy_output(demo_gguf):
    from engines.openvino_engine import OpenVINOEngine

    shape = OpenVINOEngine(demo_gguf)  # reads the model's shape and tokenizer; loads nothing
    ids = shape.encode_chat(QUESTION)

    async def load_spec(plan, node) -> InstanceSpec:
        return InstanceSpec(plan.instance_id, plan.model, str(demo_gguf), plan.context_window, max_num_seqs=8)

    async def main():
        settings = AgentSettings(models_roots=(str(demo_gguf.parent),))
        nodes = [AgentNode(NodeSpec(f"cpu{i}", "cpu", 4 * GIB), LocalAgent, settings, load_spec) for i in range(2)]
        profile = prior_profile("smol", "cpu", shape.weight_bytes, shape.kv_bytes_per_token, 2048)
        cluster = Cluster(ClusterConfig(cpu_nodes=2, gpu_nodes=0, cpu_memory_bytes=4 * GIB, slo=SLO_LOOSE),
                          {"smol": ModelSpec("smol", {"cpu": profile})}, {"smol": "smol"}, {"smol": 64.0},
                          nodes=nodes)
        d = Dispatcher.for_policy(cluster, "mesh")
        await cluster.start()
        for n in nodes:
            assert await n.agent.wait_up(60), n.agent.last_error
        out: dict[str, tuple[list[int], list[str], list[str]]] = {}

        def collect(req, tokens, texts):
            ids_, texts_, nodes_ = out.setdefault(req.request_id, ([], [], []))
            ids_.extend(tokens or ())
            texts_.extend(texts or ())
            nodes_.append(req.node_id)

        def request(rid: str) -> ServedRequest:
            return ServedRequest(EngineRequest(rid, len(ids), Sampling(max_tokens=48, temperature=0.0), list(ids)),
                                 "smol", asyncio.get_running_loop().time(), SLO_LOOSE, on_output=collect)

        async def until(cond, limit_s: float = 120.0) -> None:
            for _ in range(int(limit_s / 0.02)):
                if cond():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("condition not reached")

        still = request("still")
        d.submit(still)
        await until(lambda: still.outcome is not None)
        moved = request("moved")
        d.submit(moved)
        await until(lambda: moved.tokens_out >= 12 or moved.outcome is not None)
        assert moved.outcome is None, (moved.outcome, moved.detail, moved.attempts, d.stats, d.policy.stats)
        first_node = moved.node_id
        node = cluster.node(first_node)
        taken = await node.take_back("moved", "moved by the test")
        assert taken is moved and moved.node_id is None and moved.outcome is None
        d.on_evict(moved, node)  # placed again by the dispatcher, not on the node it left
        await until(lambda: moved.outcome is not None)
        await cluster.stop()
        return still, moved, first_node, out

    still, moved, first_node, out = asyncio.run(main())
    assert still.outcome is Outcome.COMPLETED and moved.outcome is Outcome.COMPLETED, moved.detail
    assert first_node == "cpu0" and moved.node_id == "cpu1"
    ref_ids, ref_text, _ = out["still"]
    got_ids, got_text, where = out["moved"]
    assert {"cpu0", "cpu1"} <= set(where)  # streamed from both nodes
    assert len(ref_ids) == still.tokens_out > 12
    assert got_ids == ref_ids  # nothing lost, repeated or reordered
    assert "".join(got_text) == "".join(ref_text)
    assert moved.tokens_out == still.tokens_out
