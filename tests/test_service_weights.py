"""The service's weights plane (issue 7 items 1 and 4) with in-process node agents that
host real weights receivers on loopback, and simulated engines: registration places the
first host copy, a scale-out multicasts the model to nodes without it, a saturated node
makes the cluster control scale out, and deleting a model deletes the nodes' copies."""
from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_doubles import WEIGHTS_TOKEN, InProcessAgent, until, use_simulated_engines
from mesh.control.weights_plane import WeightsError, WeightsPlane, WeightsSettings
from mesh.engines.engine_api import Sampling
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import SLO
from mesh.service.cluster_control import ClusterControl, ClusterSettings
from mesh.service.errors import ApiError
from mesh.service.prometheus import ServiceMetrics
from mesh.service.registry import ModelRecord
from mesh.service.streams import Finished, Job

SIZE = 3 * 2**20 + 12345  # not a whole number of blocks


@pytest.fixture(autouse=True)
def simulated(monkeypatch):
    use_simulated_engines(monkeypatch)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "registry" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(os.urandom(SIZE))
    return path


def sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def record(path: Path, uid: str = "m_1") -> ModelRecord:
    return ModelRecord(uid, "t", "my-model", "gguf", str(path), 256, SLO(), SIZE)


async def started(tmp_path: Path, nodes: int = 3, token: str = WEIGHTS_TOKEN, host_bytes: int = 10**9,
                  **settings) -> ClusterControl:
    class Agent(InProcessAgent):
        weights_root = str(tmp_path / "nodes")

    specs = [NodeSpec(f"cpu-{i}", "cpu", 10**9) for i in range(nodes)]
    plane = WeightsSettings(plan="binomial", block_bytes=1 << 20, token=token)
    settings.setdefault("cold_start_s", 0.0)  # simulated engines load at once
    p = ClusterControl(specs, ClusterSettings(**settings), agent_factory=Agent,
                       weights=lambda agents: WeightsPlane(agents, plane, {s.node_id: host_bytes for s in specs}))
    await p.start()
    return p


async def run(p: ClusterControl, m: ModelRecord, rid: str, max_tokens: int = 5) -> tuple[str, Finished]:
    loop = asyncio.get_running_loop()
    stream = await p.submit(Job(rid, m, loop.time(), Sampling(max_tokens=max_tokens),
                                prompt_token_ids=list(range(1, 21))))
    events = [e async for e in stream.events()]
    assert isinstance(events[-1], Finished)
    return stream.node_id, events[-1]


def test_registration_places_the_first_host_copy_and_the_instance_loads_it(tmp_path, model_file):
    async def main():
        p = await started(tmp_path)
        m = record(model_file)
        p.model_registered(m)
        for _ in range(200):
            if p.weights.holders(m.uid):
                break
            await asyncio.sleep(0.02)
        weights = p.view()["weights"]["models"][m.uid]
        assert weights["host_copies"] == ["cpu-0"]  # equal free memory: the first by name
        assert weights["transfers"][0]["sources"] == ["origin"] and weights["blocks"] == 4
        copy = weights["copies"]["cpu-0"]
        assert Path(copy).is_relative_to(tmp_path / "nodes" / "cpu-0") and sha(copy) == sha(model_file)

        node, done = await run(p, m, "r1")
        assert node == "cpu-0" and done.tokens_out == 5
        inst = p.view()["nodes"][0]["instances"][0]
        assert inst["weights"] == "host copy"
        assert p.view()["weights"]["models"][m.uid]["instances"] == {inst["instance_id"]: "cpu-0"}
        await p.stop()

    asyncio.run(main())


