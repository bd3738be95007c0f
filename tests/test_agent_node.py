"""The cluster dispatcher and the replay's policies driving node agents over their real
loopback connections (mesh.control.agent_node.AgentNode): the same Dispatcher and
MeshScheduler as the replay, two agents in this process with simulated engines (fast).
Proactive preemption (7.1) moves a running request to the other node with its progress,
an eviction (6.4) goes back to the dispatcher and finishes elsewhere."""
from __future__ import annotations

import asyncio

import pytest

from agent_doubles import TIMES, ClusterOnly, InProcessAgent, until, use_simulated_engines
from cluster_doubles import linear_profile
from doubles import LinearTimes
from mesh.control.agent_node import AgentNode
from mesh.control.dispatcher import Dispatcher
from mesh.control.fleet import ClusterConfig, Fleet, ModelSpec
from mesh.control.supervisor import AgentSettings
from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import SLO
from mesh.wire.agent_protocol import REPLY, TYPE_KEY, InstanceSpec
from mesh.wire.served_request import Outcome, ServedRequest

# The agents' simulated engines (agent_doubles): decode 10 ms a step, 1,000 bytes of KV per token.
SLO_TIGHT = SLO(ttft_min_s=0.5, ttft_s_per_prompt_token=0.0, tpot_s=0.015)


@pytest.fixture
def simulated(monkeypatch):
    """Simulated engines whose predicted times stay the profile's (no learning), so the
    decisions below do not depend on how fast this machine runs the simulation."""
    import mesh.node.instance_host as server_module
    from agent_doubles import TIMES
    from mesh.perf.times import AdaptiveTimes

    use_simulated_engines(monkeypatch)
    monkeypatch.setattr(server_module, "iteration_times", lambda spec, w: AdaptiveTimes(TIMES, alpha=0.0,
                                                                                        prefill_alpha=0.0))


async def _load_spec(plan, node) -> InstanceSpec:
    return InstanceSpec(plan.instance_id, plan.model, "/nowhere", plan.context_window, engine="simulated",
                        max_num_seqs=plan.max_batch)


async def _cluster(models: list[str], memory: int = 10**9, slo: SLO = SLO_TIGHT, policy: str = "mesh"):
    profile = linear_profile("m", "cpu", weight_bytes=10**6, kv_bytes_per_token=1000, max_context=256,
                             decode_base=0.01, prefill_per_token=0.0001, prefill_base=0.0)
    catalog = {"base": ModelSpec("base", {"cpu": profile})}
    cluster = Fleet(ClusterConfig(cpu_nodes=2, gpu_nodes=0, cpu_memory_bytes=memory, slo=slo), catalog,
                          {m: "base" for m in models}, {"base": 100.0})
    for i in range(2):
        cluster.add_node(AgentNode(NodeSpec(f"cpu{i}", "cpu", memory), InProcessAgent, AgentSettings(), _load_spec,
                                   ClusterOnly(cluster)))
    d = Dispatcher.for_policy(cluster, policy)
    await cluster.start()
    return cluster, d


def _request(rid: str, model: str, prompt: int = 20, out: int = 200, slo: SLO = SLO_TIGHT) -> ServedRequest:
    ids = list(range(1, prompt + 1))
    return ServedRequest(EngineRequest(rid, prompt, Sampling(max_tokens=out), ids, output_len=out), model,
                         asyncio.get_running_loop().time(), slo)


async def _instance(cluster, model: str, node) -> str:
    ref = await cluster.start_instance(cluster.plan(model, node), node)
    assert ref is not None
    await until(lambda: node.instances[ref.instance_id].loaded)
    return ref.instance_id


def _engine(cluster, node, instance_id: str):
    """The in-process agent's engine of an instance (its `times` are what its iterations take)."""
    return node.agent.server.node.instances[instance_id].engine


SLOW_DECODE = LinearTimes(prefill_per_token=0.0001, decode_base=0.3)  # what an iteration really takes, not its plan
SLOW_PREFILL = LinearTimes(prefill_per_token=0.05, decode_base=0.01)  # 20 tokens: 1 s


