"""The node agent and its client over a real loopback connection, in one process, with a
simulated engine (fast): hello and its token, load -> instance ready, tokenize refusals,
batched admission keeping arrival order, done events, abort, stats, unload, and what
happens when the connection goes away."""
from __future__ import annotations

import asyncio

import pytest

from agent_doubles import TOKEN, use_simulated_engines
from mesh.control.agent_client import AgentCallError, AgentClient, AgentDown
from mesh.engines.engine_api import Sampling
from mesh.node.agent_server import AgentServer
from mesh.policy.node_spec import NodeSpec
from mesh.wire.agent_protocol import Abort, Code, Describe, InstanceSpec, Stats, WeightsPath, sampling_to_dict


@pytest.fixture
def simulated(monkeypatch):
    use_simulated_engines(monkeypatch)


async def _start(memory: int = 10**9, roots: tuple[str, ...] = ("/",)) -> tuple[AgentServer, str]:
    server = AgentServer(NodeSpec("n0", "cpu", memory), TOKEN, {"cores": 2}, load_roots=roots)
    address = await server.serve("127.0.0.1:0")
    return server, address


def _entry(rid: str, iid: str, prompt: int = 20, max_tokens: int = 5) -> dict:
    return {"request_id": rid, "instance_id": iid, "prompt_token_ids": list(range(1, prompt + 1)),
            "sampling": sampling_to_dict(Sampling(max_tokens=max_tokens)), "age_s": 0.0}


def test_agent_serves_requests_over_the_protocol(simulated):
    async def main():
        server, address = await _start()
        events: list[dict] = []
        closed: list[str] = []
        client = AgentClient("n0", events.append, closed.append)
        info = await client.connect(address, TOKEN)
        assert info.node_id == "n0" and info.memory_bytes == 10**9 and info.instances == []
        assert info.deadlines == "eq1"  # the service's default deadline rule (mesh.policy.slo)

        spec = InstanceSpec("i1", "m", "/nowhere", 256, engine="simulated", max_num_seqs=2)
        reply = await client.call_message(spec.to_message())
        assert reply["context_window"] == 256
        with pytest.raises(AgentCallError) as e:
            await client.call_message({"t": "tokenize", "instance_id": "i1", "prompt": "x"})
        assert e.value.code == Code.NOT_READY.value and e.value.retryable
        for _ in range(100):
            if any(ev["t"] == "instance" for ev in events):
                break
            await asyncio.sleep(0.01)
        assert {"t": "instance", "instance_id": "i1", "state": "ready"} in events

        # three requests, max batch 2: the third is refused (retryable), order kept
        reply = await client.call_message({"t": "admit", "requests": [_entry("a", "i1"), _entry("b", "i1",
                                                                                                max_tokens=10**4),
                                                               _entry("c", "i1"), _entry("d", "nope")]})
        codes = [r.get("code") if not r["ok"] else "ok" for r in reply["results"]]
        assert codes == ["ok", "ok", Code.BATCH_FULL.value, Code.NO_INSTANCE.value]
        with pytest.raises(AgentCallError) as e:
            await client.call_message({"t": "unload", "instance_id": "i1"})
        assert e.value.code == Code.BUSY.value
        await asyncio.sleep(0.1)  # b decodes (the simulated engine cannot abort inside a prefill)
        client.send(Abort("b"))
        for _ in range(200):
            if sum(ev["t"] == "done" for ev in events) == 2:
                break
            await asyncio.sleep(0.01)
        done = {ev["request_id"]: ev for ev in events if ev["t"] == "done"}
        assert done["a"]["outcome"] == "completed" and done["a"]["tokens_out"] == 5
        assert done["b"]["outcome"] == "failed" and "aborted" in done["b"]["detail"]
        stats = await client.call_message({"t": "stats"})
        assert stats["running"] == 0 and stats["iterations"] > 0 and stats["instances"][0]["loaded"]
        assert stats["memory"]["capacity_bytes"] == 10**9 and stats["memory"]["budget_bytes"] > 10**6
        await client.call_message({"t": "unload", "instance_id": "i1"})
        assert (await client.call_message({"t": "stats"}))["instances"] == []
        with pytest.raises(AgentCallError) as e:
            await client.call_message({"t": "bogus"})
        assert e.value.code == Code.PROTOCOL.value
        await client.close()
        assert closed
        await server.close()

    asyncio.run(main())