def test_scale_out_multicasts_once_to_every_new_node(tmp_path, model_file):
    async def main():
        p = await started(tmp_path, nodes=4)
        m = record(model_file)
        await p.weights.register(m)
        result = await p.scale_out(m, ["cpu-1", "cpu-2", "cpu-3"])
        assert all(r["ok"] for r in result["results"]), result
        assert {r["weights"] for r in result["results"]} == {"multicast from cpu-0"}
        weights = p.view()["weights"]["models"][m.uid]
        assert len(weights["transfers"]) == 2  # the first copy, then one multicast to the three
        assert weights["transfers"][1]["targets"] == ["cpu-1", "cpu-2", "cpu-3"]
        assert weights["transfers"][1]["plan"] == "binomial"
        assert weights["host_copies"] == ["cpu-0", "cpu-1", "cpu-2", "cpu-3"]
        for node in ("cpu-1", "cpu-2", "cpu-3"):
            assert sha(weights["copies"][node]) == sha(model_file)
        assert len(weights["instances"]) == 3
        metrics = {(s.name, s.labels["node"]): s.value
                   for family in text_string_to_metric_families(ServiceMetrics(p.view).render().decode())
                   for s in family.samples if s.name.startswith("mesh_node_weights")}
        assert metrics[("mesh_node_weights_host_copies", "cpu-3")] == 1
        assert metrics[("mesh_node_weights_received_bytes", "cpu-0")] == SIZE  # the first copy
        assert metrics[("mesh_node_weights_received_bytes", "cpu-2")] == SIZE

        await p.forget_model(m.uid)
        assert not (tmp_path / "nodes" / "cpu-1" / m.uid).exists()
        assert not (tmp_path / "nodes" / "cpu-0" / m.uid).exists()
        assert m.uid not in p.view()["weights"]["models"]
        await p.stop()

    asyncio.run(main())


def test_a_request_the_full_instance_cannot_take_scales_out_by_multicast(tmp_path, model_file):
    async def main():
        p = await started(tmp_path, nodes=2, max_batch=1)
        m = record(model_file)
        first = asyncio.ensure_future(run(p, m, "r1", max_tokens=40))
        for _ in range(200):  # r1 holds cpu-0's batch of one
            if any(r.batch_size for r in p.cluster.all_instances()):
                break
            await asyncio.sleep(0.01)
        node, done = await run(p, m, "r2")  # shadow validation fails there: a new instance (LLM-Mesh 4)
        assert node == "cpu-1" and done.tokens_out == 5
        assert (await first)[0] == "cpu-0"
        weights = p.view()["weights"]["models"][m.uid]
        assert weights["transfers"][-1]["sources"] == ["cpu-0"] and weights["transfers"][-1]["targets"] == ["cpu-1"]
        await p.stop()

    asyncio.run(main())


def test_a_wrong_weights_token_fails_the_load_with_a_clear_error(tmp_path, model_file, caplog):
    """The operator's log says the token is wrong; the tenant gets a 503 without the
    transfer's detail (which can name paths and file facts: issue 32)."""
    async def main():
        p = await started(tmp_path, nodes=1, token="not-the-nodes-token")
        m = record(model_file)
        with pytest.raises(ApiError) as e:
            await run(p, m, "r1")
        assert e.value.status == 503 and e.value.code == "weights_unavailable"
        assert "weights token wrong" in caplog.text and "operator's log" in e.value.message
        assert "token" not in e.value.message and str(tmp_path) not in e.value.message
        assert not list((tmp_path / "nodes" / "cpu-0").rglob("*.gguf"))
        await p.stop()

    asyncio.run(main())


