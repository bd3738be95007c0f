"""Two real node agent processes with the real OpenVINO engine and the demo model, driven
by the replay's Dispatcher and Mesh policy through AgentNode: a running greedy stream taken
off one node (the step a preemption or an eviction takes, 7.1, 6.4), or preempted by the
policy itself to make room for another model's request, resumes on the other node, prompt
plus produced tokens recomputed there, and its tokens and text are exactly those of a
stream that never moved. The agents load instances with `exact_moves` (EXACT_RECOMPUTE): with
the CPU's default numerics a recomputed stream may continue differently at a near-tie
(scripts/exact_moves_check.py), and token-for-token equality is what shows that the move
itself lost, repeated or reordered nothing."""
from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from agent_doubles import ClusterOnly, until
from mesh.control.agent_node import AgentNode
from mesh.control.dispatcher import Dispatcher, DispatchStats
from mesh.control.fleet import ClusterConfig, Fleet, ModelSpec
from mesh.control.supervisor import AgentSettings, LocalAgent
from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.node.instance_host import MEAN_OUTPUT_PRIOR
from mesh.perf.times import prior_profile
from mesh.policy.kv_demand import DEFAULT_WATERMARK, kv_require_bytes, recommend_bytes
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import SLO
from mesh.wire.agent_protocol import InstanceSpec
from mesh.wire.served_request import Outcome, ServedRequest

pytestmark = pytest.mark.slow

GIB = 2**30
SLO_LOOSE = SLO(ttft_min_s=120.0, tpot_s=5.0)  # this test is about tokens, not time
REAL_ENGINE_S = 120.0  # how long a condition may take with real engines on this machine
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow and say one thing about each."}]


Stream = tuple[list[int], list[str], list[str]]  # (token ids, texts, the node of each output)


@dataclass
class Disturbed:
    """A greedy stream run undisturbed (`still`), then the same request disturbed mid-stream
    (`disturbed`), on two real agents driven by the Mesh policy: what each streamed, where."""

    still: ServedRequest
    disturbed: ServedRequest
    first_node: str
    out: dict[str, Stream]
    stats: DispatchStats


def disturbed_run(demo_gguf, disturb: Callable[[Dispatcher, Fleet, ServedRequest], Awaitable[None]]) -> Disturbed:
    """Two agent processes load the demo model with `exact_moves`; `disturb(dispatcher,
    cluster, request)` is called once the second request has streamed 12 tokens."""
    from mesh.engines.openvino_engine import OpenVINOEngine

    shape = OpenVINOEngine(demo_gguf)  # reads the model's shape and tokenizer; loads nothing
    ids = shape.encode_chat(QUESTION)

    async def load_spec(plan, node) -> InstanceSpec:
        return InstanceSpec(plan.instance_id, plan.model, str(demo_gguf), plan.context_window, max_num_seqs=8,
                            exact_moves=True)

    async def main() -> Disturbed:
        settings = AgentSettings(models_roots=(str(demo_gguf.parent),))
        profile = prior_profile("smol", "cpu", shape.weight_bytes, shape.kv_bytes_per_token, 2048)
        cluster = Fleet(ClusterConfig(cpu_nodes=2, gpu_nodes=0, cpu_memory_bytes=4 * GIB, slo=SLO_LOOSE),
                              {"smol": ModelSpec("smol", {"cpu": profile})}, {"smol": "smol"}, {"smol": 64.0})
        nodes = [AgentNode(NodeSpec(f"cpu{i}", "cpu", 4 * GIB), LocalAgent, settings, load_spec, ClusterOnly(cluster))
                 for i in range(2)]
        for n in nodes:
            cluster.add_node(n)
        d = Dispatcher.for_policy(cluster, "mesh")
        await cluster.start()
        for n in nodes:
            assert await n.agent.wait_up(60), n.agent.last_error
        out: dict[str, Stream] = {}

        def collect(req, tokens, texts, _logprobs):
            ids_, texts_, nodes_ = out.setdefault(req.request_id, ([], [], []))
            ids_.extend(tokens or ())
            texts_.extend(texts or ())
            nodes_.append(req.node_id)

        def request(rid: str) -> ServedRequest:
            return ServedRequest(EngineRequest(rid, len(ids), Sampling(max_tokens=48, temperature=0.0), list(ids)),
                                 "smol", asyncio.get_running_loop().time(), SLO_LOOSE, on_output=collect)

        still = request("still")
        d.submit(still)
        await until(lambda: still.outcome is not None, REAL_ENGINE_S)
        disturbed = request("disturbed")
        d.submit(disturbed)
        await until(lambda: disturbed.tokens_out >= 12 or disturbed.outcome is not None, REAL_ENGINE_S)
        assert disturbed.outcome is None, (disturbed.outcome, disturbed.detail, disturbed.attempts, d.stats)
        first_node = disturbed.node_id
        await disturb(d, cluster, disturbed)
        await until(lambda: disturbed.outcome is not None, REAL_ENGINE_S)
        await cluster.stop()
        return Disturbed(still, disturbed, first_node, out, d.stats)

    run = asyncio.run(main())
    assert run.still.outcome is Outcome.COMPLETED and run.disturbed.outcome is Outcome.COMPLETED, run.disturbed.detail
    ref_ids, ref_text, _ = run.out["still"]
    got_ids, got_text, where = run.out["disturbed"]
    assert {run.first_node, run.disturbed.node_id} <= set(where)  # streamed from both nodes
    assert got_ids == ref_ids and "".join(got_text) == "".join(ref_text)  # nothing lost, repeated or changed
    assert run.disturbed.tokens_out == run.still.tokens_out == 48
    return run


