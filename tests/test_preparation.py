"""One registration, both kinds of node (issue 11 item 3), fast parts: the registry's
`prepared_formats` table and its schema upgrade, the FormatPreparer with a stand-in
converter (its states, its persistence, deletion), and ClusterControl over a CPU and a GPU
node (in-process agents, simulated engines, real weights receivers): a GGUF registered once
gets a second format that joins the parameter pool, the dispatcher chooses the kind (CPU
under `mesh`, GPU under `sllm`), `scale_out` accepts either kind, and the refusals say why.
The real conversion and the real engines: tests/test_convert.py."""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent_doubles import WEIGHTS_TOKEN, InProcessAgent, simulated_factory, use_simulated_engines
from mesh.control.weights_plane import ModelFormat, WeightsPlane, WeightsSettings
from mesh.engines.engine_api import Sampling
from mesh.modelfiles.formats import Conversion
from mesh.node import engine_host as agent_engines
from mesh.policy.dispatch_rules import InstanceView, sllm_pick
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import SLO
from mesh.service.cluster_control import ClusterControl, ClusterSettings
from mesh.service.errors import ApiError
from mesh.service.preparation import ConversionFailed, ConvertTool, FormatPreparer
from mesh.service.registry import SCHEMA_VERSION, ModelRecord, PreparedFormat, Registry, RegistryError
from mesh.service.streams import Finished, Job

SCHEMA_2 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE tenants (name TEXT PRIMARY KEY, created_at INTEGER NOT NULL DEFAULT 0);
CREATE TABLE api_keys (id TEXT PRIMARY KEY, tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    key_hash TEXT NOT NULL UNIQUE, display TEXT NOT NULL, label TEXT NOT NULL DEFAULT '',
    created_at INTEGER NOT NULL DEFAULT 0, revoked_at INTEGER);
CREATE TABLE models (uid TEXT PRIMARY KEY, tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    name TEXT NOT NULL, kind TEXT NOT NULL, path TEXT NOT NULL, owned_file INTEGER NOT NULL DEFAULT 0, sha256 TEXT,
    weight_bytes INTEGER NOT NULL DEFAULT 0, context_length INTEGER NOT NULL, ttft_min_s REAL NOT NULL,
    ttft_s_per_prompt_token REAL NOT NULL, tpot_s REAL NOT NULL, created_at INTEGER NOT NULL DEFAULT 0,
    sampling_defaults TEXT NOT NULL DEFAULT '{}', UNIQUE (tenant, name));
CREATE TABLE tenant_quotas (tenant TEXT PRIMARY KEY REFERENCES tenants(name) ON DELETE CASCADE, settings TEXT NOT NULL);
INSERT INTO meta VALUES ('schema', '2');
INSERT INTO tenants (name) VALUES ('acme');
INSERT INTO models (uid, tenant, name, kind, path, context_length, ttft_min_s, ttft_s_per_prompt_token, tpot_s)
    VALUES ('m_old', 'acme', 'old', 'gguf', '/models/old.gguf', 2048, 2.0, 0.002, 0.25);