def test_agent_refuses_a_wrong_token_and_a_load_over_memory(simulated):
    async def main():
        server, address = await _start(memory=10**6 + 1000)
        bad = AgentClient("n0", lambda m: None, lambda r: None)
        with pytest.raises((AgentDown, AgentCallError)):
            await bad.connect(address, "wrong")
        client = AgentClient("n0", lambda m: None, lambda r: None)
        await client.connect(address, TOKEN)
        with pytest.raises(AgentCallError) as e:
            await client.call_message(InstanceSpec("i1", "m", "/x", 256, engine="simulated").to_message())
        assert e.value.code == Code.MEMORY.value and e.value.failure.shortfall_bytes > 0
        with pytest.raises(AgentCallError) as e:
            await client.call_message(InstanceSpec("i2", "m", "/x", 256, engine="unknown").to_message())
        assert e.value.code == Code.BAD_REQUEST.value
        await client.close()
        await server.close()

    asyncio.run(main())


def test_lost_connection_aborts_requests_and_fails_calls(simulated):
    async def main():
        server, address = await _start()
        events: list[dict] = []
        closed: list[str] = []
        client = AgentClient("n0", events.append, closed.append)
        await client.connect(address, TOKEN)
        await client.call_message(InstanceSpec("i1", "m", "/x", 256, engine="simulated").to_message())
        await asyncio.sleep(0.2)
        reply = await client.call_message({"t": "admit", "requests": [_entry("a", "i1", max_tokens=10_000)]})
        assert reply["results"][0]["ok"]
        await asyncio.sleep(0.05)
        assert server.requests.requests  # running
        await client.close()
        await asyncio.sleep(0.1)
        assert not server.requests.requests  # the agent aborted it when the control connection went away
        with pytest.raises(AgentDown):
            await client.call_message({"t": "ping"})
        # the server side closing: the client notices at once
        client2 = AgentClient("n0", lambda m: None, closed.append)
        await client2.connect(address, TOKEN)
        await server.close()
        server.connection.writer.close() if server.connection.writer else None
        for _ in range(100):
            if not client2.up:
                break
            await asyncio.sleep(0.01)
        assert not client2.up and len(closed) == 2

    asyncio.run(main())


def test_load_opens_only_files_inside_the_agents_model_folders(simulated, tmp_path):
    async def main():
        root = tmp_path / "models"
        root.mkdir()
        (root / "m.gguf").write_bytes(b"GGUF")
        outside = tmp_path / "secret.gguf"
        outside.write_bytes(b"GGUF")
        (root / "link.gguf").symlink_to(outside)
        server, address = await _start(roots=(str(root),))
        client = AgentClient("n0", lambda m: None, lambda r: None)
        await client.connect(address, TOKEN)
        for i, path in enumerate((outside, root / ".." / "secret.gguf", root / "link.gguf", "/etc/passwd")):
            with pytest.raises(AgentCallError) as e:
                await client.call_message(InstanceSpec(f"x{i}", "m", str(path), 256, engine="simulated").to_message())
            assert e.value.code == Code.BAD_REQUEST.value and "outside this agent's model folders" in str(e.value)
            assert "--models-root" in str(e.value)
        reply = await client.call_message(InstanceSpec("ok", "m", str(root / "m.gguf"), 256,
                                                       engine="simulated").to_message())
        assert reply["context_window"] == 256
        assert set(server.node.instances) == {"ok"}
        await client.close()
        await server.close()

    asyncio.run(main())


def test_a_handler_exception_fails_that_call_only(simulated):
    """A bug in a handler (injected: `stats` and an async `weights_path` raise) answers that
    call `failed`; the connection stays up and a request that was decoding finishes."""
    async def main():
        server, address = await _start()
        events: list[dict] = []
        closed: list[str] = []
        client = AgentClient("n0", events.append, closed.append)
        await client.connect(address, TOKEN)
        await client.call_message(InstanceSpec("i1", "m", "/x", 256, engine="simulated").to_message())
        for _ in range(100):
            if any(ev["t"] == "instance" for ev in events):
                break
            await asyncio.sleep(0.01)
        reply = await client.call_message({"t": "admit", "requests": [_entry("long", "i1", max_tokens=60)]})
        assert reply["results"][0]["ok"]
        await asyncio.sleep(0.05)

        def broken(message):
            raise KeyError("injected bug")

        async def broken_async(message):
            await asyncio.sleep(0)
            raise RuntimeError("injected async bug")

        server.connection.handlers[Stats] = broken
        server.connection.handlers[WeightsPath] = broken_async
        for request, what in ((Stats(), "KeyError"), (WeightsPath("m", "f"), "RuntimeError")):
            with pytest.raises(AgentCallError) as e:
                await client.call(request)
            assert e.value.code == Code.FAILED.value and what in str(e.value)
        assert client.up and not closed
        assert "long" in server.requests.requests and not any(ev["t"] == "done" for ev in events)  # still decoding
        assert await client.call_message({"t": "ping"}) is not None
        reply = await client.call_message({"t": "admit", "requests": [_entry("after", "i1", max_tokens=5)]})
        assert reply["results"][0]["ok"]
        for _ in range(500):
            if {ev["request_id"] for ev in events if ev["t"] == "done"} >= {"long", "after"}:
                break
            await asyncio.sleep(0.01)
        done = {ev["request_id"]: ev for ev in events if ev["t"] == "done"}
        assert done["long"]["outcome"] == "completed" and done["long"]["tokens_out"] == 60
        assert done["after"]["outcome"] == "completed"
        await client.close()
        await server.close()

    asyncio.run(main())


