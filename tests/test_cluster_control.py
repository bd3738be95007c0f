"""ClusterControl against in-process node agents with simulated engines (fast): the
service's requests go through the replay's Dispatcher and policies. Serving, waiting behind
a full batch, 429 with the reason and Retry-After, 400 over the context window, keep-alive
recycling making room for another model, a dead agent's stream waiting for it, every policy
serving, and one dispatcher class built the same way by `mesh serve` and `mesh replay`."""
from __future__ import annotations

import asyncio

import pytest

from agent_doubles import InProcessAgent, until, use_simulated_engines
from mesh.engines.engine_api import Sampling
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import SLO
from mesh.service.cluster_control import ClusterControl, ClusterSettings
from mesh.service.errors import ApiError
from mesh.service.registry import ModelRecord
from mesh.service.streams import Finished, Job


@pytest.fixture(autouse=True)
def simulated(monkeypatch):
    use_simulated_engines(monkeypatch)


def model(uid: str = "m_1", window: int = 256, slo: SLO = SLO()) -> ModelRecord:
    return ModelRecord(uid, "t", f"name-{uid}", "gguf", "/x.gguf", window, slo, 10**6)


def job(rid: str, m: ModelRecord, prompt: int = 20, max_tokens: int = 5) -> Job:
    loop = asyncio.get_running_loop()
    return Job(rid, m, loop.time(), Sampling(max_tokens=max_tokens), prompt_token_ids=list(range(1, prompt + 1)))


async def run_stream(p: ClusterControl, j: Job) -> Finished:
    stream = await p.submit(j)
    events = [e async for e in stream.events()]
    assert isinstance(events[-1], Finished)
    return events[-1]


async def started(memory: int = 10**9, **settings) -> ClusterControl:
    settings.setdefault("cold_start_s", 0.0)  # simulated engines load at once
    p = ClusterControl([NodeSpec("cpu-0", "cpu", memory)], ClusterSettings(**settings),
                         agent_factory=InProcessAgent)
    await p.start()
    return p


def test_serves_and_queues_behind_a_full_batch():
    async def main():
        p = await started(max_batch=2)
        m = model()
        finished = await asyncio.gather(*(run_stream(p, job(f"r{i}", m, max_tokens=30)) for i in range(5)))
        assert [f.tokens_out for f in finished] == [30] * 5
        view = p.view()
        node = view["nodes"][0]
        assert node["state"] == "up" and node["instances"][0]["state"] == "ready"
        assert node["instances"][0]["active"] == 0
        d = view["dispatcher"]
        assert d["policy"] == "mesh" and d["waiting"] == 0 and d["placed_by_kind"] == {"cpu": 5}
        assert d["placed_at_arrival"] + d["placed_from_queue"] == 5 and d["placed_from_queue"] >= 1  # 3 waited
        # one maximum batch: the dispatcher's plans (and so validation) and the engine's max_num_seqs
        ref = p.cluster.all_instances()[0]
        on_agent = p.agents["cpu-0"].server.node.instances[ref.instance_id]
        plan = p.cluster.plan(ref.model, ref.node)
        assert plan.max_batch == 2 == on_agent.engine.max_batch
        # O_avg: one mean per model, fed by the agent's completions as a LocalNode's runtime feeds it,
        # and the agent's instance counts with the same mean (6.1)
        assert (plan.mean_output.count, plan.mean_output.value) == (5, 30)
        assert on_agent.memory.mean_output.value == 30
        await p.stop()

    asyncio.run(main())


def test_unplaceable_request_gets_429_and_long_prompt_or_max_tokens_400():
    async def main():
        p = await started()
        strict = model("m_s", window=64, slo=SLO(ttft_min_s=0.0001, ttft_s_per_prompt_token=0.0))
        with pytest.raises(ApiError) as e:
            await p.submit(job("a", strict, prompt=100))
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
        with pytest.raises(ApiError) as e:  # more output than the window leaves: vLLM's and OpenAI's 400
            await p.submit(job("c", strict, prompt=20, max_tokens=45))
        assert e.value.status == 400 and e.value.param == "max_tokens"
        assert "largest value allowed is 44" in e.value.message
        with pytest.raises(ApiError) as e:  # 44 fits: it goes on to placement
            await p.submit(job("b", strict, prompt=20, max_tokens=44))
        assert e.value.status == 429 and "cannot meet its SLO" in e.value.message
        assert int(e.value.headers["Retry-After"]) >= 1
        view = p.view()["dispatcher"]
        assert view["waiting"] == 0 and view["rejected"] == {"cannot meet its SLO": 1}
        await p.stop()

    asyncio.run(main())


