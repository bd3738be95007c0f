"""Test doubles for the node agent: a simulated engine that reports its load like the real
agent engine does, and an agent handle that runs `AgentServer` in this process (instead of
spawning `python -m mesh.agent`) behind a real loopback connection."""
from __future__ import annotations

import asyncio
from typing import Any

from doubles import LinearTimes
from mesh.control.agent_client import AgentClient
from mesh.control.supervisor import AgentHandle
from mesh.engines.simulated import SimulatedEngine
from mesh.node import engine_host as agent_engines
from mesh.node.agent_server import AgentServer
from mesh.wire.agent_protocol import InstanceSpec
from mesh.wire.served_request import ServedRequest


class ClusterOnly:
    """An AgentNodeListener for tests without the service's NodePool: what the cluster hears
    goes to `cluster` (a Fleet; None: nobody), the rest to nobody."""

    def __init__(self, cluster: Any = None) -> None:
        self.cluster = cluster

    def request_evicted(self, node: Any, req: ServedRequest) -> None:
        if self.cluster is not None:
            self.cluster.request_evicted(node, req)

    def instance_loaded(self, node: Any, instance_id: str) -> None:
        if self.cluster is not None:
            self.cluster.instance_loaded(node, instance_id)

    def instance_gone(self, node: Any, instance_id: str) -> None:
        if self.cluster is not None:
            self.cluster.instance_gone(node, instance_id)

    def instance_stopped(self, node: Any, model: str, instance_id: str) -> None: ...

    def agent_up(self, node: Any) -> None: ...

    def agent_down(self, node: Any) -> None: ...

    def weights_moved(self, node: Any, nbytes: int, seconds: float) -> None: ...


TOKEN = "secret"
WEIGHTS_TOKEN = "weights-secret"
TIMES = LinearTimes(prefill_per_token=0.0001, decode_base=0.01)


class LoadReportingEngine(SimulatedEngine):
    on_loaded = None

    async def load(self) -> None:
        await super().load()
        self.on_loaded(None)


def simulated_factory(spec: InstanceSpec, on_loaded: Any) -> LoadReportingEngine:
    e = LoadReportingEngine(spec.model, TIMES, kv_bytes_per_token=1000, weight_bytes=10**6,
                            context_window=spec.context_window or 256, load_s=0.05, max_batch=spec.max_num_seqs)
    e.on_loaded = on_loaded
    return e


def use_simulated_engines(monkeypatch: Any) -> None:
    """Every engine an in-process agent builds is simulated, with LinearTimes as its times."""
    import mesh.node.instance_host as server_module

    for name in ("simulated", "openvino"):
        monkeypatch.setitem(agent_engines.ENGINE_FACTORIES, name, simulated_factory)
    monkeypatch.setattr(server_module, "iteration_times", lambda spec, w: agent_engines.AdaptiveTimes(TIMES))


class InProcessAgent(AgentHandle):
    """The LocalAgent interface, with the agent in this process. `kill()` drops the
    connection the way a dead process does; `start()` again brings a fresh agent."""

    server: AgentServer | None = None
    weights_root: str | None = None  # set: the agent hosts a weights receiver in <root>/<node id>
    link_bytes_per_s: float | None = None  # its weights receiver's uplink pace (None: unpaced)

    async def start(self) -> None:
        weights = None
        if self.weights_root is not None:
            from pathlib import Path

            from mesh.weights.receiver import NodeWeightsReceiver

            weights = NodeWeightsReceiver(Path(self.weights_root) / self.node_id, token=WEIGHTS_TOKEN,
                                          link_bytes_per_s=self.link_bytes_per_s)
        # The double's models are the tests' own files anywhere: it trusts every path ("/").
        self.server = AgentServer(self.spec, TOKEN, weights=weights, load_roots=["/"])
        address = await self.server.serve("127.0.0.1:0")
        self.generation += 1
        self.client = AgentClient(self.node_id, lambda m: self.on_event(self, m), self._closed)
        await self.client.connect(address, TOKEN)
        self.state = "up"
        self.on_up(self)

    def _closed(self, reason: str) -> None:
        if self.state == "up":
            self.state = "down"
            self.last_error = reason
            self.on_down(self, reason)

    async def wait_up(self, timeout_s: float) -> bool:
        return self.up

    async def kill(self) -> None:
        server = self.server
        if server is not None and server.connection.writer is not None:
            server.connection.writer.transport.abort()
        await server.close()
        for _ in range(100):
            if self.state != "up":
                return
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.state = "stopped"
        if self.client is not None:
            await self.client.close()
        if self.server is not None:
            await self.server.close()


async def until(cond: Any, limit_s: float = 10.0, poll_s: float = 0.01) -> None:
    """Wait for `cond()` on the running loop; AssertionError after `limit_s`."""
    for _ in range(int(limit_s / poll_s)):
        if cond():
            return
        await asyncio.sleep(poll_s)
    raise AssertionError("condition not reached")


def next_token(seq: list[int]) -> int:
    """The token `SequenceEngine` gives after `seq`: a function of the whole sequence so far
    (prompt and output), so a stream resumed from the wrong place, or with a token lost or
    repeated, goes on differently."""
    return (sum(seq[-3:]) * 31 + len(seq)) % 4999 + 1


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """What an undisturbed stream of `n` tokens after `prompt` gives on a SequenceEngine."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class SequenceEngine(LoadReportingEngine):
    """A simulated engine (its times and batching) whose tokens have ids and text: each is
    `next_token` of the request's sequence (its prompt token ids, then what it produced)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seqs: dict[str, list[int]] = {}

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        self.seqs[request.request_id] = list(request.prompt_token_ids or range(request.prompt_len))

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.seqs.pop(request_id, None)

    async def step(self) -> Any:
        result = await super().step()
        ids: list[int] = []
        for rid in result.request_ids:
            seq = self.seqs[rid]
            seq.append(next_token(seq))
            ids.append(seq[-1])
        for rid in result.finished:
            self.seqs.pop(rid, None)
        result.token_ids, result.texts = ids, [f"{t} " for t in ids]
        return result


def sequence_factory(spec: InstanceSpec, on_loaded: Any) -> SequenceEngine:
    e = SequenceEngine(spec.model, TIMES, kv_bytes_per_token=1000, weight_bytes=10**6,
                       context_window=spec.context_window or 256, load_s=0.05, max_batch=spec.max_num_seqs)
    e.on_loaded = on_loaded
    return e


def use_sequence_engines(monkeypatch: Any) -> None:
    """use_simulated_engines, with SequenceEngines: tokens with ids and text."""
    use_simulated_engines(monkeypatch)
    for name in ("simulated", "openvino"):
        monkeypatch.setitem(agent_engines.ENGINE_FACTORIES, name, sequence_factory)