def test_exact_moves_reach_the_openvino_engine_as_its_exact_numerics(demo_gguf):
    """`mesh serve --exact-moves` travels in the load message and becomes the engine's
    EXACT_RECOMPUTE properties (an f16 KV cache: more bytes per token than the default u8);
    both run with OpenVINO's thread pinning off."""
    from mesh.engines.openvino_engine import EXACT_RECOMPUTE
    from mesh.node.engine_host import make_engine

    spec = InstanceSpec("i1", "m", str(demo_gguf), exact_moves=True)
    assert InstanceSpec.from_message(spec.to_message()).exact_moves is True
    assert InstanceSpec.from_message({**spec.to_message(), "exact_moves": None}).exact_moves is False
    exact = make_engine(spec, lambda _exc: None)
    default = make_engine(InstanceSpec("i2", "m", str(demo_gguf)), lambda _exc: None)
    unpinned = {"ENABLE_CPU_PINNING": False}  # engine_host: threads free to move on shared cores
    assert exact.front.properties == {**EXACT_RECOMPUTE, **unpinned} and default.front.properties == unpinned
    assert exact.kv_bytes_per_token > default.kv_bytes_per_token


def test_openvino_prompts_are_tokenized_in_the_agents_tokenizer_process(demo_gguf):
    """`tokenize` by path (before any instance) gives the model's own ids, built in the agent's
    tokenizer process: this process builds no tokenizer (building one holds the GIL for
    seconds, which would stall the agent's event loop). A bad chat message is a clear 400-style
    refusal, and the process goes on serving."""
    from mesh.engines.openvino_engine import OpenVINOEngine, standalone_encoder

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    by_path = {"t": "tokenize", "model": "m", "path": str(demo_gguf), "engine": "openvino"}

    async def main():
        server, address = await _start(roots=(str(demo_gguf.parent),))
        client = AgentClient("n0", lambda _ev: None, lambda _why: None)
        await client.connect(address, TOKEN)
        chat = (await client.call_message({**by_path, "messages": messages}))["ids"]
        plain = (await client.call_message({**by_path, "prompt": "Hello"}))["ids"]
        with pytest.raises(AgentCallError) as e:
            await client.call_message({**by_path, "messages": [{"role": "user"}]})
        again = (await client.call_message({**by_path, "messages": messages}))["ids"]
        await client.close()
        await server.close()
        return chat, plain, e.value, again

    standalone_encoder.cache_clear()
    chat, plain, refusal, again = asyncio.run(main())
    assert standalone_encoder.cache_info().currsize == 0  # built elsewhere
    reference = OpenVINOEngine(demo_gguf)
    assert chat == again == reference.encode_chat(messages) and plain == reference.encode_prompt("Hello")
    assert refusal.code == Code.BAD_REQUEST.value and "content" in str(refusal)


def test_a_model_described_here_gets_its_tokenizer_built_in_the_background(demo_gguf):
    """Registration describes a model on a node: its OpenVINO tokenizer is built then, in the
    background, not in the TTFT of its first requests (seconds on a cold node, issue 23)."""
    built: list[str] = []

    class Tokenizers:
        async def prepare(self, path: str) -> None:
            built.append(path)

    async def main() -> None:
        server = AgentServer(NodeSpec("n0", "cpu", 10**9), TOKEN, {"cores": 2}, load_roots=[str(demo_gguf.parent)])
        server.models.tokenizers = Tokenizers()
        m = Describe("smol", str(demo_gguf), "openvino")
        front = await server.models.front(m)
        assert await server.models.front(m) is front  # described once
        await asyncio.sleep(0)
        assert built == [str(demo_gguf)]

    asyncio.run(main())