def test_proactive_preemption_moves_a_running_request_to_another_agent(simulated):
    """cpu0 runs X (model m, batch 2) and Y (model n, batch 1), forced in memory-only: a
    decode round of both takes 20 ms (x1.1 margin) against a TPOT of 15 ms. A third
    request for m validates on X only with Y preempted; Y's request validates on a new
    instance on cpu1, so the dispatcher preempts Y and the request resumes on cpu1 with the
    tokens it produced, and all of them finish with every token. (The request arrives
    while X, not the victim Y, steps: X's iterations really take 0.3 s then.) The moved
    request's one admitted event fires at each admission, where it then runs."""

    async def main():
        cluster, d = await _cluster(["m", "n"])
        a = cluster.node("cpu0")
        x = await _instance(cluster, "m", a)
        y = await _instance(cluster, "n", a)
        first = [_request(f"m{k}", "m") for k in range(2)]
        moved = _request("n0", "n")
        admitted = []
        moved.on_admitted = lambda q: admitted.append((q.node_id, q.instance_id))
        for r in first:
            assert (await a.try_admit(x, r, compute=False)).ok
        assert (await a.try_admit(y, moved, compute=False)).ok
        await until(lambda: a.agent.server.node.progress("n0") >= 5)  # simulated engines stream no tokens
        _engine(cluster, a, x).times = SLOW_DECODE
        await asyncio.sleep(0.05)  # the iterations planned before are over
        await until(lambda: a.stepping == x)
        r = _request("r", "m")
        assert not (await a.validate(x, r)).ok  # X is too slow with Y beside it
        d.submit(r)
        await until(lambda: moved.node_id == "cpu1")
        _engine(cluster, a, x).times = TIMES
        carried = [n for n in moved.attempts if "preempted by" in n]
        assert r.node_id == "cpu0" and r.instance_id == x and y not in a.instances
        assert d.policy.stats.preemptions == 1 and carried
        await until(lambda: all(q.outcome is not None for q in [*first, moved, r]), 30.0)
        await cluster.stop()
        return first, moved, r, admitted, y

    first, moved, r, admitted, y = asyncio.run(main())
    for q in [*first, moved, r]:
        assert q.outcome is Outcome.COMPLETED and q.tokens_out == 200, (q.request_id, q.outcome, q.detail)
    assert moved.node_id == "cpu1"
    assert admitted == [("cpu0", y), ("cpu1", moved.instance_id)]


def test_an_agent_node_knows_which_instance_steps():
    """The agent says which instance's iteration is in flight (`stepping` events), so the
    service's view of a node reads as a replay's LocalNode: the instance while it runs
    iterations, None once the node is idle."""
    async def main():
        with pytest.MonkeyPatch.context() as mp:
            use_simulated_engines(mp)
            cluster, _d = await _cluster(["m"], slo=SLO(ttft_min_s=5.0, tpot_s=1.0))
            a = cluster.node("cpu0")
            x = await _instance(cluster, "m", a)
            assert a.stepping is None
            r = _request("r", "m", out=100)
            assert (await a.try_admit(x, r)).ok
            await until(lambda: a.stepping == x)
            seen = a.stepping
            await until(lambda: r.outcome is not None)
            await until(lambda: a.stepping is None)
            await cluster.stop()
            return seen, x

    seen, x = asyncio.run(main())
    assert seen == x


def test_an_agent_node_knows_its_memory_budget_between_stats(simulated):
    """New instances bin-pack by the memory budget in use (4), which a replay's LocalNode
    reads from its reservation station (6.3). An AgentNode counted only the weights of the
    instances it started until the next stats poll (a second later): now the agent's `node`
    event carries the budget (weights, the initial KV cache, each scale-up at admission)
    with the reply that changed it."""
    async def main():
        cluster, _d = await _cluster(["m"], slo=SLO(ttft_min_s=5.0, tpot_s=1.0))
        a = cluster.node("cpu0")
        a.stats = {}  # no poll has run; none will before the checks below (STATS_EVERY_S)
        station = a.agent.server.node.memory.station
        ref = await cluster.start_instance(cluster.plan("m", a), a)
        seen = [(a.used_bytes(), station.budget)]
        await until(lambda: a.instances[ref.instance_id].loaded)
        reqs = [_request(f"r{k}", "m", prompt=200, out=40) for k in range(6)]
        for r in reqs:
            assert (await a.try_admit(ref.instance_id, r)).ok
            seen.append((a.used_bytes(), station.budget))
        await until(lambda: all(r.outcome is not None for r in reqs), 20.0)
        await cluster.stop()
        return seen

    seen = asyncio.run(main())
    assert seen[0][0] == seen[0][1] > 10**6  # weights and the initial KV cache, at once
    assert all(used == budget for used, budget in seen), seen
    assert seen[-1][1] > seen[0][1]  # the KV cache grew with the admissions, and the node said so