def test_a_stream_moved_to_another_real_agent_keeps_its_greedy_output(demo_gguf):
    async def take_back(d: Dispatcher, cluster: Fleet, req: ServedRequest) -> None:
        node = cluster.node(req.node_id)
        taken = await node.take_back(req.request_id, "moved by the test")
        assert taken is req and req.node_id is None and req.outcome is None
        d.on_evict(req, node)  # placed again by the dispatcher, not on the node it left

    run = disturbed_run(demo_gguf, take_back)
    assert run.first_node == "cpu0" and run.disturbed.node_id == "cpu1"


def test_a_stream_whose_agent_is_killed_keeps_its_greedy_output(demo_gguf):
    """The node's agent process SIGKILLed mid-stream: the request goes back to the dispatcher
    with the tokens the service had streamed (AgentNode.lose), resumes on the other agent,
    and its tokens and text are those of a stream that was never disturbed."""
    async def kill(d: Dispatcher, cluster: Fleet, req: ServedRequest) -> None:
        os.kill(cluster.node(req.node_id).agent.pid, signal.SIGKILL)

    run = disturbed_run(demo_gguf, kill)
    assert run.disturbed.node_id != run.first_node and run.disturbed.lost in ("exited", "connection")
    assert run.stats.resumed[run.disturbed.lost] == 1