def test_a_models_registered_cold_start_choice_decides_a_late_request(monkeypatch):
    """The registration's `cold_start` (ModelRecord.cold_start) reaches the policy: engines
    that load in 1.5 s, a 1 s TTFT. The `serve_late` model's first request is admitted late
    on the instance loading for it and served; the `reject` model's is not, and is turned
    away once it can no longer make its TTFT."""
    import agent_doubles
    import mesh.node.engine_host as agent_engines

    def slow(spec, on_loaded):
        e = agent_doubles.simulated_factory(spec, on_loaded)
        e.load_s = 1.5
        return e

    monkeypatch.setitem(agent_engines.ENGINE_FACTORIES, "openvino", slow)

    async def main():
        p = await started(cold_start_s=1.5)
        slo = SLO(ttft_min_s=1.0, ttft_s_per_prompt_token=0.0, tpot_s=5.0)
        late = model("m_late", slo=slo)
        strict = ModelRecord("m_rej", "t", "name-m_rej", "gguf", "/x.gguf", 256, slo, 10**6, cold_start="reject")
        assert (await run_stream(p, job("a", late))).tokens_out == 5
        assert p.dispatcher.policy.stats.served_late == 1
        with pytest.raises(ApiError) as e:
            await run_stream(p, job("b", strict))
        assert e.value.status == 429 and "cannot meet its SLO" in e.value.message
        assert p.dispatcher.policy.stats.served_late == 1  # not admitted late
        assert p.cluster.cold_start_choice("m_rej") == "reject"
        assert p.cluster.cold_start_choice("m_late") == "serve_late"
        await p.stop()

    asyncio.run(main())


def test_admission_the_services_default_and_a_models_own():
    """The service's default admission `queue` keeps a request that cannot meet its SLO
    waiting up to the queue's bound, then turns it away saying so; a model registered with
    `admission: reject` has its request turned away at once (mesh.policy.dispatch_rules.ADMISSIONS)."""

    async def main():
        p = await started(admission="queue", queue_timeout_s=0.5)
        hopeless = SLO(ttft_min_s=0.0001, ttft_s_per_prompt_token=0.0)
        queued = model("m_q", slo=hopeless)
        strict = ModelRecord("m_r", "t", "name-m_r", "gguf", "/x.gguf", 256, hopeless, 10**6, admission="reject")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ApiError) as e:
            await p.submit(job("a", queued))
        assert loop.time() - t0 >= 0.5 and e.value.status == 429 and "queue timeout" in e.value.message
        assert "admission is 'queue'" in e.value.message and int(e.value.headers["Retry-After"]) >= 1
        with pytest.raises(ApiError) as e:
            await p.submit(job("b", strict))
        assert e.value.status == 429 and "cannot meet its SLO" in e.value.message
        assert "admission is 'reject'" in e.value.message
        assert p.cluster.admission("m_q") == "queue" and p.cluster.admission("m_r") == "reject"
        assert p.view()["dispatcher"]["admission"] == "queue"
        await p.stop()

    asyncio.run(main())


def test_keep_alive_recycles_idle_instances():
    async def main():
        p = await started(keep_alive_s=0.2)
        m = model()
        await run_stream(p, job("a", m))
        assert len(p.cluster.all_instances()) == 1
        await until(lambda: p.cluster.all_instances() == [], 10.0)  # polled: a loaded machine is slower
        for _ in range(100):  # the agent unloads it too
            if (await p.agents["cpu-0"].client.call_message({"t": "stats"}))["instances"] == []:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the agent kept the recycled instance")
        assert (await run_stream(p, job("b", m))).tokens_out == 5  # loaded again on demand
        await p.stop()

    asyncio.run(main())