"""


def gguf_record(path: str | Path = "/x.gguf", uid: str = "m_1", tenant: str = "t") -> ModelRecord:
    return ModelRecord(uid, tenant, f"name-{uid}", "gguf", str(path), 256, SLO(), 10**6)


# ---- the registry ---------------------------------------------------------------------------------


def test_prepared_formats_are_stored_per_kind_and_go_with_their_model(tmp_path):
    r = Registry(tmp_path / "r.sqlite3")
    r.create_tenant("acme")
    m = r.add_model(gguf_record(tenant="acme"))
    assert m.prepared == () and m.node_kinds == ("cpu",) and m.path_for("cpu") == "/x.gguf"
    with pytest.raises(KeyError):
        m.path_for("gpu")
    assert r.set_prepared(m.uid, PreparedFormat("gpu", "hf", "/d/prepared/m_1/gpu", "preparing"))
    m = r.model("acme", m.name)
    assert m.node_kinds == ("cpu",) and m.prepared_for("gpu").state == "preparing"
    assert r.set_prepared(m.uid, PreparedFormat("gpu", "hf", "/d/prepared/m_1/gpu", "ready", "", 12345, 3.5))
    ready = r.model("acme", m.name)
    assert ready != m  # the cluster control re-describes a record that changed
    assert ready.node_kinds == ("cpu", "gpu") and ready.path_for("gpu") == "/d/prepared/m_1/gpu"
    assert ready.format_for("gpu") == "hf" and ready.format_for("cpu") == "gguf"
    assert (ready.prepared_for("gpu").weight_bytes, ready.prepared_for("gpu").seconds) == (12345, 3.5)
    assert len(r.prepared(m.uid)) == 1  # one row per kind: updated in place
    assert r.models()[0] == ready == r.model_by_uid(m.uid)
    with pytest.raises(RegistryError):
        PreparedFormat("gpu", "hf", "/p", "done")
    r.delete_model("acme", m.name)
    assert r.prepared(m.uid) == ()
    assert not r.set_prepared(m.uid, PreparedFormat("gpu", "hf", "/p", "ready"))  # deleted meanwhile: refused
    again = r.add_model(gguf_record(uid="m_2", tenant="acme"))
    r.set_prepared(again.uid, PreparedFormat("gpu", "hf", "/p", "failed", "no gguf package"))
    assert r.model_by_uid("m_2").node_kinds == ("cpu",)  # failed: not a kind it runs on
    r.delete_tenant("acme")
    assert r._db.execute("SELECT COUNT(*) FROM prepared_formats").fetchone()[0] == 0
    r.close()


def test_a_schema_2_registry_gains_the_prepared_formats_table_in_place(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(SCHEMA_2)
    db.commit()
    db.close()
    r = Registry(path)
    (old,) = r.models()
    assert (old.uid, old.kind, old.path, old.context_length) == ("m_old", "gguf", "/models/old.gguf", 2048)
    assert old.prepared == () and old.node_kinds == ("cpu",) and old.cold_start == "serve_late"
    assert r._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0] == str(SCHEMA_VERSION)
    assert r.set_prepared("m_old", PreparedFormat("gpu", "hf", "/p", "ready", weight_bytes=7))
    r.close()
    reopened = Registry(path)  # opening a schema-4 file changes nothing
    assert reopened.model("acme", "old").node_kinds == ("cpu", "gpu")
    reopened.close()


def test_sllm_never_picks_an_instance_on_a_kind_it_has_no_target_for():
    cpu = InstanceView("i-cpu", "cpu-0", "cpu", "m", 0, 0)
    gpu = InstanceView("i-gpu", "gpu-0", "gpu", "m", 3, 1)
    assert sllm_pick([cpu, gpu], {"gpu": 4}) is gpu  # the CPU one (an operator's scale-out) is skipped
    assert sllm_pick([cpu], {"gpu": 4}) is None


# ---- the preparer, with a stand-in converter --------------------------------------------------------


class FakeTool(ConvertTool):
    """Writes a small Hugging Face folder instead of converting (or fails, if told to); only
    GGUF -> HF is installed (no export environment for HF -> IR)."""

    def __init__(self, fail: str = "", delay_s: float = 0.0) -> None:
        super().__init__()
        self.fail, self.delay_s = fail, delay_s
        self.runs: list[tuple[str, str]] = []

    def python(self, conversion: Conversion) -> tuple[str | None, str]:
        if conversion.command == "gguf-to-hf":
            return "fake-python", ""
        return None, conversion.missing or "the export extra (optimum-intel) is not installed here"

    async def run(self, conversion: Conversion, python: str, source: str, out: Path, log_path: Path) -> dict[str, Any]:
        self.runs.append((conversion.command, source))
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConversionFailed(self.fail)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
        (out / "model.safetensors").write_bytes(os.urandom(50_000))
        (out / "tokenizer.json").write_text("{}")
        return {"out": str(out), "weight_bytes": 50_000}


def preparer(tmp_path: Path, tool: ConvertTool, kinds: set[str] = frozenset({"cpu", "gpu"})) -> FormatPreparer:
    registry = Registry(tmp_path / "registry.sqlite3")
    if registry.tenant("t") is None:
        registry.create_tenant("t")
    f = FormatPreparer(registry, tmp_path / "data", tool)
    f.kinds = lambda: set(kinds)
    return f


def test_a_gguf_gets_its_gpu_format_once_and_the_state_survives_a_restart(tmp_path):
    async def main():
        gguf = tmp_path / "m.gguf"
        gguf.write_bytes(b"GGUF" + os.urandom(100))
        tool = FakeTool(delay_s=0.05)
        f = preparer(tmp_path, tool)
        ready: list[tuple[str, str]] = []
        f.on_ready = lambda record, kind: ready.append((record.uid, kind))
        m = f.registry.add_model(gguf_record(gguf))
        assert f.view(m)["gpu"]["state"] == "preparing" and f.view(m)["cpu"]["state"] == "ready"
        f.ensure(m)
        f.ensure(m)  # once, however many ask
        await asyncio.sleep(0.01)
        assert f.registry.model_by_uid(m.uid).prepared_for("gpu").state == "preparing"
        await f.wait()
        done = f.registry.model_by_uid(m.uid)
        p = done.prepared_for("gpu")
        assert (p.state, p.format, p.weight_bytes) == ("ready", "hf", 50_000) and p.seconds >= 0.05
        assert Path(p.path) == tmp_path / "data" / "prepared" / m.uid / "gpu" and Path(p.path, "config.json").is_file()
        assert done.node_kinds == ("cpu", "gpu") and ready == [(m.uid, "gpu")]
        assert tool.runs == [("gguf-to-hf", str(gguf))]
        f.ensure(done)
        assert f.view(done)["gpu"] == {"format": "hf", "engine": "vllm", "source": "prepared", "state": "ready",
                                       "reason": "", "weight_bytes": 50_000, "seconds": p.seconds}
        f.registry.close()

        again = preparer(tmp_path, tool)  # a restart: the state is read back, nothing is converted again
        again.ensure_all()
        await again.wait()
        assert tool.runs == [("gguf-to-hf", str(gguf))]
        assert again.registry.model_by_uid(m.uid) == done
        await again.forget(m.uid)
        assert not (tmp_path / "data" / "prepared" / m.uid).exists()
        again.registry.close()

    asyncio.run(main())


def test_the_same_file_registered_twice_is_converted_once(tmp_path):
    """Two models with the same sha256 (a live replay's replicas; one model under two
    tenants): the second gets the first's prepared files as hard links, no conversion, and
    keeps them when the first is deleted. A different file is converted."""
    async def main():
        gguf, other = tmp_path / "m.gguf", tmp_path / "o.gguf"
        gguf.write_bytes(b"GGUF" + os.urandom(100))
        other.write_bytes(b"GGUF" + os.urandom(100))
        tool = FakeTool()
        f = preparer(tmp_path, tool)
        first = f.registry.add_model(replace(gguf_record(gguf, "m_1"), sha256="a" * 64))
        f.ensure(first)
        await f.wait()
        second = f.registry.add_model(replace(gguf_record(gguf, "m_2"), sha256="a" * 64))
        third = f.registry.add_model(replace(gguf_record(other, "m_3"), sha256="b" * 64))
        f.ensure(second)
        f.ensure(third)
        await f.wait()
        assert tool.runs == [("gguf-to-hf", str(gguf)), ("gguf-to-hf", str(other))]
        one, two = (f.registry.model_by_uid(uid).prepared_for("gpu") for uid in ("m_1", "m_2"))
        assert two.state == "ready" and two.weight_bytes == one.weight_bytes == 50_000 and two.path != one.path
        assert Path(two.path, "model.safetensors").stat().st_ino == Path(one.path, "model.safetensors").stat().st_ino
        f.registry.delete_model("t", "name-m_1")
        await f.forget("m_1")
        assert not Path(one.path).exists()
        assert Path(two.path, "model.safetensors").stat().st_size == 50_000 and Path(two.path, "config.json").is_file()
        f.registry.close()

    asyncio.run(main())


def test_a_failed_preparation_says_why_and_is_tried_again_only_after_a_restart(tmp_path):
    async def main():
        tool = FakeTool(fail="converting m.gguf needs gguf in /venv/bin/python; run scripts/setup.sh")
        f = preparer(tmp_path, tool)
        m = f.registry.add_model(gguf_record())
        f.ensure(m)
        await f.wait()
        failed = f.registry.model_by_uid(m.uid)
        assert failed.node_kinds == ("cpu",)
        view = f.view(failed)["gpu"]
        assert view["state"] == "failed" and "needs gguf" in view["reason"]
        f.ensure(failed)
        await f.wait()
        assert len(tool.runs) == 1  # not on every request
        f.registry.close()
        tool.fail = ""
        restarted = preparer(tmp_path, tool)
        restarted.ensure_all()
        await restarted.wait()
        assert len(tool.runs) == 2 and restarted.registry.model_by_uid(m.uid).node_kinds == ("cpu", "gpu")
        restarted.registry.close()

    asyncio.run(main())


def test_what_cannot_be_prepared_stays_on_its_kind_and_says_why(tmp_path):
    async def main():
        f = preparer(tmp_path, FakeTool(), kinds={"cpu"})
        m = f.registry.add_model(gguf_record())
        f.ensure(m)
        await f.wait()
        assert f.view(m)["gpu"] == {"format": "hf", "engine": "vllm", "source": "prepared", "state": "unavailable",
                                    "reason": "this server has no GPU node"}
        ir = f.registry.add_model(ModelRecord("m_ir", "t", "ir", "ir", "/ir", 256, SLO(), 10))
        hf = f.registry.add_model(ModelRecord("m_hf", "t", "hf", "hf", "/hf", 256, SLO(), 10))
        f.kinds = lambda: {"cpu", "gpu"}
        f.ensure_all()
        await f.wait()
        assert f.view(ir)["gpu"]["state"] == "unavailable" and "vLLM" in f.view(ir)["gpu"]["reason"]
        assert f.view(hf)["cpu"]["state"] == "unavailable" and "optimum" in f.view(hf)["cpu"]["reason"]
        assert f.view(hf)["gpu"]["state"] == "ready"
        assert [r for r in f.tool.runs if r[1] != "/x.gguf"] == []  # only the GGUF was converted
        f.enabled = False
        assert "--no-prepare" in f.blocked(m)
        f.registry.close()

    asyncio.run(main())


# ---- the cluster control over a CPU and a GPU node------------------------------------------------------


@pytest.fixture
def loads(monkeypatch) -> list[tuple[str, str, str]]:
    """Simulated engines for both kinds; records (engine, model, path) of every instance loaded."""
    use_simulated_engines(monkeypatch)
    seen: list[tuple[str, str, str]] = []

    def factory(name: str) -> Any:
        def make(spec: Any, on_loaded: Any) -> Any:
            if spec.instance_id != "front":
                seen.append((name, spec.model, spec.path))
            return simulated_factory(spec, on_loaded)
        return make

    for name in ("openvino", "vllm"):
        monkeypatch.setitem(agent_engines.ENGINE_FACTORIES, name, factory(name))
    return seen


async def two_kinds(tmp_path: Path, policy: str = "mesh", tool: ConvertTool | None = None,
                    gpu: bool = True) -> ClusterControl:
    class Agent(InProcessAgent):
        weights_root = str(tmp_path / "nodes")

    specs = [NodeSpec("cpu-0", "cpu", 10**9)] + ([NodeSpec("gpu-0", "gpu", 10**9)] if gpu else [])
    plane = WeightsSettings(plan="binomial", block_bytes=4 << 20, token=WEIGHTS_TOKEN)
    p = ClusterControl(specs, ClusterSettings(policy=policy, cold_start_s=0.0), agent_factory=Agent,
                         weights=lambda agents: WeightsPlane(agents, plane),
                         formats=preparer(tmp_path, tool or FakeTool()))
    await p.start()
    return p


def job(rid: str, m: ModelRecord) -> Job:
    return Job(rid, m, asyncio.get_running_loop().time(), Sampling(max_tokens=4), prompt_token_ids=list(range(1, 11)))


async def serve(p: ClusterControl, m: ModelRecord, rid: str) -> str:
    stream = await p.submit(job(rid, m))
    events = [e async for e in stream.events()]
    assert isinstance(events[-1], Finished) and events[-1].tokens_out == 4
    return stream.node_id


async def registered(p: ClusterControl, tmp_path: Path) -> ModelRecord:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(200_000))
    m = p.formats.registry.add_model(gguf_record(gguf))
    p.model_registered(m)
    await p.formats.wait()
    for _ in range(300):  # the prepared copy's first host copy is placed in the background
        if p.weights.holders(f"{m.uid}.gpu") and p.weights.holders(m.uid):
            break
        await asyncio.sleep(0.01)
    return p.formats.registry.model_by_uid(m.uid)


def test_a_gguf_registered_once_runs_on_either_kind_the_dispatcher_chooses(tmp_path, loads):
    async def main():
        p = await two_kinds(tmp_path)
        m = await registered(p, tmp_path)
        pool = p.weights.view()["models"]
        assert pool[m.uid]["host_copies"] == ["cpu-0"] and pool[m.uid]["node_kind"] == "cpu"
        assert pool[f"{m.uid}.gpu"]["host_copies"] == ["gpu-0"] and pool[f"{m.uid}.gpu"]["native"] is False
        assert pool[f"{m.uid}.gpu"]["files"] == 3  # the prepared folder travels file by file
        assert await serve(p, m, "r1") == "cpu-0"  # mesh: CPU first
        assert loads == [("openvino", m.uid, pool[m.uid]["copies"]["cpu-0"])]
        assert set(p.cluster.catalog[m.uid].profiles) == {"cpu", "gpu"}
        (result,) = (await p.scale_out(m, ["gpu-0"]))["results"]  # an operator's order: any kind it has
        assert result["ok"] and result["weights"] == "host copy", result
        gpu_copy = pool[f"{m.uid}.gpu"]["copies"]["gpu-0"]
        assert loads[-1] == ("vllm", m.uid, gpu_copy)  # the GPU node loads its kind's format, from its own copy
        assert Path(gpu_copy).is_relative_to(tmp_path / "nodes" / "gpu-0")
        assert sorted(Path(gpu_copy).iterdir()) and {f.name for f in Path(gpu_copy).iterdir()} == {
            "config.json", "model.safetensors", "tokenizer.json"}
        await p.forget_model(m.uid)
        assert p.weights.view()["models"] == {}
        assert not (tmp_path / "data" / "prepared" / m.uid).exists()
        assert not Path(gpu_copy).exists()
        await p.stop()

    asyncio.run(main())


def test_sllm_serves_a_gguf_on_the_gpu_node_once_its_format_is_ready(tmp_path, loads):
    async def main():
        p = await two_kinds(tmp_path, policy="sllm", tool=FakeTool(delay_s=0.3))
        gguf = tmp_path / "m.gguf"
        gguf.write_bytes(b"GGUF" + os.urandom(1000))
        m = p.formats.registry.add_model(gguf_record(gguf))
        p.model_registered(m)
        with pytest.raises(ApiError) as e:  # sllm uses GPU nodes only, and the GPU format is being prepared
            await p.submit(job("early", m))
        assert e.value.status == 503 and e.value.code == "model_preparing"
        assert "Hugging Face folder for GPU nodes is being prepared" in e.value.message
        assert int(e.value.headers["Retry-After"]) >= 1
        await p.formats.wait()
        ready = p.formats.registry.model_by_uid(m.uid)
        assert await serve(p, ready, "r1") == "gpu-0"
        assert [engine for engine, _, _ in loads] == ["vllm"]
        assert p.view()["dispatcher"]["placed_by_kind"] == {"gpu": 1}
        await p.stop()

    asyncio.run(main())


def test_refusals_name_the_kind_and_the_format(tmp_path, loads):
    async def main():
        p = await two_kinds(tmp_path, policy="sllm", tool=FakeTool(fail="transformers cannot load m.gguf"))
        m = p.formats.registry.add_model(gguf_record())
        p.model_registered(m)
        await p.formats.wait()
        failed = p.formats.registry.model_by_uid(m.uid)
        with pytest.raises(ApiError) as e:
            await p.submit(job("a", failed))
        assert e.value.status == 400
        assert "GGUF files run on CPU nodes" in e.value.message and "policy sllm does not use" in e.value.message
        assert "its GPU format: failed (transformers cannot load m.gguf)" in e.value.message
        with pytest.raises(ApiError) as e:
            await p.scale_out(failed, ["gpu-0"])
        assert e.value.status == 400 and "its GPU format is failed (transformers cannot load" in e.value.message
        await p.stop()

        cpu_only = await two_kinds(tmp_path / "b", gpu=False)
        hf = ModelRecord("m_hf", "t", "hf", "hf", "/hf", 256, SLO(), 10**6)
        with pytest.raises(ApiError) as e:
            await cpu_only.submit(job("b", hf))
        assert e.value.status == 400 and "Hugging Face folders run on GPU nodes (vllm), and this server has no GPU" \
            in e.value.message and "optimum" in e.value.message
        await cpu_only.stop()

    asyncio.run(main())


def test_model_format_keys_the_pool_per_kind():
    m = ModelRecord("m_9", "t", "n", "gguf", "/m.gguf", 256, SLO(), 1,
                    prepared=(PreparedFormat("gpu", "hf", "/d/prepared/m_9/gpu", "ready"),))
    assert ModelFormat.of(m).key == "m_9" and ModelFormat.of(m, "cpu").path == "/m.gguf"
    gpu = ModelFormat.of(m, "gpu")
    assert (gpu.key, gpu.path, gpu.native, gpu.label) == ("m_9.gpu", "/d/prepared/m_9/gpu", False, "t/n")


# ---- over HTTP: the model views, /admin/scale, deletion ------------------------------------------------


def test_the_model_views_show_each_kinds_format_and_scale_takes_either_kind(tmp_path, loads, demo_gguf):
    import aiohttp
    from aiohttp.test_utils import TestServer

    from mesh.service.app import build_app
    from mesh.service.config import ServeConfig
    from mesh.service.prometheus import ServiceMetrics
    from mesh.service.service_state import Service

    allowed = tmp_path / "allowed"
    (allowed / "acme").mkdir(parents=True)  # the tenant's folder: its paths are relative to it
    (allowed / "acme" / "m.gguf").write_bytes(demo_gguf.read_bytes())
    hf = allowed / "acme" / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    (hf / "model.safetensors").write_bytes(b"x" * 100)

    async def main():
        p = await two_kinds(tmp_path)
        registry = p.formats.registry
        service = Service(ServeConfig(admin_token="adm", allowed_dir=allowed, data_dir=tmp_path / "data"), registry, p,
                          ServiceMetrics(p.view), tmp_path / "data")
        service.idle.set()
        server = TestServer(build_app(service))
        await server.start_server()
        session = aiohttp.ClientSession()

        async def call(method: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
            async with session.request(method, server.make_url(path), json=body,
                                       headers={"Authorization": f"Bearer {token}"}) as r:
                return r.status, await r.json(content_type=None)

        try:
            await call("POST", "/admin/tenants", "adm", {"name": "acme"})
            key = (await call("POST", "/admin/tenants/acme/keys", "adm"))[1]["key"]
            status, body = await call("POST", "/v1/models", key, {"name": "m", "path": "m.gguf"})
            assert status == 201 and body["mesh"]["node_kinds"] == ["cpu"], body
            assert body["mesh"]["formats"]["gpu"]["state"] == "preparing"
            await p.formats.wait()
            status, body = await call("GET", "/v1/models/m", key)
            assert body["mesh"]["node_kinds"] == ["cpu", "gpu"]
            assert body["mesh"]["formats"]["gpu"]["state"] == "ready"
            (listed,) = (await call("GET", "/admin/models", "adm"))[1]["data"]
            assert listed["mesh"]["formats"] == body["mesh"]["formats"]
            status, scaled = await call("POST", "/admin/scale", "adm", {"tenant": "acme", "model": "m",
                                                                       "nodes": ["cpu-0", "gpu-0"]})
            assert status == 200 and [r["ok"] for r in scaled["results"]] == [True, True], scaled
            assert sorted(engine for engine, _, _ in loads) == ["openvino", "vllm"]
            uid = registry.model("acme", "m").uid
            assert (tmp_path / "data" / "prepared" / uid / "gpu").is_dir()
            assert (await call("DELETE", "/v1/models/m", key))[0] == 200
            assert not (tmp_path / "data" / "prepared" / uid).exists() and registry.prepared(uid) == ()
        finally:
            await session.close()
            await server.close()
            await p.stop()

        cpu_only = await two_kinds(tmp_path / "b", gpu=False)
        service = Service(ServeConfig(admin_token="adm", allowed_dir=allowed, data_dir=tmp_path / "b"),
                          cpu_only.formats.registry, cpu_only, ServiceMetrics(cpu_only.view), tmp_path / "b")
        server = TestServer(build_app(service))
        await server.start_server()
        session = aiohttp.ClientSession()
        try:
            await call("POST", "/admin/tenants", "adm", {"name": "acme"})
            key = (await call("POST", "/admin/tenants/acme/keys", "adm"))[1]["key"]
            status, body = await call("POST", "/v1/models", key, {"name": "hf", "path": "hf"})
            assert status == 400 and body["error"]["code"] == "unsupported_model_format"
            message = body["error"]["message"]
            assert "runs on GPU nodes (vllm), and this server has none" in message
            assert "its CPU format cannot be prepared" in message and "optimum-cli export openvino" in message
        finally:
            await session.close()
            await server.close()
            await cpu_only.stop()

    asyncio.run(main())


def test_each_kind_of_node_gets_its_own_calibration_profile(tmp_path):
    from mesh.perf.profile import save_profile
    from mesh.perf.times import prior_profile

    async def main():
        profiles = tmp_path / "profiles"
        profiles.mkdir()
        save_profile(prior_profile("m_1", "cpu", 10**6, 1000, 256), profiles / "m_1.json")
        p = ClusterControl([NodeSpec("cpu-0", "cpu", 10**9), NodeSpec("gpu-0", "gpu", 10**9)],
                             ClusterSettings(profile_dir=str(profiles)), agent_factory=InProcessAgent)
        assert p.catalogue.profile_for("m_1", "cpu") == str(profiles / "m_1.json")
        assert p.catalogue.profile_for("m_1", "gpu") is None  # a CPU profile never plans a GPU instance
        save_profile(prior_profile("m_1", "gpu", 10**6, 1000, 256), profiles / "m_1.gpu.json")
        assert p.catalogue.profile_for("m_1", "gpu") == str(profiles / "m_1.gpu.json")
        assert p.catalogue.profile_for("m_1", "cpu") == str(profiles / "m_1.json")
        assert p.catalogue.profile_for("m_2", "cpu") is None

    asyncio.run(main())