def test_the_policy_preempts_a_real_stream_to_make_room_and_it_keeps_its_greedy_output(demo_gguf):
    """Proactive preemption (7.1) chosen by MeshScheduler on real agents. cpu0 runs X (model m,
    two streams) and Y (model n, one stream) and has memory for exactly that (the weights and
    the KV sizes its memory subsystem gives them, Eq. 2 and the watermark, computed below with
    the same functions). A third request for m needs X's cache to grow: it fails validation
    on X, validates with Y preempted, and Y's stream validates on a new instance on cpu1. So
    the dispatcher preempts Y: its stream is recomputed on cpu1 and goes on, and its tokens
    are those of the same request run alone there afterwards."""
    from mesh.engines.openvino_engine import EXACT_RECOMPUTE, OpenVINOEngine

    window = 256
    shape = OpenVINOEngine(demo_gguf, context_window=window, properties=EXACT_RECOMPUTE)
    ids = shape.encode_chat(QUESTION)
    k, w = shape.kv_bytes_per_token, shape.weight_bytes

    def size(streams: int) -> int:  # an instance's bytes for `streams` requests of `ids` (6.1, 6.2)
        kv = recommend_bytes(kv_require_bytes(k, [(len(ids), 0)] * streams, MEAN_OUTPUT_PRIOR, window),
                             DEFAULT_WATERMARK)
        return w + max(kv, recommend_bytes(kv_require_bytes(k, [], MEAN_OUTPUT_PRIOR, window), DEFAULT_WATERMARK))

    cpu0 = size(2) + size(1) + k  # X with two streams and Y with one, and one token to spare
    require3 = w + kv_require_bytes(k, [(len(ids), 0)] * 3, MEAN_OUTPUT_PRIOR, window)
    assert require3 + size(1) > cpu0 and require3 <= cpu0, "the demo model's sizes no longer set up this test"

    async def load_spec(plan, node) -> InstanceSpec:
        return InstanceSpec(plan.instance_id, plan.model, str(demo_gguf), window, max_num_seqs=8, exact_moves=True)

    async def main():
        # cpu0's memory is sized to the byte: no tokenizer cache reserved in it
        settings = AgentSettings(models_roots=(str(demo_gguf.parent),), tokenizer_bytes=0)
        profile = prior_profile("smol", "cpu", w, k, window)
        cluster = Fleet(ClusterConfig(cpu_nodes=2, gpu_nodes=0, cpu_memory_bytes=4 * GIB, slo=SLO_LOOSE,
                                            keep_alive_s=600.0),  # X and Y wait idle for their requests
                              {"smol": ModelSpec("smol", {"cpu": profile})}, {"m": "smol", "n": "smol"},
                              {"smol": float(MEAN_OUTPUT_PRIOR)})
        nodes = [AgentNode(NodeSpec("cpu0", "cpu", cpu0), LocalAgent, settings, load_spec, ClusterOnly(cluster)),
                 AgentNode(NodeSpec("cpu1", "cpu", 4 * GIB), LocalAgent, settings, load_spec, ClusterOnly(cluster))]
        for n in nodes:
            cluster.add_node(n)
        d = Dispatcher.for_policy(cluster, "mesh")
        await cluster.start()
        for n in nodes:
            assert await n.agent.wait_up(60), n.agent.last_error
        a, b = nodes
        out: dict[str, list[int]] = {}

        def collect(req, tokens, texts, _logprobs):
            out.setdefault(req.request_id, []).extend(tokens or ())

        def request(rid: str, model: str) -> ServedRequest:
            return ServedRequest(EngineRequest(rid, len(ids), Sampling(max_tokens=160, temperature=0.0), list(ids)),
                                 model, asyncio.get_running_loop().time(), SLO_LOOSE, on_output=collect)

        async def instance(model: str, node) -> str:
            ref = await cluster.start_instance(cluster.plan(model, node), node)
            assert ref is not None, node.last_start_error
            assert await node.wait_loaded(ref.instance_id, 120)
            return ref.instance_id

        x, y = await instance("m", a), await instance("n", a)
        first = [request(f"m{i}", "m") for i in range(2)]
        moved = request("n0", "n")
        for r in first:
            assert (await a.try_admit(x, r)).ok
        assert (await a.try_admit(y, moved)).ok
        await until(lambda: moved.tokens_out >= 8, REAL_ENGINE_S)
        r = request("r", "m")
        assert not (await a.validate(x, r)).ok  # X's cache cannot grow beside Y
        assert (await a.validate(x, r, exclude=[y])).ok  # it can with Y gone
        d.submit(r)
        await until(lambda: moved.node_id == "cpu1" or moved.outcome is not None, REAL_ENGINE_S)
        preempted_at = len(out["n0"])
        await until(lambda: all(q.outcome is not None for q in [*first, moved, r]), REAL_ENGINE_S)
        alone = request("alone", "n")  # the reference: the same request, never moved, on cpu1
        d.submit(alone)
        await until(lambda: alone.outcome is not None, REAL_ENGINE_S)
        await cluster.stop()
        return d, first, moved, r, alone, out, preempted_at, x, y

    d, first, moved, r, alone, out, preempted_at, x, y = asyncio.run(main())
    assert d.policy.stats.preemptions == 1, (d.policy.stats, r.attempts)
    assert any(f"preempted by {x}" in note for note in moved.attempts), moved.attempts
    for q in [*first, moved, r, alone]:
        assert q.outcome is Outcome.COMPLETED, (q.request_id, q.outcome, q.detail)
    assert moved.node_id == alone.node_id == "cpu1" and moved.instance_id != y
    assert 8 <= preempted_at < len(out["n0"])  # it moved mid-stream
    assert out["n0"] == out["alone"]  # nothing lost, repeated or reordered
