"""LocalPlacement against an in-process node agent with simulated engines (fast): serving,
queueing behind a full batch, 429 at the deadline, 400 over the context window, keep-alive
recycling, recycling for memory, and a dead agent failing its requests."""
from __future__ import annotations

import asyncio

import pytest

import mesh.service.placement as placement_module
from agent_doubles import InProcessAgent, use_simulated_engines
from engines.protocol import Sampling
from mesh.policy.slo import SLO
from mesh.runtime.node import NodeSpec
from mesh.service.errors import ApiError
from mesh.service.placement import LocalPlacement, PlacementSettings
from mesh.service.registry import ModelRecord
from mesh.service.streams import Finished, Job


@pytest.fixture(autouse=True)
def simulated(monkeypatch):
    use_simulated_engines(monkeypatch)
    monkeypatch.setattr(placement_module, "HOUSEKEEPING_S", 0.1)


def model(uid: str = "m_1", window: int = 256, slo: SLO = SLO()) -> ModelRecord:
    return ModelRecord(uid, "t", f"name-{uid}", "gguf", "/x.gguf", window, slo, 10**6)


def job(rid: str, m: ModelRecord, prompt: int = 20, max_tokens: int = 5) -> Job:
    loop = asyncio.get_running_loop()
    return Job(rid, m, loop.time(), Sampling(max_tokens=max_tokens), prompt_token_ids=list(range(1, prompt + 1)))


async def run_stream(p: LocalPlacement, j: Job) -> Finished:
    stream = await p.submit(j)
    events = [e async for e in stream.events()]
    assert isinstance(events[-1], Finished)
    return events[-1]


async def started(memory: int = 10**9, **settings) -> LocalPlacement:
    p = LocalPlacement([NodeSpec("cpu-0", "cpu", memory)], PlacementSettings(**settings), agent_factory=InProcessAgent)
    await p.start()
    return p


def test_serves_and_queues_behind_a_full_batch():
    async def main():
        p = await started(max_num_seqs=2)
        m = model()
        finished = await asyncio.gather(*(run_stream(p, job(f"r{i}", m, max_tokens=30)) for i in range(5)))
        assert [f.tokens_out for f in finished] == [30] * 5
        view = p.view()["nodes"][0]
        assert view["state"] == "up" and view["instances"][0]["state"] == "ready"
        assert view["instances"][0]["active"] == 0 and view["admission_queue"] == 0
        await p.stop()

    asyncio.run(main())


def test_unplaceable_request_gets_429_and_long_prompt_400():
    async def main():
        p = await started()
        strict = model("m_s", window=64, slo=SLO(ttft_min_s=0.0001, ttft_s_per_prompt_token=0.0))
        with pytest.raises(ApiError) as e:
            await p.submit(job("a", strict, prompt=100))
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
        with pytest.raises(ApiError) as e:
            await p.submit(job("b", strict, prompt=20))
        assert e.value.status == 429 and "own_prefill_late" in e.value.message
        assert p.view()["nodes"][0]["admission_queue"] == 0
        await p.stop()

    asyncio.run(main())


def test_keep_alive_recycles_idle_instances():
    async def main():
        p = await started(keep_alive_s=0.2)
        m = model()
        await run_stream(p, job("a", m))
        assert len(p.instances) == 1
        await asyncio.sleep(0.8)
        assert p.instances == {}
        stats = await p.agents["cpu-0"].client.call({"t": "stats"})
        assert stats["instances"] == []
        assert (await run_stream(p, job("b", m))).tokens_out == 5  # loaded again on demand
        await p.stop()

    asyncio.run(main())


def test_memory_pressure_recycles_the_idle_instance():
    async def main():
        # room for one instance: weights 1 MB + KV for 256 tokens x 1000 B (x 1.2 watermark)
        p = await started(memory=10**6 + 400_000)
        a, b = model("m_a"), model("m_b")
        await run_stream(p, job("a", a))
        await run_stream(p, job("b", b))  # a is idle: unloaded to make room
        assert [i.model.uid for i in p.instances.values()] == ["m_b"]
        await p.stop()

    asyncio.run(main())


def test_dead_agent_fails_running_and_new_requests():
    async def main():
        p = await started(max_num_seqs=1)
        m = model()
        running = await p.submit(job("long", m, max_tokens=10_000))
        queued = asyncio.ensure_future(p.submit(job("queued", m, max_tokens=10_000)))
        await asyncio.sleep(0.1)
        await p.agents["cpu-0"].kill()
        with pytest.raises(ApiError) as e:
            async for _ in running.events():
                pass
        assert e.value.status == 503 and "died" in e.value.message
        with pytest.raises(ApiError) as e:
            await queued
        assert e.value.status == 503
        with pytest.raises(ApiError) as e:
            await p.submit(job("next", m))
        assert e.value.status == 503 and not p.healthy()
        assert p.instances == {}
        await p.agents["cpu-0"].start()  # "restarted": the next request loads again
        assert (await run_stream(p, job("after", m))).tokens_out == 5
        await p.stop()

    asyncio.run(main())


def test_abort_frees_the_instance():
    async def main():
        p = await started(max_num_seqs=1)
        m = model()
        stream = await p.submit(job("a", m, max_tokens=10_000))
        await asyncio.sleep(0.1)
        stream.abort()
        assert (await run_stream(p, job("b", m))).tokens_out == 5  # the batch slot came back
        assert p.instances[next(iter(p.instances))].active == 0
        await p.stop()

    asyncio.run(main())


def test_hugging_face_folders_need_a_gpu_node():
    async def main():
        p = await started()
        hf = ModelRecord("m_hf", "t", "hf", "hf", "/hf", 256, SLO(), 10**6)
        with pytest.raises(ApiError) as e:
            await p.submit(job("a", hf))
        assert e.value.status == 400 and "GPU node" in e.value.message
        await p.stop()

    asyncio.run(main())