def test_preemption_skips_the_instance_in_the_middle_of_an_iteration(simulated):
    """As in the replay (7.1), live preemption never picks the instance whose iteration is
    in flight: Y (model n) is prefilling for a second when a request for m needs Y's room
    on cpu0. Y is not preempted (without `stepping` the service picked it, and its
    take-back waited for the prefill); the request gets a new instance on cpu1."""

    async def main():
        cluster, d = await _cluster(["m", "n"])
        a = cluster.node("cpu0")
        x = await _instance(cluster, "m", a)
        y = await _instance(cluster, "n", a)
        first = [_request(f"m{k}", "m") for k in range(2)]
        for q in first:
            assert (await a.try_admit(x, q, compute=False)).ok
        _engine(cluster, a, y).times = SLOW_PREFILL
        stays = _request("n0", "n")
        assert (await a.try_admit(y, stays, compute=False)).ok
        await until(lambda: a.stepping == y)
        r = _request("r", "m")
        d.submit(r)
        await until(lambda: r.node_id is not None, 5.0)
        where = (r.node_id, stays.node_id, d.policy.stats.preemptions, a.stepping)
        _engine(cluster, a, y).times = TIMES
        await until(lambda: all(q.outcome is not None for q in [*first, stays, r]), 30.0)
        await cluster.stop()
        return where, y, [*first, stays, r]

    (r_node, stays_node, preemptions, stepping), y, reqs = asyncio.run(main())
    assert stepping == y  # decided during Y's prefill
    assert (r_node, stays_node, preemptions) == ("cpu1", "cpu0", 0)
    for q in reqs:
        assert q.outcome is Outcome.COMPLETED and q.tokens_out == 200, (q.request_id, q.outcome, q.detail)


def test_an_evicted_request_finishes_on_another_agent(simulated):
    """6.4 over the wire: cpu0's memory holds the weights and 330 tokens of KV; two requests
    of 20 + 200 tokens outgrow it, the agent evicts one (an `evicted` event with its
    progress), and the dispatcher places it on cpu1, where it finishes."""

    async def main():
        memory = 10**6 + 330 * 1000
        cluster, d = await _cluster(["m"], memory=memory, slo=SLO(ttft_min_s=5.0, tpot_s=1.0))
        reqs = [_request(f"r{k}", "m", prompt=20, out=200) for k in range(2)]
        for r in reqs:
            d.submit(r)
        await until(lambda: all(r.node_id for r in reqs))
        first = [r.node_id for r in reqs]
        await until(lambda: all(r.outcome is not None for r in reqs), 30.0)
        await cluster.stop()
        return reqs, first, d

    reqs, first, d = asyncio.run(main())
    assert first == ["cpu0", "cpu0"]
    moved = [r for r in reqs if r.evictions]
    assert len(moved) == 1 and moved[0].node_id == "cpu1" and d.stats.rescheduled == 1
    assert all(r.outcome is Outcome.COMPLETED and r.tokens_out == 200 for r in reqs)


def test_a_cold_models_request_is_served_late_through_an_agent(simulated, monkeypatch):
    """Serving late (dispatch_rules.SERVE_LATE) through a node agent: the request's deadlines run
    from its loading instance's ready time, which lies ahead, so the age the agent gets for
    it is negative. Agents used to clip it to zero: the agent then validated the request
    against a deadline before its instance could be ready and refused it, and every request
    of a cold model whose load outlasts the TTFT SLO was turned away (issue 23's single-node
    workload)."""
    import agent_doubles
    from mesh.perf.load_times import ColdStart

    def slow(spec, on_loaded):  # a load of 1.5 s, about what the service predicts
        e = agent_doubles.simulated_factory(spec, on_loaded)
        e.load_s = 1.5
        return e

    for name in ("simulated", "openvino"):
        monkeypatch.setitem(agent_doubles.agent_engines.ENGINE_FACTORIES, name, slow)

    async def main():
        profile = linear_profile("m", "cpu", weight_bytes=10**6, kv_bytes_per_token=1000, max_context=256,
                                 decode_base=0.01, prefill_per_token=0.0001, prefill_base=0.0)
        cfg = ClusterConfig(cpu_nodes=1, gpu_nodes=0, cpu_memory_bytes=10**9, slo=SLO_TIGHT,
                            cold_start=ColdStart(cpu_load_bytes_per_s=1e18, fixed_s=1.5))
        cluster = Fleet(cfg, {"base": ModelSpec("base", {"cpu": profile})}, {"m": "base"}, {"base": 100.0})
        cluster.add_node(AgentNode(NodeSpec("cpu0", "cpu", 10**9), InProcessAgent, AgentSettings(), _load_spec,
                                   ClusterOnly(cluster)))
        d = Dispatcher.for_policy(cluster, "mesh")
        await cluster.start()
        r = _request("r", "m", out=5)  # TTFT SLO 0.5 s, the model cold: a 1.5 s load ahead
        d.submit(r)
        await until(lambda: r.outcome is not None, 30.0)
        await cluster.stop()
        return r, d.policy.stats

    r, stats = asyncio.run(main())
    assert stats.warm_ups == 1 and stats.served_late == 1
    assert r.outcome is Outcome.COMPLETED, r.detail
    assert r.late_s > 1.0  # its deadlines ran from the instance's predicted ready time