def test_a_node_that_still_holds_the_model_is_not_sent_it_again(tmp_path, model_file):
    async def main():
        p = await started(tmp_path, nodes=2)
        m = record(model_file)
        await p.weights.register(m)
        copy = Path(p.weights.view()["models"][m.uid]["copies"]["cpu-0"])
        await p.stop()

        again = await started(tmp_path, nodes=2)  # a restart: the nodes' folders are still there
        await again.weights.register(m)
        weights = again.weights.view()["models"][m.uid]
        assert weights["transfers"] == [] and weights["host_copies"] == ["cpu-0"]
        assert again.weights._models[m.uid].how["cpu-0"] == "host copy (already on the node)"
        await again.stop()

        with copy.open("r+b") as f:  # one flipped byte: the node's copy no longer matches
            f.seek(SIZE - 1)
            last = f.read(1)
            f.seek(SIZE - 1)
            f.write(bytes([last[0] ^ 1]))
        third = await started(tmp_path, nodes=2)
        await third.weights.register(m)
        assert [t["targets"] for t in third.weights.view()["models"][m.uid]["transfers"]] == [["cpu-0"]]
        assert sha(copy) == sha(model_file)
        await third.stop()

    asyncio.run(main())


def test_a_folder_model_travels_file_by_file_and_a_nested_folder_does_not(tmp_path):
    async def main():
        folder = tmp_path / "registry" / "ir"
        folder.mkdir(parents=True)
        names = {"openvino_model.xml": 2000, "openvino_model.bin": 2 * 2**20 + 7, "openvino_tokenizer.xml": 300}
        for name, size in names.items():
            (folder / name).write_bytes(os.urandom(size))
        p = await started(tmp_path, nodes=2)
        m = ModelRecord("m_ir", "t", "ir-model", "ir", str(folder), 256, SLO(), sum(names.values()))
        (result,) = (await p.scale_out(m, ["cpu-1"]))["results"]
        assert result["ok"] and result["weights"] == "multicast from cpu-0", result
        weights = p.view()["weights"]["models"][m.uid]
        assert weights["files"] == 3 and weights["bytes"] == sum(names.values())
        assert sorted((t["file"], tuple(t["sources"])) for t in weights["transfers"]) == sorted(
            [(n, ("origin",)) for n in names] + [(n, ("cpu-0",)) for n in names])
        for node in ("cpu-0", "cpu-1"):
            copy = Path(weights["copies"][node])
            assert copy.is_dir() and copy.is_relative_to(tmp_path / "nodes" / node)
            assert {f.name: sha(f) for f in copy.iterdir()} == {n: sha(folder / n) for n in names}

        nested = tmp_path / "registry" / "hf"
        (nested / "sub").mkdir(parents=True)
        (nested / "config.json").write_text("{}")
        (nested / "sub" / "x.bin").write_bytes(b"x")
        hf = ModelRecord("m_hf", "t", "nested", "ir", str(nested), 256, SLO(), 10)
        assert not p.weights.carries(hf)
        (result,) = (await p.scale_out(hf, ["cpu-0"]))["results"]
        assert result["ok"] and result["weights"] == "registry path"
        await p.stop()

    asyncio.run(main())


def test_registration_drops_cached_copies_to_make_room_never_the_last(tmp_path, model_file):
    async def main():
        p = await started(tmp_path, nodes=2, host_bytes=int(1.5 * SIZE))  # host memory for one copy a node
        first = record(model_file, "m_1")
        await p.weights.register(first)
        cached = await p.weights.copy_on(first, "cpu-1")  # a cached copy, no instance
        assert p.weights.pool.host_copies("m_1") == ["cpu-0", "cpu-1"]

        other = tmp_path / "registry" / "other.gguf"
        other.write_bytes(os.urandom(SIZE))
        second = ModelRecord("m_2", "t", "other", "gguf", str(other), 256, SLO(), SIZE)
        node = await p.weights.register(second)  # no room anywhere: the cache on cpu-0 or cpu-1 goes
        assert p.weights.pool.host_copies("m_1") == [n for n in ("cpu-0", "cpu-1") if n != node]
        assert p.weights.pool.host_copies("m_2") == [node]
        dropped = Path(cached.path) if node == "cpu-1" else tmp_path / "nodes" / "cpu-0" / "m_1"
        assert not dropped.exists()

        third = tmp_path / "registry" / "third.gguf"
        third.write_bytes(os.urandom(SIZE))
        with pytest.raises(WeightsError, match="fits in no node's host memory"):  # only last copies left
            await p.weights.register(ModelRecord("m_3", "t", "third", "gguf", str(third), 256, SLO(), SIZE))
        p.weights.pool.check()
        await p.stop()

    asyncio.run(main())


