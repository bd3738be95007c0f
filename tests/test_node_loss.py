"""A lost node costs its requests nothing but time (fast: in-process agents, simulated engines
whose tokens are a function of the sequence so far, mesh.control.agent_node `lose`): every
request the node held goes back to the dispatcher with the progress the service saw, is
placed again, and its stream goes on from the next token, with no token lost or repeated
and max_tokens counted from the start; the same whether the agent's connection dropped or
the node left the cluster; one no node takes within the queue timeout ends with one error
event, and the dispatcher counts both by cause."""
from __future__ import annotations

import asyncio

import pytest

import agent_doubles
from agent_doubles import InProcessAgent, expected_tokens, until, use_sequence_engines
from mesh.engines.engine_api import Sampling
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import SLO
from mesh.service.cluster_control import ClusterControl, ClusterSettings
from mesh.service.errors import ApiError
from mesh.service.registry import ModelRecord
from mesh.service.streams import Finished, Job, RequestStream, Tokens

PROMPT = list(range(1, 21))
SLO_LOOSE = SLO(ttft_min_s=5.0, tpot_s=0.5)


@pytest.fixture(autouse=True)
def engines(monkeypatch):
    use_sequence_engines(monkeypatch)


def model() -> ModelRecord:
    return ModelRecord("m_1", "t", "name-m_1", "gguf", "/x.gguf", 256, SLO_LOOSE, 10**6)


def job(rid: str, m: ModelRecord, max_tokens: int) -> Job:
    return Job(rid, m, asyncio.get_running_loop().time(), Sampling(max_tokens=max_tokens, ignore_eos=True),
               prompt_token_ids=list(PROMPT))


async def started(nodes: int, **settings) -> ClusterControl:
    settings.setdefault("cold_start_s", 0.0)  # simulated engines load at once
    p = ClusterControl([NodeSpec(f"cpu-{i}", "cpu", 10**9) for i in range(nodes)], ClusterSettings(**settings),
                         agent_factory=InProcessAgent)
    await p.start()
    return p


class Reader:
    """One stream read to its end: its token ids, its text, how it ended."""

    def __init__(self, stream: RequestStream) -> None:
        self.ids: list[int] = []
        self.text = ""
        self.end: Finished | ApiError | None = None
        self.task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: RequestStream) -> None:
        try:
            async for event in stream.events():
                if isinstance(event, Tokens):
                    self.ids += event.token_ids
                    self.text += event.text
                else:
                    self.end = event
        except ApiError as exc:
            self.end = exc


def serving_node(p: ClusterControl) -> str:
    (node,) = {r.node.node_id for r in p.cluster.all_instances() if r.requests}
    return node


@pytest.mark.parametrize("how", ["connection", "removed"])
def test_a_lost_nodes_streams_go_on_elsewhere_from_the_next_token(how):
    """Eight streams on one node; its agent's connection drops (a killed agent, a network
    gone) or the node leaves the cluster (a Ray node removed) mid-stream: every stream ends
    with exactly its max_tokens, the tokens an undisturbed run gives (none lost or repeated),
    and the dispatcher counts eight resumed by that cause."""
    async def main():
        p = await started(2)
        m = model()
        await p.scale_out(m, ["cpu-0", "cpu-1"])
        readers = [Reader(await p.submit(job(f"r{i}", m, max_tokens=120))) for i in range(8)]
        await until(lambda: all(len(r.ids) >= 10 for r in readers), 30.0)
        node = serving_node(p)  # reactive defragmentation (7.2): one instance takes them all
        assert all(len(r.ids) < 120 for r in readers)
        if how == "connection":
            await p.agents[node].kill()
        else:
            await p.remove_node(node, "test")
        await asyncio.wait_for(asyncio.gather(*(r.task for r in readers)), 60.0)
        want = expected_tokens(PROMPT, 120)
        for r in readers:
            assert isinstance(r.end, Finished) and r.end.tokens_out == 120, r.end
            assert r.ids == want and r.text == "".join(f"{t} " for t in want)
        d = p.view()["dispatcher"]
        assert d["lost"][how] == 8 and d["resumed"][how] == 8 and sum(d["lost_failed"].values()) == 0
        assert d["failed"] == {} and d["rejected"] == {}
        await p.stop()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["connection", "removed"])