class Recording(ClusterOnly):
    """A listener that notes what its node reports, in order, and passes the cluster's part on."""

    def __init__(self, cluster: Fleet) -> None:
        super().__init__(cluster)
        self.heard: list[tuple[str, str]] = []

    def agent_up(self, node: AgentNode) -> None:
        self.heard.append(("up", node.node_id))

    def instance_loaded(self, node: AgentNode, instance_id: str) -> None:
        super().instance_loaded(node, instance_id)
        self.heard.append(("loaded", instance_id))

    def instance_stopped(self, node: AgentNode, model: str, instance_id: str) -> None:
        self.heard.append(("stopped", instance_id))


def test_an_agent_node_reports_to_the_listener_it_was_made_with(simulated):
    """The node's agent comes up, an instance loads and is stopped: each is reported to the
    listener given to the node's constructor, naming the node; the cluster hears its part
    (its keep-alive of the loaded instance starts)."""
    async def main():
        profile = linear_profile("m", "cpu", weight_bytes=10**6, kv_bytes_per_token=1000, max_context=256,
                                 decode_base=0.01, prefill_per_token=0.0001, prefill_base=0.0)
        cluster = Fleet(ClusterConfig(cpu_nodes=1, gpu_nodes=0, cpu_memory_bytes=10**9, slo=SLO_TIGHT),
                              {"base": ModelSpec("base", {"cpu": profile})}, {"m": "base"}, {"base": 100.0})
        listener = Recording(cluster)
        node = AgentNode(NodeSpec("cpu0", "cpu", 10**9), InProcessAgent, AgentSettings(), _load_spec, listener)
        cluster.add_node(node)
        await cluster.start()
        await until(lambda: node.up)
        ref = await cluster.start_instance(cluster.plan("m", node), node)
        await until(lambda: node.instances[ref.instance_id].loaded)
        kept_alive = ref.recycle is not None  # the cluster's keep-alive runs from the load
        await cluster.stop_instance(ref)
        await until(lambda: len(listener.heard) >= 3)
        await cluster.stop()
        return listener.heard, ref.instance_id, kept_alive

    heard, iid, kept_alive = asyncio.run(main())
    assert heard[:3] == [("up", "cpu0"), ("loaded", iid), ("stopped", iid)]
    assert kept_alive


def test_a_stop_ends_when_the_stats_reply_comes_with_its_cancellation():
    """asyncio.wait_for before Python 3.12 returns a result that arrives in the same loop turn
    as its task's cancellation, and the cancellation is lost (CPython gh-86296). The node's
    stats poll then went on polling, and a stop that cancelled it once and gathered it waited
    forever: the service's stop hung there, its supervisor still restarting the node's agent.
    Here the poll's stats reply (the agent's own answer) lands just after the stop's cancel,
    before the poll runs again; the stop still ends."""
    async def main() -> None:
        node = AgentNode(NodeSpec("cpu0", "cpu", 10**9), InProcessAgent, AgentSettings(), _load_spec, ClusterOnly())
        await node.start()
        client = node.agent.client
        try:
            await until(lambda: node.stats, 5)  # the poll reads stats once a second
            held: list[int] = []
            write = client._write

            def hold_one_stats_call(message: dict) -> None:
                if message.get(TYPE_KEY) == "stats" and not held:
                    held.append(message["id"])  # not sent: its reply is given below
                    return
                write(message)

            client._write = hold_one_stats_call
            await until(lambda: held, 5)
            client._write = write
            answer = await client.call_message({TYPE_KEY: "stats"})  # what the agent answers to stats
            stop = asyncio.ensure_future(node.stop())
            await asyncio.sleep(0)  # the stop has cancelled the poll, which has not run since
            client._pending[held[0]].set_result({TYPE_KEY: REPLY, "re": held[0], "ok": True, **answer})
            await asyncio.wait_for(stop, 10)
        finally:
            await node.agent.stop()

    asyncio.run(main())