def test_a_target_that_fails_does_not_fail_the_others_and_its_instance_leaves_the_books(tmp_path, model_file):
    """cpu-2's instance is staged (its weights multicast first) and its transfer fails: it
    is gone from the cluster's books, not only from its node's, so deleting the model ends;
    a deleted model once waited for it for ever (the 30-minute soak at 720d5b8: a transfer
    whose source agent was killed)."""
    async def main():
        p = await started(tmp_path, nodes=3)
        m = record(model_file)
        await p.weights.register(m)
        p.agents["cpu-2"].server.weights.token = "another"  # cpu-2's weights port refuses this service
        results = {r["node"]: r for r in (await p.scale_out(m, ["cpu-1", "cpu-2"]))["results"]}
        assert results["cpu-1"]["ok"] and results["cpu-1"]["weights"] == "multicast from cpu-0"
        assert not results["cpu-2"]["ok"] and "cpu-2" in results["cpu-2"]["error"], results
        assert "weights token wrong" in results["cpu-2"]["error"]
        assert sha(p.view()["weights"]["models"][m.uid]["copies"]["cpu-1"]) == sha(model_file)
        assert "cpu-2" not in p.weights.holders(m.uid)
        # the staged start's clean-up runs in the background
        await until(lambda: not any(r.node.node_id == "cpu-2" for r in p.cluster.all_instances()), limit_s=2.0)
        gone = asyncio.Event()
        await p.forget_model(m.uid, gone.set)
        await asyncio.wait_for(gone.wait(), 10)
        assert m.uid not in p.cluster.models
        await p.stop()

    asyncio.run(main())


def test_registration_describes_the_model_on_the_node_that_holds_its_first_host_copy(tmp_path, model_file):
    """Issue 32 item 6: the node that describes a model at its registration (and builds it
    ahead there, on a CPU node) is the one its first host copy went to, not the first node up."""
    async def main():
        class Agent(InProcessAgent):
            weights_root = str(tmp_path / "nodes")

        specs = [NodeSpec(f"cpu-{i}", "cpu", 10**9) for i in range(3)]
        hosts = {"cpu-0": 10**8, "cpu-1": 10**8, "cpu-2": 10**9}  # most free host memory: cpu-2
        plane = WeightsSettings(plan="binomial", block_bytes=1 << 20, token=WEIGHTS_TOKEN)
        p = ClusterControl(specs, ClusterSettings(cold_start_s=0.0), agent_factory=Agent,
                             weights=lambda agents: WeightsPlane(agents, plane, hosts))
        await p.start()
        m = record(model_file)
        p.model_registered(m)
        for _ in range(300):
            if m.uid in p.catalogue.models:
                break
            await asyncio.sleep(0.02)
        assert p.view()["weights"]["models"][m.uid]["host_copies"] == ["cpu-2"]
        assert p.catalogue.models[m.uid].front == "cpu-2"
        assert sorted(p.weights.holders(m.uid)) == ["cpu-2"]  # described where it is: no second copy made
        await p.stop()

    asyncio.run(main())


def test_a_node_whose_agent_is_down_never_takes_a_first_host_copy(tmp_path, model_file):
    """The node the pool would choose (equal free memory: the first by name) is down, its agent
    restarting: the first host copy goes to a node that is up, and the model is served."""
    async def main():
        p = await started(tmp_path, nodes=2)
        await p.agents["cpu-0"].kill()
        await asyncio.sleep(0.05)
        m = record(model_file)
        node, done = await run(p, m, "r1")
        assert p.view()["weights"]["models"][m.uid]["host_copies"] == ["cpu-1"]
        assert node == "cpu-1" and done.tokens_out == 5
        await p.stop()

    asyncio.run(main())