def test_a_lost_nodes_streams_wait_for_a_cold_start_on_a_node_that_holds_no_instance(how, monkeypatch):
    """The survivor holds no instance of the model (never loaded there, or recycled at
    keep-alive): the lost streams wait for a cold start there, longer than their TTFT slack
    (SERVE_LATE for a lost request), and go on from the next token. The node that left was the
    one whose agent described the model: the lost requests still load it (nothing waits for a
    new request to describe it again)."""
    slow = agent_doubles.sequence_factory

    def slow_loading(spec, on_loaded):
        engine = slow(spec, on_loaded)
        engine.load_s = 1.5  # a real wait, past the 1 s TTFT
        return engine

    for name in ("simulated", "openvino"):
        monkeypatch.setitem(agent_doubles.agent_engines.ENGINE_FACTORIES, name, slow_loading)

    async def main():
        p = await started(2, keep_alive_s=1.0, cold_start_s=3.0)
        m = ModelRecord("m_1", "t", "name-m_1", "gguf", "/x.gguf", 256, SLO(ttft_min_s=1.0, tpot_s=0.5), 10**6)
        await p.scale_out(m, ["cpu-0"])  # warm on one node only
        readers = [Reader(await p.submit(job(f"r{i}", m, max_tokens=60))) for i in range(8)]
        await until(lambda: all(len(r.ids) >= 5 for r in readers), 30.0)
        assert serving_node(p) == "cpu-0" and not p.cluster.node("cpu-1").instances
        if how == "connection":
            await p.agents["cpu-0"].kill()
        else:
            await p.remove_node("cpu-0", "test")
        await asyncio.wait_for(asyncio.gather(*(r.task for r in readers)), 60.0)
        want = expected_tokens(PROMPT, 60)
        for r in readers:
            assert isinstance(r.end, Finished) and r.end.tokens_out == 60 and r.ids == want, r.end
        d = p.view()["dispatcher"]
        assert d["resumed"][how] == 8 and sum(d["lost_failed"].values()) == 0 and d["failed"] == {}, d
        await p.stop()

    asyncio.run(main())


def test_a_request_lost_before_its_first_token_past_its_ttft_gets_a_new_instance(monkeypatch):
    """A load runs longer than predicted (0.2 s predicted, 1.5 s real: a loaded machine), so
    its node is lost after the requests' TTFT passed and before their first token. On the
    survivor the predicted cold start fits a fresh request's slack, but not theirs, which is
    spent: an instance starts for them anyway, and they are served late, not timed out in
    the queue."""
    slow = agent_doubles.sequence_factory

    def slow_loading(spec, on_loaded):
        engine = slow(spec, on_loaded)
        engine.load_s = 1.5
        return engine

    for name in ("simulated", "openvino"):
        monkeypatch.setitem(agent_doubles.agent_engines.ENGINE_FACTORIES, name, slow_loading)

    async def main():
        p = await started(2, keep_alive_s=1.0, cold_start_s=0.2, queue_timeout_s=10.0)
        m = ModelRecord("m_1", "t", "name-m_1", "gguf", "/x.gguf", 256, SLO(ttft_min_s=1.0, tpot_s=0.5), 10**6)
        readers = [Reader(await p.submit(job(f"r{i}", m, max_tokens=20))) for i in range(3)]
        await asyncio.sleep(1.2)  # past the TTFT, the load not done
        (loading,) = {r.node.node_id for r in p.cluster.all_instances()}
        assert all(not r.ids for r in readers)
        await p.agents[loading].kill()
        await asyncio.wait_for(asyncio.gather(*(r.task for r in readers)), 30.0)
        want = expected_tokens(PROMPT, 20)
        for r in readers:
            assert isinstance(r.end, Finished) and r.ids == want, r.end
        d = p.view()["dispatcher"]
        assert d["resumed"]["connection"] == 3 and d["failed"] == {}, d
        await p.stop()

    asyncio.run(main())


def test_an_agent_lost_while_it_tokenizes_costs_a_second_tokenize_not_the_request(monkeypatch):
    """The agent tokenizing a new request's prompt dies before it answers: the model is
    described again on the agent that is up, which tokenizes, and the request is served."""
    from mesh.node.model_fronts import ModelFronts
    from mesh.wire.agent_protocol import TokenizeReply

    asked: list[str] = []

    async def tokenize(self, m):
        asked.append(self.host.spec.node_id)
        if len(asked) == 1:
            await asyncio.Event().wait()  # never answers: its agent is killed meanwhile
        return TokenizeReply(list(PROMPT))

    monkeypatch.setattr(ModelFronts, "tokenize", tokenize)

    async def main():
        p = await started(2)
        m = model()
        first = asyncio.ensure_future(p.submit(Job("r0", m, asyncio.get_running_loop().time(),
                                                   Sampling(max_tokens=10, ignore_eos=True), prompt="hello")))
        await until(lambda: len(asked) == 1, 10.0)
        await p.agents[asked[0]].kill()
        reader = Reader(await asyncio.wait_for(first, 20.0))
        await asyncio.wait_for(reader.task, 20.0)
        assert isinstance(reader.end, Finished) and reader.ids == expected_tokens(PROMPT, 10), reader.end
        assert len(asked) == 2 and asked[0] != asked[1], asked
        await p.stop()

    asyncio.run(main())


