"""Emulated nodes (issue 24 item 1): the emulated engine keeps its profile's times, an agent
refuses emulated models unless it emulates, and `mesh serve --emulate` serves emulated models
that the operator registers by catalog name, streamed through the real `openai` client."""
from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import pytest

from mesh.engines.emulated import EmulatedEngine, byte_ids
from mesh.engines.emulation import Emulation, emulated_nodes, emulated_profiles, parse_emulate
from mesh.engines.engine_api import EngineRequest, FinishReason, Sampling
from mesh.perf.load_times import ColdStart
from mesh.perf.model import PerformanceModel
from mesh.perf.profile import catalog_profile
from mesh.policy.batching import IterationKind
from test_service_e2e import ADMIN, Server


def _engine(noise: float, device: str = "xeon-6462c", seed: int = 0) -> EmulatedEngine:
    engine = Emulation(device, noise=noise, seed=seed).engine("i1", "llama-2-7b", "t/m", 2048, 64, 0.0)
    assert isinstance(engine, EmulatedEngine)
    return engine


def _recorded_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds every simulated iteration sleeps (the engine's wall time, without waiting it)."""
    import mesh.engines.simulated as simulated

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(simulated.asyncio, "sleep", sleep)
    return slept


def test_an_emulated_instance_takes_the_catalog_sizes_and_profile_times(monkeypatch):
    profile = catalog_profile("llama-2-7b", "xeon-6462c")
    times = PerformanceModel(profile)
    engine = _engine(noise=0.0)
    assert (engine.weight_bytes, engine.kv_bytes_per_token) == (profile.weight_bytes, profile.kv_bytes_per_token)
    assert engine.context_window == 2048 and engine.max_batch == 64
    slept = _recorded_sleeps(monkeypatch)

    async def main() -> list[Any]:
        engine.add_request(EngineRequest("a", 100, Sampling(max_tokens=5), list(range(100))))
        engine.add_request(EngineRequest("b", 28, Sampling(max_tokens=3), list(range(28))))
        return [await engine.step() for _ in range(5)]

    results = asyncio.run(main())
    assert results[0].kind is IterationKind.PREFILL and list(results[0].request_ids) == ["a", "b"]
    assert slept[0] == pytest.approx(times.prefill_s(128))  # one prefill of both prompts (128 tokens)
    # decodes: batch 2, then 1 once b ended after 3 tokens; context = prompts + tokens so far
    assert slept[1] == pytest.approx(times.decode_s(2, (101 + 29) / 2))
    assert slept[2] == pytest.approx(times.decode_s(2, (102 + 30) / 2))
    assert slept[3] == pytest.approx(times.decode_s(1, 103))
    assert results[2].finished == {"b": FinishReason.LENGTH}  # an emulated model runs to max_tokens
    assert results[4].finished == {"a": FinishReason.LENGTH}
    # every produced token has an id and a text (the agent streams them)
    assert all(r.token_ids is not None and len(r.token_ids) == len(r.request_ids) and all(r.texts) for r in results)


def test_emulated_iteration_times_follow_the_profile_with_the_replays_noise(monkeypatch):
    times = PerformanceModel(catalog_profile("llama-2-7b", "a100-80gb"))
    engine = _engine(noise=0.05, device="a100-80gb", seed=3)
    slept = _recorded_sleeps(monkeypatch)

    async def main() -> None:
        engine.add_request(EngineRequest("a", 16, Sampling(max_tokens=10**4), list(range(16))))
        for _ in range(401):
            await engine.step()

    asyncio.run(main())
    ratios = [s / times.decode_s(1, 17 + i) for i, s in enumerate(slept[1:])]
    assert statistics.mean(ratios) == pytest.approx(1.0, abs=0.015)
    assert 0.035 < statistics.stdev(ratios) < 0.065  # lognormal, sigma 0.05
    assert len(set(ratios)) == len(ratios)  # noisy, not constant


def test_an_emulated_engine_sleeps_on_the_wall_clock():
    engine = _engine(noise=0.0)
    times = PerformanceModel(catalog_profile("llama-2-7b", "xeon-6462c"))

    async def main() -> float:
        engine.add_request(EngineRequest("a", 8, Sampling(max_tokens=100), list(range(8))))
        await engine.step()
        started = time.monotonic()
        for _ in range(3):
            await engine.step()
        return time.monotonic() - started

    wall = asyncio.run(main())
    predicted = sum(times.decode_s(1, 9 + i) for i in range(3))
    assert predicted * 0.95 <= wall < predicted + 0.5


def test_emulate_names_nodes_by_the_kind_their_device_profiles():
    assert parse_emulate("xeon-6462c:2, a100-80gb") == [("xeon-6462c", 2), ("a100-80gb", 1)]
    nodes, devices = emulated_nodes("xeon-6462c:2,a100-80gb:1")
    assert [(n.node_id, n.kind, n.memory_bytes) for n in nodes] == [
        ("cpu-0", "cpu", 256 * 2**30), ("cpu-1", "cpu", 256 * 2**30), ("gpu-0", "gpu", 80 * 2**30)]
    assert devices == {"cpu-0": "xeon-6462c", "cpu-1": "xeon-6462c", "gpu-0": "a100-80gb"}
    with pytest.raises(ValueError):
        parse_emulate("xeon-6462c:zero")
    with pytest.raises(ValueError, match="llama-2-7b"):  # names the models every device profiles
        emulated_profiles("gpt-9", "xeon-6462c:1,a100-80gb:1")
    assert byte_ids("hé") == [104, 195, 169]


def test_emulate_accepts_the_probed_h200_and_h100_with_their_memory_and_host_link():
    """`mesh serve --emulate h200:1,h100:2` (issue 35): GPU nodes with each device's memory,
    its profiles' times, and a cold start at its measured pinned host-to-GPU bandwidth."""
    from mesh.perf.roofline import HARDWARE

    nodes, devices = emulated_nodes("h200:1,h100:2")
    assert [(n.node_id, n.kind, n.memory_bytes) for n in nodes] == [
        ("gpu-0", "gpu", HARDWARE["h200"].memory_bytes), ("gpu-1", "gpu", HARDWARE["h100"].memory_bytes),
        ("gpu-2", "gpu", HARDWARE["h100"].memory_bytes)]
    assert devices == {"gpu-0": "h200", "gpu-1": "h100", "gpu-2": "h100"}
    assert nodes[0].memory_bytes > 139 * 2**30 and nodes[1].memory_bytes < 80 * 2**30
    h200 = PerformanceModel(catalog_profile("llama-2-7b", "h200"))
    h100 = PerformanceModel(catalog_profile("llama-2-7b", "h100"))
    assert h200.decode_s(64, 2048) < h100.decode_s(64, 2048)  # 4.8 against 3.35 TB/s
    engine = Emulation("h200", noise=0.0).engine("i1", "llama-2-7b", "t/m", 2048, 64, None)
    assert engine.load_s == pytest.approx(engine.weight_bytes / 55.3e9)  # 0.24 s, not 25 GB/s's 0.54 s
    assert [p.device for p in emulated_profiles("llama-2-13b", "h200:1,xeon-6462c:1")] == ["h200", "xeon-6462c"]


def test_an_agent_refuses_emulated_models_unless_it_emulates():
    from mesh.control.agent_client import AgentCallError, AgentClient
    from mesh.node.agent_server import AgentServer
    from mesh.policy.node_spec import NodeSpec
    from mesh.wire.agent_protocol import Code, InstanceSpec

    async def main() -> None:
        for emulation in (None, Emulation("xeon-6462c")):
            server = AgentServer(NodeSpec("n0", "cpu", 10**12), "tok", {}, load_roots=["/"], emulation=emulation)
            address = await server.serve("127.0.0.1:0")
            client = AgentClient("n0", lambda _m: None, lambda _r: None)
            try:
                await client.connect(address, "tok")
                spec = InstanceSpec("i1", "t/m", "llama-2-7b", 2048, engine="emulated", profile="emulated:llama-2-7b")
                if emulation is None:
                    with pytest.raises(AgentCallError) as e:
                        await client.call_message(spec.to_message())
                    assert e.value.code == Code.BAD_REQUEST.value and "--emulate" in str(e.value)
                else:
                    reply = await client.call_message(spec.to_message())
                    assert reply["weight_bytes"] == catalog_profile("llama-2-7b", "xeon-6462c").weight_bytes
                    with pytest.raises(AgentCallError) as e:  # and an emulating node runs nothing else
                        await client.call_message(InstanceSpec("i2", "t/x", "/x.gguf", 256).to_message())
                    assert e.value.code == Code.BAD_REQUEST.value
            finally:
                await client.close()
                server.stop()
                await server.close()

    asyncio.run(main())


# ---- `mesh serve --emulate` as a process ------------------------------------------------------

def test_mesh_serve_emulate_streams_emulated_models_at_the_profiles_pace(tmp_path):
    openai = pytest.importorskip("openai")
    server = Server(tmp_path / "data", None, tmp_path / "serve.log", ("--emulate", "xeon-6462c:1,a100-80gb:1"))
    server.start()
    try:
        status, view = server.http("GET", "/admin/cluster", token=ADMIN)
        assert status == 200
        assert sorted((n["node_id"], n["kind"], n["memory"]["capacity_bytes"]) for n in view["nodes"]) == [
            ("cpu-0", "cpu", 256 * 2**30), ("gpu-0", "gpu", 80 * 2**30)]
        assert server.http("POST", "/admin/tenants", {"name": "acme"}, ADMIN)[0] == 201
        key = server.http("POST", "/admin/tenants/acme/keys", {}, ADMIN)[1]["key"]
        body = {"name": "f001", "emulate": "llama-2-7b", "context_length": 2048}
        # the operator's only: a tenant's key is refused on both routes
        assert server.http("POST", "/v1/models", body, key)[0] == 403
        assert server.http("POST", "/admin/tenants/acme/models", body, key)[0] == 401
        status, error = server.http("POST", "/admin/tenants/acme/models", {**body, "emulate": "gpt-9"}, ADMIN)
        assert status == 400 and "llama-2-7b" in error["error"]["message"]
        status, model = server.http("POST", "/admin/tenants/acme/models", body, ADMIN)
        assert status == 201, model
        assert model["mesh"]["kind"] == "emulated" and model["mesh"]["node_kinds"] == ["cpu", "gpu"]
        assert model["mesh"]["weight_bytes"] == catalog_profile("llama-2-7b", "a100-80gb").weight_bytes

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=3, timeout=120)
        arrivals: list[float] = []
        texts: list[str] = []
        finish = usage = None
        stream = client.completions.create(model="f001", prompt="Emulate me, please.", max_tokens=24, stream=True,
                                           stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.text:
                    arrivals.append(time.monotonic())
                    texts.append(choice.text)
                finish = choice.finish_reason or finish
        assert len(texts) == 24 and usage.completion_tokens == 24 and usage.prompt_tokens == 19  # one token a byte
        assert finish == "length"
        # Mesh places on the CPU node first: its decodes take the Xeon profile's time at least
        times = PerformanceModel(catalog_profile("llama-2-7b", "xeon-6462c"))
        floor = sum(times.decode_s(1, 20 + i) for i in range(23))
        gaps = arrivals[-1] - arrivals[0]
        assert gaps >= 0.8 * floor, (gaps, floor)
        assert gaps < 23 * 0.25 + 5.0  # well within the TPOT SLO's pace
        _, view = server.http("GET", "/admin/cluster", token=ADMIN)
        placed = view["dispatcher"]["placed_by_kind"]
        assert placed == {"cpu": 1}
        chat = client.chat.completions.create(model="f001", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.usage.completion_tokens == 4 and chat.choices[0].message.content.strip()
    finally:
        server.stop()
    assert server.proc.returncode == 0


def test_an_emulated_load_takes_the_replays_engine_load_not_the_prediction():
    """Issue 24: an emulated instance's load took the dispatcher's predicted cold start,
    which already counts the initial KV cache allocation that the node runtime then
    performs again (and, once loads are measured, the measured one: each start longer than
    the one before). It takes what the replay's simulated engine takes
    (InstanceSpec.emulated_load_s, Fleet.simulated_load_s), the KV allocation after it."""
    from mesh.control.agent_client import AgentClient
    from mesh.node.agent_server import AgentServer
    from mesh.policy.node_spec import NodeSpec
    from mesh.wire.agent_protocol import InstanceSpec

    async def main() -> list[float]:
        server = AgentServer(NodeSpec("n0", "cpu", 10**12), "tok", {}, load_roots=["/"],
                             emulation=Emulation("xeon-6462c", noise=0.0))
        address = await server.serve("127.0.0.1:0")
        loop = asyncio.get_running_loop()
        ready: dict[str, float] = {}
        client = AgentClient("n0", lambda m: ready.setdefault(m.get("instance_id"), loop.time())
                             if m.get("t") == "instance" and m.get("state") == "ready" else None, lambda _r: None)
        took = []
        try:
            await client.connect(address, "tok")
            for iid, emulated in (("i1", 0.3), ("i2", None)):
                spec = InstanceSpec(iid, "t/m", "llama-3.2-3b", 2048, engine="emulated",
                                    profile="emulated:llama-3.2-3b",
                                    expected_load_s=4.0, emulated_load_s=emulated)
                start = loop.time()
                await client.call_message(spec.to_message())
                for _ in range(400):
                    if iid in ready:
                        break
                    await asyncio.sleep(0.01)
                took.append(ready[iid] - start)
        finally:
            await client.close()
            server.stop()
            await server.close()
        return took

    given, default = asyncio.run(main())
    weights = ColdStart().load_s(catalog_profile("llama-3.2-3b", "xeon-6462c").weight_bytes, "cpu")
    assert 0.3 <= given < 1.5  # the given load and the KV allocation, not the 4 s predicted
    assert weights <= default < weights + 1.2  # without one, ColdStart's load of the weights


def test_emulated_iterations_keep_the_profiles_pace_through_the_nodes_lag():
    """The node's work between two iterations and the loop's lag (here 4 ms of blocking per
    iteration) would add to every emulated iteration, which a replay's virtual time does
    not (issue 24's differential test): back-to-back iterations of a node's engines end
    when the profile says, counted from the first one's start."""
    from mesh.engines.emulated import WallPace

    times = PerformanceModel(catalog_profile("llama-2-7b", "a100-80gb"))

    def run(pace: WallPace | None) -> float:
        engine = _engine(noise=0.0, device="a100-80gb")
        engine.pace = pace

        async def main() -> float:
            engine.add_request(EngineRequest("a", 8, Sampling(max_tokens=100), list(range(8))))
            await engine.step()
            started = time.monotonic()
            for _ in range(20):
                time.sleep(0.004)  # the node's own work, the loop's lag
                await engine.step()
            return time.monotonic() - started

        return asyncio.run(main())

    predicted = sum(times.decode_s(1, 9 + i) for i in range(20))
    assert run(None) >= predicted + 20 * 0.004  # each iteration late by the lag
    assert predicted * 0.97 <= run(WallPace()) < predicted + 0.03  # made up


def test_an_emulated_instance_plans_with_its_profile_and_the_nodes_margin():
    """An emulated engine keeps its profile's times, so its agent learns neither factors nor
    a margin from it (what it would learn is the host's lag: a margin of 5% after 32
    iterations where the replay validates with 10%, the differential test's largest
    divergence); the instance's validation plans as the replay's does."""
    from mesh.control.agent_client import AgentClient
    from mesh.node.agent_server import AgentServer
    from mesh.policy.node_spec import NodeSpec
    from mesh.wire.agent_protocol import AdmitEntry, InstanceSpec

    async def main():
        server = AgentServer(NodeSpec("n0", "gpu", 10**12), "tok", {}, load_roots=["/"],
                             emulation=Emulation("a100-80gb", noise=0.0))
        address = await server.serve("127.0.0.1:0")
        client = AgentClient("n0", lambda _m: None, lambda _r: None)
        try:
            await client.connect(address, "tok")
            spec = InstanceSpec("i1", "t/m", "llama-3.2-3b", 2048, engine="emulated", profile="emulated:llama-3.2-3b",
                                emulated_load_s=0.01)
            await client.call_message(spec.to_message())
            for _ in range(200):
                if server.node.instances["i1"].loaded:
                    break
                await asyncio.sleep(0.01)
            entry = AdmitEntry("r", "i1", list(range(16)), Sampling(max_tokens=80), 0.0, prompt_len=16)
            result = (await client.call_message({"t": "admit", "requests": [entry.to_fields()]}))["results"][0]
            assert result["ok"], result
            for _ in range(500):
                if "r" not in server.requests.requests:
                    break
                await asyncio.sleep(0.01)
            server.connection.flush()  # what the agent learns, it learns at a flush
            return server.host.times["i1"]
        finally:
            await client.close()
            server.stop()
            await server.close()

    times = asyncio.run(main())
    assert times.observed >= 70  # it ran (and saw) its iterations
    assert times.margin is None and times.decode_factor == 1.0 and times.prefill_factor == 1.0


def test_an_emulated_models_base_is_its_catalog_model_so_sllm_uses_the_papers_targets():
    """Issue 24: the service gave each emulated model its own base (its uid), so ServerlessLLM's
    concurrency targets (8.1) were tailored to its profile (30 a CPU instance and 316 a GPU
    one for llama-2-7b) where the replay, whose replicas share the base "llama-2-7b", uses
    the paper's 15 and 32: live sllm+cpu admitted twice the requests per instance and
    scaled out less than its twin. Now every emulated replica's base is its catalog model."""
    from mesh.control.supervisor import AgentSettings
    from mesh.policy.dispatch_rules import CONCURRENCY_TARGETS
    from mesh.policy.slo import SLO
    from mesh.service.cluster_control import ClusterControl, ClusterSettings
    from mesh.service.registry import ModelRecord

    async def main() -> None:
        nodes, devices = emulated_nodes("xeon-6462c:1,a100-80gb:1")
        control = ClusterControl(nodes, ClusterSettings(policy="sllm+cpu", agent=AgentSettings(emulate=devices)))
        await control.start()
        try:
            for uid in ("u-f000", "u-f001"):
                await control.catalogue.described(ModelRecord(uid, "t", uid, "emulated", "llama-2-7b", 4096, SLO()))
                assert control.cluster.models[uid] == "llama-2-7b"
            assert control.dispatcher.policy._targets_of("llama-2-7b") == {
                k: CONCURRENCY_TARGETS[k]["llama-2-7b"] for k in ("cpu", "gpu")}
        finally:
            await control.stop()

    asyncio.run(main())


# ---- the mixed rig: real OpenVINO agents beside an emulated GPU node (issue 31 item 4) ----------

@pytest.mark.slow
def test_the_mixed_rig_serves_a_real_model_on_real_cpu_agents_and_emulated_on_the_gpu_node(tmp_path):
    """`mesh serve --demo --cpu-nodes 2 --emulate a100-80gb:1`: two real OpenVINO agents, each on
    its own cores, and an emulated A100 that runs the demo model emulated from its shape (the
    roofline's profile of its architecture): Mesh places on a real CPU node first, and a
    scale-out to the GPU node starts an emulated instance that streams at the A100's pace."""
    pytest.importorskip("openai")
    from mesh.engines.emulation import Emulation, shape_name
    from mesh.modelfiles.demo import demo_gguf_path
    from mesh.modelfiles.shape import architecture_of

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server = Server(tmp_path / "data", allowed, tmp_path / "serve.log",
                    ("--cpu-nodes", "2", "--emulate", "a100-80gb:1"))
    server.start()
    try:
        view = server.admin("GET", "/admin/cluster")
        nodes = {n["node_id"]: (n["kind"], n.get("emulate")) for n in view["nodes"]}
        assert nodes == {"cpu-0": ("cpu", None), "cpu-1": ("cpu", None), "gpu-0": ("gpu", "a100-80gb")}
        client = server.client()
        chat = client.chat.completions.create(model="demo/smollm2", max_tokens=8,
                                              messages=[{"role": "user", "content": "Say hello."}])
        assert chat.usage.completion_tokens >= 1 and chat.choices[0].message.content.strip()
        view = server.admin("GET", "/admin/cluster")
        assert view["dispatcher"]["placed_by_kind"] == {"cpu": 1}  # CPU first, on a real engine
        served = [n["node_id"] for n in view["nodes"] for i in n["instances"] if i["model"] == "demo/smollm2"]
        assert served and served[0].startswith("cpu-")

        result = server.admin("POST", "/admin/scale", {"tenant": "demo", "model": "demo/smollm2", "nodes": ["gpu-0"]})
        assert result["results"][0]["ok"] and result["results"][0]["weights"] == "emulated", result
        status, listed = server.http("GET", "/v1/models", token=server.key)
        model = next(m for m in listed["data"] if m["id"] == "demo/smollm2")
        assert status == 200 and model["mesh"]["node_kinds"] == ["cpu"]  # no GPU format was made: it is emulated
        gpu = next(n for n in server.admin("GET", "/admin/cluster")["nodes"] if n["node_id"] == "gpu-0")
        profile = Emulation("a100-80gb").profile(shape_name(architecture_of(demo_gguf_path(fetch=False))))
        assert gpu["instances"][0]["weight_bytes"] == profile.weight_bytes  # the roofline's bf16 weights
    finally:
        server.stop()
    assert server.proc.returncode == 0


def test_an_emulated_engine_runs_a_layer_range_at_its_fraction_of_the_time():
    """BlitzScale 5.2 / lambdaScale 4.3: layers [8, 32) of 32 take 3/4 of the profile's
    time, and the range takes in one hop of hidden states (4096 x tokens x 2 bytes)."""
    from mesh.replay.virtual_loop import run_virtual

    times = PerformanceModel(catalog_profile("llama-2-7b", "xeon-6462c"))

    def run(layer_range: tuple[int, int] | None) -> tuple[float, int]:
        engine = _engine(noise=0.0)
        assert engine.runs_layer_ranges and engine.num_layers == 32
        if layer_range is not None:
            engine.set_layer_range(*layer_range)

        async def main() -> float:
            loop = asyncio.get_running_loop()
            engine.add_request(EngineRequest("a", 8, Sampling(max_tokens=100), list(range(8))))
            t0 = loop.time()
            await engine.step()
            await engine.step()
            return loop.time() - t0

        return run_virtual(main()), engine.activation_bytes

    whole, whole_bytes = run(None)
    part, part_bytes = run((8, 32))
    assert whole == pytest.approx(times.prefill_s(8) + times.decode_s(1, 9), rel=1e-6)
    assert part == pytest.approx(whole * 24 / 32, rel=1e-6)
    assert whole_bytes == 0 and part_bytes == 4096 * 2 * (8 + 1)
    with pytest.raises(Exception):
        _engine(noise=0.0).set_layer_range(5, 40)
