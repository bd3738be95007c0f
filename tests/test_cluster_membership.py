"""Nodes that join and leave while serving (issue 12), without Ray: ClusterControl.add_node
and remove_node with in-process agents and simulated engines, the weights plane's pool on a
node's loss, RemoteAgent's address source, the autoscaling rule, and what Ray nodes get.
The same code runs under `mesh serve --ray` (tests/test_cluster_ray.py, with Ray)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agent_doubles import TOKEN, WEIGHTS_TOKEN, InProcessAgent, use_simulated_engines
from mesh.control.remote_agents import RemoteAgent
from mesh.control.weights_plane import WeightsPlane, WeightsSettings
from mesh.engines.engine_api import Sampling
from mesh.node.agent_server import AgentServer
from mesh.policy.autoscale import NodeUse, decide
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import SLO
from mesh.ray.membership import mesh_node_ids
from mesh.service.cluster_control import ClusterControl, ClusterSettings
from mesh.service.config import ConfigError, build_config
from mesh.service.errors import ApiError
from mesh.service.registry import ModelRecord
from mesh.service.streams import Finished, Job, Tokens

SIZE = 3 << 20


@pytest.fixture(autouse=True)
def simulated(monkeypatch):
    use_simulated_engines(monkeypatch)


def record(path: Path) -> ModelRecord:
    return ModelRecord("m_1", "t", "my-model", "gguf", str(path), 256, SLO(), SIZE)


def job(rid: str, m: ModelRecord, max_tokens: int = 5) -> Job:
    return Job(rid, m, asyncio.get_running_loop().time(), Sampling(max_tokens=max_tokens),
               prompt_token_ids=list(range(1, 21)))


async def started(tmp_path: Path, nodes: int, **settings) -> ClusterControl:
    class Agent(InProcessAgent):
        weights_root = str(tmp_path / "nodes")

    specs = [NodeSpec(f"cpu-{i}", "cpu", 10**9) for i in range(nodes)]
    plane = WeightsSettings(plan="binomial", block_bytes=1 << 20, token=WEIGHTS_TOKEN)
    settings.setdefault("cold_start_s", 0.0)  # simulated engines load at once
    p = ClusterControl(specs, ClusterSettings(**settings), agent_factory=Agent,
                         weights=lambda agents: WeightsPlane(agents, plane))
    await p.start()
    return p


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "registry" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(os.urandom(SIZE))
    return path


def test_a_removed_nodes_streams_go_on_elsewhere_and_it_leaves_the_pool(tmp_path, model_file):
    async def main():
        p = await started(tmp_path, 2, max_batch=1)
        m = record(model_file)
        await p.weights.register(m)  # first host copy: cpu-0
        await p.scale_out(m, ["cpu-1"])
        assert p.view()["weights"]["models"][m.uid]["host_copies"] == ["cpu-0", "cpu-1"]
        running = await p.submit(job("long", m, max_tokens=236))  # to the window's end (256 - 20)
        node = running.node_id
        other = ({"cpu-0", "cpu-1"} - {node}).pop()
        second = await p.submit(job("second", m))  # the batch of one is full: the other instance
        assert second.node_id == other
        await p.remove_node(node, "test")
        events = [ev async for ev in second.events()]
        assert isinstance(events[-1], Finished) and all(isinstance(ev, Tokens) for ev in events[:-1])
        # the removed node's stream was placed again with its progress: it ends on the other node
        events = [ev async for ev in running.events()]
        assert isinstance(events[-1], Finished) and events[-1].tokens_out == 236
        assert p.view()["dispatcher"]["resumed"]["removed"] == 1
        view = p.view()
        assert [n["node_id"] for n in view["nodes"]] == [other]
        pool = view["weights"]["models"][m.uid]
        assert node not in pool["host_copies"] and node not in pool["copies"] and node not in pool["instances"].values()
        assert node not in p.weights.pool.nodes()
        await p.stop()

    asyncio.run(main())


def test_a_request_the_full_node_cannot_take_scales_out_and_outlives_that_node(tmp_path, model_file):
    async def main():
        p = await started(tmp_path, 2, max_batch=1)
        m = record(model_file)
        await p.weights.register(m)
        running = await p.submit(job("long", m, max_tokens=236))  # to the window's end (256 - 20)
        assert running.node_id == "cpu-0"
        stream = await p.submit(job("next", m))  # a new instance on cpu-1 (LLM-Mesh 4), its weights multicast
        assert stream.node_id == "cpu-1"
        await p.remove_node("cpu-0", "test")
        assert isinstance([ev async for ev in stream.events()][-1], Finished)
        copies = p.view()["weights"]["models"][m.uid]
        assert copies["host_copies"] == ["cpu-1"] and copies["copies"].keys() == {"cpu-1"}
        events = [ev async for ev in running.events()]  # it went on on cpu-1 once `next` ended
        assert isinstance(events[-1], Finished) and events[-1].tokens_out == 236
        await p.stop()

    asyncio.run(main())


def test_a_node_added_while_serving_gets_the_model_by_multicast(tmp_path, model_file):
    async def main():
        p = await started(tmp_path, 1)
        m = record(model_file)
        first = await p.submit(job("a", m))
        assert isinstance([ev async for ev in first.events()][-1], Finished)

        class Agent(InProcessAgent):
            weights_root = str(tmp_path / "nodes")

        await p.add_node(NodeSpec("cpu-9", "cpu", 10**9), Agent)
        with pytest.raises(ValueError):
            await p.add_node(NodeSpec("cpu-9", "cpu", 10**9), Agent)
        result = await p.scale_out(m, ["cpu-9"])
        assert result["results"][0]["ok"] and result["results"][0]["weights"] == "multicast from cpu-0"
        assert p.cluster.cold_starts.node_load_s("cpu-0", m.uid) is not None
        await p.remove_node("cpu-0", "test")
        assert p.cluster.cold_starts.node_load_s("cpu-0", m.uid) is None  # its load history left with it
        assert p.cluster.cold_starts.node_load_s("cpu-9", m.uid) is not None
        stream = await p.submit(job("b", m))
        assert stream.node_id == "cpu-9" and isinstance([ev async for ev in stream.events()][-1], Finished)
        await p.remove_node("cpu-9", "test")
        with pytest.raises(ApiError) as e:
            await p.submit(job("c", m))
        assert e.value.status == 503
        await p.stop()

    asyncio.run(main())


def test_the_last_copy_leaving_sends_the_model_from_the_origin_next_time(tmp_path, model_file):
    async def main():
        p = await started(tmp_path, 2)
        m = record(model_file)
        assert await p.weights.register(m) == "cpu-0"
        await p.remove_node("cpu-0", "test")
        assert m.uid not in p.weights.view()["models"]
        stream = await p.submit(job("a", m))
        assert stream.node_id == "cpu-1" and isinstance([ev async for ev in stream.events()][-1], Finished)
        assert p.weights.view()["models"][m.uid]["transfers"][0]["sources"] == ["origin"]
        await p.stop()

    asyncio.run(main())


def test_a_remote_agent_asks_its_address_source_at_every_connection():
    async def main():
        spec = NodeSpec("cpu-7", "cpu", 10**9)
        servers = [AgentServer(spec, TOKEN, load_roots=["/"])]
        addresses = [await servers[0].serve("127.0.0.1:0")]
        asked: list[str] = []

        async def source() -> str:
            asked.append(addresses[-1])
            return addresses[-1]

        ups: list[int] = []
        agent = RemoteAgent(spec, source, TOKEN, lambda a: ups.append(a.generation), lambda a, r: None,
                            lambda a, m: None, where="ray node abc")
        await agent.start()
        assert await agent.wait_up(10) and agent.location == "ray node abc" and agent.address == addresses[0]
        # The agent restarts elsewhere (Ray restarted its actor): a new port, which the source gives.
        servers.append(AgentServer(spec, TOKEN, load_roots=["/"]))
        addresses.append(await servers[1].serve("127.0.0.1:0"))
        servers[0].connection.writer.transport.abort()
        await servers[0].close()
        for _ in range(200):
            if len(ups) == 2:
                break
            await asyncio.sleep(0.02)
        assert ups == [1, 2] and agent.address == addresses[1] and asked[-1] == addresses[1]
        await agent.stop()
        await servers[1].close()

    asyncio.run(main())


def test_ray_nodes_get_a_cpu_agent_and_one_per_gpu():
    rid = "0123456789abcdef" * 3
    assert mesh_node_ids(rid, {"CPU": 8.0, "memory": 1e9}) == [("ray-01234567", "cpu")]
    assert mesh_node_ids(rid, {"CPU": 16.0, "GPU": 2.0}) == [
        ("ray-01234567", "cpu"), ("ray-01234567-gpu0", "gpu"), ("ray-01234567-gpu1", "gpu")]
    assert mesh_node_ids(rid, {"CPU": 0.0}) == []  # `ray start --head --num-cpus 0`: no agent there


def test_autoscaling_wants_the_nodes_in_use_and_releases_idle_ones():
    busy = NodeUse("a", instances=1, requests=3, idle_s=0.0)
    idle_long = NodeUse("b", instances=0, requests=0, idle_s=300.0)
    idle_short = NodeUse("c", instances=0, requests=0, idle_s=10.0)
    d = decide([busy, idle_long, idle_short], refused_waiting=0, idle_release_s=120.0)
    assert d.wanted == 1 and d.release == ("b",)
    d = decide([busy, idle_long, idle_short], refused_waiting=2, idle_release_s=120.0)
    assert d.wanted == 2 and d.release == ()  # demand beyond capacity: one more node, the idle one stays
    d = decide([idle_long, idle_short], refused_waiting=0, idle_release_s=5.0, min_nodes=1)
    assert d.wanted == 1 and d.release == ("b",)  # keep one (the most recently used); release the other
    with pytest.raises(ValueError):
        decide([], 0, -1.0)


def test_ray_settings_are_checked():
    assert build_config({}, {"ray": "auto"}).ray == "auto"
    with pytest.raises(ConfigError, match="ray_autoscale needs ray"):
        build_config({}, {"ray_autoscale": True})
    with pytest.raises(ConfigError, match="ray must be"):
        build_config({"ray": ""}, {})


def test_ray_agents_tokens_come_from_the_nodes_secret_never_from_the_actors_arguments(tmp_path, monkeypatch):
    """Issue 32: what Ray keeps to restart an actor (its arguments) holds no secret. The
    service and every actor derive the tokens from the cluster secret each machine holds
    (the environment, else a 0600 file the service creates)."""
    import dataclasses
    import stat

    from mesh.ray import actor

    monkeypatch.delenv(actor.SECRET_ENV, raising=False)
    monkeypatch.setenv(actor.SECRET_FILE_ENV, str(tmp_path / "cluster.secret"))
    with pytest.raises(actor.ClusterSecretError, match="MESH_CLUSTER_SECRET"):
        actor.cluster_secret()  # a node never makes one up
    secret = actor.cluster_secret(create=True)
    assert stat.S_IMODE((tmp_path / "cluster.secret").stat().st_mode) == 0o600
    assert actor.cluster_secret() == secret  # the node reads the service's
    a, b = actor.agent_token(secret, "ray-1"), actor.agent_token(secret, "ray-2")
    assert a != b and len(a) == 64 and actor.agent_token(secret, "ray-1") == a
    assert actor.weights_token(secret) not in (a, b)
    monkeypatch.setenv(actor.SECRET_ENV, "from-the-environment")
    assert actor.cluster_secret() == b"from-the-environment"
    launch = actor.launch_dict(actor.AgentLaunch())
    assert not {f.name for f in dataclasses.fields(actor.AgentLaunch)} & {"agent_token", "weights_token"}
    assert all(secret.decode() not in str(v) and a not in str(v) for v in launch.values())