def test_a_single_nodes_streams_wait_for_its_agent_to_come_back():
    """A lost request may go back to the node that lost it (a restarted agent), so a
    single-node service loses no stream to an agent restart."""
    async def main():
        p = await started(1)
        m = model()
        readers = [Reader(await p.submit(job(f"r{i}", m, max_tokens=60))) for i in range(3)]
        await until(lambda: all(len(r.ids) >= 5 for r in readers), 30.0)
        await p.agents["cpu-0"].kill()
        await asyncio.sleep(0.3)  # down for a while: the requests wait in the dispatcher's queue
        assert all(r.end is None for r in readers) and p.waiting() == 3
        await p.agents["cpu-0"].start()  # "restarted": the next placement loads the model again
        await asyncio.wait_for(asyncio.gather(*(r.task for r in readers)), 60.0)
        want = expected_tokens(PROMPT, 60)
        assert all(isinstance(r.end, Finished) and r.ids == want for r in readers)
        assert p.view()["dispatcher"]["resumed"]["connection"] == 3
        await p.stop()

    asyncio.run(main())


def test_a_lost_request_no_node_takes_in_time_ends_with_one_error_event():
    async def main():
        p = await started(1, queue_timeout_s=0.5)
        m = model()
        reader = Reader(await p.submit(job("r", m, max_tokens=200)))
        await until(lambda: len(reader.ids) >= 5, 30.0)
        await p.agents["cpu-0"].kill()  # and it does not come back
        await asyncio.wait_for(reader.task, 10.0)
        assert isinstance(reader.end, ApiError) and reader.end.status == 503
        assert "its node was lost (connection)" in reader.end.message and "Retry" in reader.end.message
        assert reader.ids == expected_tokens(PROMPT, len(reader.ids))  # what it streamed before was right
        d = p.view()["dispatcher"]
        assert d["lost"]["connection"] == 1 and d["lost_failed"]["connection"] == 1 and d["resumed"]["connection"] == 0
        assert d["failed"] == {"queue timeout": 1}
        await p.stop()

    asyncio.run(main())


def test_a_deleted_models_slow_unload_is_its_state_until_it_ends_and_then_nothing_is_left(monkeypatch):
    """A deleted model's instance takes 1.5 s to unload (its turn among a loaded node's memory
    operations, its worker parked as it ends): meanwhile the agent counts it as holding the
    model, and the forget waits for it, so nothing of the model is left after."""
    from mesh.engines.simulated import SimulatedEngine

    async def slow_unload(self):
        await asyncio.sleep(1.5)
        self._kv_capacity = 0

    monkeypatch.setattr(SimulatedEngine, "unload", slow_unload)

    async def main():
        p = await started(1)
        m = model()
        reader = Reader(await p.submit(job("r0", m, max_tokens=5)))
        await asyncio.wait_for(reader.task, 10.0)
        fronts = p.agents["cpu-0"].server.models
        forgotten = asyncio.Event()
        await p.forget_model(m.uid, forgotten.set)
        await until(lambda: fronts.host.node.memory_ops.unloading, 5.0)
        assert m.uid in fronts.models_known()
        await asyncio.wait_for(forgotten.wait(), 10.0)
        assert fronts.models_known() == [] and not fronts.host.node.memory_ops.unloading
        await p.stop()

    asyncio.run(main())


def test_a_deleted_models_state_leaves_the_agents_only_after_its_arriving_requests():
    """A request between its arrival and the dispatcher (described, tokenized on an agent)
    may touch the agent's state of its model: a deletion meanwhile completes (its state
    leaves every agent, `then` is called) only once that request has gone on."""
    async def main():
        p = await started(1)
        m = model()
        forgotten = asyncio.Event()
        with p.catalogue.arriving(m.uid):
            await p.forget_model(m.uid, forgotten.set)
            await asyncio.sleep(1.2)  # two passes of the deletion's wait
            assert not forgotten.is_set()
        await asyncio.wait_for(forgotten.wait(), 5.0)
        assert m.uid not in p.catalogue._arriving
        await p.stop()

    asyncio.run(main())