def test_a_model_waits_for_the_idle_instance_it_needs_the_memory_of():
    async def main():
        # room for one instance: weights 1 MB + KV for 256 tokens x 1000 B (x 1.2 watermark)
        p = await started(memory=10**6 + 400_000, keep_alive_s=0.3)
        a, b = model("m_a"), model("m_b")
        await run_stream(p, job("a", a))
        await run_stream(p, job("b", b))  # waits until a's keep-alive recycles it (LLM-Mesh 4)
        assert [r.model for r in p.cluster.all_instances()] == ["m_b"]
        assert p.view()["dispatcher"]["placed_from_queue"] == 1
        await p.stop()

    asyncio.run(main())


def test_a_dead_agents_stream_waits_for_it_and_new_requests_get_503():
    async def main():
        p = await started(max_batch=1)
        m = model()
        running = await p.submit(job("long", m, max_tokens=236))  # to the window's end (256 - 20)
        await asyncio.sleep(0.3)  # mid-stream (2.4 s in all)
        await p.agents["cpu-0"].kill()
        # its request went back to the dispatcher with its progress: it waits for a node
        assert p.waiting() == 1 and p.dispatcher.requests["long"].outcome is None
        with pytest.raises(ApiError) as e:
            await p.submit(job("next", m))
        assert e.value.status == 503 and "no CPU node agent is up" in e.value.message and not p.healthy()
        assert p.cluster.all_instances() == []
        await p.agents["cpu-0"].start()  # "restarted": the model loads again and the stream goes on there
        events = [ev async for ev in running.events()]
        assert isinstance(events[-1], Finished) and events[-1].tokens_out == 236
        assert p.view()["dispatcher"]["resumed"]["connection"] == 1
        assert (await run_stream(p, job("after", m))).tokens_out == 5
        await p.stop()

    asyncio.run(main())


def test_abort_frees_the_instance():
    async def main():
        p = await started(max_batch=1)
        m = model()
        stream = await p.submit(job("a", m, max_tokens=236))  # to the window's end (256 - 20)
        await asyncio.sleep(0.1)
        stream.abort()
        assert (await run_stream(p, job("b", m))).tokens_out == 5  # the batch slot came back
        assert [r.batch_size for r in p.cluster.all_instances()] == [0]
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


@pytest.mark.parametrize("policy", ["sllm+cpu", "mesh-no-share", "mesh-no-defrag"])
def test_every_cpu_policy_serves(policy):
    async def main():
        p = await started(policy=policy)
        m = model()
        finished = await asyncio.gather(*(run_stream(p, job(f"r{i}", m)) for i in range(3)))
        assert [f.tokens_out for f in finished] == [5] * 3
        assert p.view()["dispatcher"]["policy"] == policy
        await p.stop()

    asyncio.run(main())


def test_serve_and_replay_build_the_same_dispatcher(monkeypatch):
    """One brain: `mesh serve` and `mesh replay` both build Dispatcher.for_policy."""
    from mesh.control.dispatcher import Dispatcher
    from mesh.control.fleet import ClusterConfig
    from mesh.replay.driver import ReplayConfig, build_catalog, run_policy
    from workloads.workload import Arrival, Workload

    built: list[tuple[type, str]] = []
    original = Dispatcher.for_policy.__func__

    def spy(cls, cluster, policy, **queue):
        d = original(cls, cluster, policy, **queue)
        built.append((type(d), type(d.policy).__name__, policy))
        return d

    monkeypatch.setattr(Dispatcher, "for_policy", classmethod(spy))

    async def serve():
        p = await started(policy="sllm+cpu")
        await p.stop()

    asyncio.run(serve())
    workload = Workload([Arrival("r0", 0.0, "f0", "llama-2-7b/f0", 100, 10)], {"llama-2-7b/f0": "llama-2-7b"},
                        {"duration_s": 5.0})
    run = run_policy(workload, "sllm+cpu", ReplayConfig(ClusterConfig(cpu_nodes=1, gpu_nodes=1), progress=False),
                     build_catalog(["llama-2-7b"]))
    assert run.accounting["completed"] == 1
    assert built == [(Dispatcher, "SllmScheduler", "sllm+cpu")] * 2
