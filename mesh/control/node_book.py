"""The dispatcher's book of one node agent: its instances and the requests placed on them
(what `ClusterNode.instances` shows the dispatcher and the policies), kept current from the
agent's events (mesh.wire.agent_protocol): tokens and `done` update the request the
dispatcher holds (`ServedRequest`: first-token time, progress (its prompt token ids grow by
each token streamed), outcome), whose `on_output`/`on_done` feed the client; `evicted` hands
a request back with the tokens it produced (6.4); an instance's `ready` or failed load
settles who waits for it; a lost node's requests leave with the progress streamed
(`lose_node`).

The service holds each request once, as the dispatcher's `ServedRequest`: an
instance here lists the ones placed on it, and the book keeps no other copy or index of them
(the agent process holds its own, for its token loop).

`AgentNode` (mesh.control.agent_node) carries the dispatcher's verbs to the agent and
changes the book before a call goes out (undone on refusal), so an event that overtakes
the reply to its own call still finds its request.
"""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

from mesh.control.cluster_node import ENGINE_HUNG, ClusterNode, NodeListener
from mesh.engines.engine_api import FinishReason
from mesh.policy.kv_demand import RunningMean
from mesh.wire.agent_protocol import DoneEvent, EvictedEvent, InstanceEvent, Progress, TokensEvent, item_logprobs
from mesh.wire.served_request import Outcome, ServedRequest


class BookListener(NodeListener, Protocol):
    """What the book reports of its node: a NodeListener's events, and an instance that left
    the node (unloaded or lost)."""

    def instance_stopped(self, node: ClusterNode, model: str, instance_id: str) -> None:
        """The instance (of `model`) is no longer on the node: unloaded, failed or lost."""


@dataclass(eq=False)
class AgentInstance:
    """One instance on the agent as the dispatcher reads it (an HostedInstance): the requests
    placed on it are the dispatcher's own records."""

    instance_id: str
    model: str
    requests: dict[str, ServedRequest] = field(default_factory=dict)
    loaded: bool = False
    idle_since: float = 0.0
    # Staged: its weights are still on their way here, its load not issued yet (`start_instance`).
    staged_bytes: int = 0  # what it will take of the node's memory (0: its load was issued)
    deferred: list[tuple[ServedRequest, bool]] = field(default_factory=list)  # admitted while staged: (req, compute)


class NodeBook:
    def __init__(self, node: ClusterNode, listener: BookListener) -> None:
        """`node`: the node it keeps (an AgentNode), named in what it reports to `listener`."""
        self.node = node
        self.listener = listener
        self.instances: dict[str, AgentInstance] = {}
        self.means: dict[str, RunningMean] = {}  # O_avg per model: the cluster's, shared by every node (6.1)
        self.loaded_from: dict[str, str] = {}  # instance -> the source its agent said it loaded from
        self._load_waiters: dict[str, list[asyncio.Future]] = {}

    # -- requests placed here ----------------------------------------------------------------
    def find(self, request_id: str) -> tuple[AgentInstance, ServedRequest] | None:
        """The instance here that holds the request, and the request."""
        for inst in self.instances.values():
            req = inst.requests.get(request_id)
            if req is not None:
                return inst, req
        return None

    def get(self, request_id: str) -> ServedRequest | None:
        found = self.find(request_id)
        return found[1] if found is not None else None

    def hold(self, inst: AgentInstance, req: ServedRequest) -> None:
        er = req.engine_request
        if er.prompt_token_ids is not None:  # its own list, which its streamed tokens extend (`tokens`)
            er.prompt_token_ids = list(er.prompt_token_ids)
        inst.requests[req.request_id] = req
        req.node_id, req.instance_id = self.node.node_id, inst.instance_id

    def release(self, request_id: str, inst: AgentInstance | None = None) -> ServedRequest | None:
        """The request leaves its instance here (`inst`: one no longer on the node)."""
        if inst is None:
            found = self.find(request_id)
            if found is None:
                return None
            inst = found[0]
        req = inst.requests.pop(request_id, None)
        if req is not None and not inst.requests:
            inst.idle_since = _now()
        return req

    def end_here(self, request_id: str, outcome: Outcome, detail: str, reason: FinishReason | None = None) -> None:
        req = self.release(request_id)
        if req is not None:
            req.end(outcome, _now(), detail, reason)  # node_id stays: the dispatcher notes the node idle

    # -- instances -----------------------------------------------------------------------------
    async def wait_loaded(self, instance_id: str, timeout_s: float) -> bool:
        """Wait until the instance is ready (True) or gone: failed to load, unloaded (False)."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.loaded:
            return inst is not None
        future = asyncio.get_running_loop().create_future()
        self._load_waiters.setdefault(instance_id, []).append(future)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return False

    def settled(self, inst: AgentInstance, loaded: bool) -> None:
        """The instance is ready (loaded=True) or no longer here: wake its waiters."""
        if not loaded:
            self.loaded_from.pop(inst.instance_id, None)
        for future in self._load_waiters.pop(inst.instance_id, ()):
            if not future.done():
                future.set_result(loaded)
        if not loaded:
            self.listener.instance_stopped(self.node, inst.model, inst.instance_id)

    def lose(self, inst: AgentInstance, why: str) -> None:
        """The instance failed to load: its requests fail (a lost node's go on elsewhere: `lose_node`)."""
        self.instances.pop(inst.instance_id, None)
        self.settled(inst, False)
        for req in list(inst.requests.values()):
            if inst.requests.pop(req.request_id, None) is req:
                req.end(Outcome.FAILED, _now(), why)
        self.listener.instance_gone(self.node, inst.instance_id)

    def lose_node(self, why: str) -> list[ServedRequest]:
        """The node is gone (its agent died, froze, left the cluster, or its network went):
        its instances are gone, and every request they held (running, waiting for a prefill,
        or held for a staged instance) leaves the node with the progress this service saw
        (its prompt and the tokens streamed to its client), not ended. Returns them, for
        `ClusterNode.hand_back_lost`."""
        taken: list[ServedRequest] = []
        for inst in list(self.instances.values()):
            self.instances.pop(inst.instance_id, None)
            inst.deferred = []
            requests, inst.requests = list(inst.requests.values()), {}
            self.settled(inst, False)
            taken += [req for req in requests if req.outcome is None]
            self.listener.instance_gone(self.node, inst.instance_id)
        return taken

    # -- the agent's events ----------------------------------------------------------------------
    def tokens(self, event: TokensEvent) -> None:
        now = _now()
        for item in event.items:
            rid, token_ids, text = item[:3]
            req = self.get(rid)
            if req is None:
                continue
            if req.first_token_s is None:
                req.first_token_s = now
            ids = req.engine_request.prompt_token_ids
            if token_ids and isinstance(ids, list) and len(ids) == req.prompt_len + req.tokens_out:
                ids.extend(token_ids)  # the progress this service holds: its prompt, then every token streamed
            req.tokens_out += len(token_ids) or 1  # one item per token (simulated engines send no ids)
            if req.on_output is not None:
                req.on_output(req, token_ids, [text] if text else [], item_logprobs(item))

    def done(self, event: DoneEvent) -> None:
        req = self.get(event.request_id)
        if req is None:
            return
        req.tokens_out = event.tokens_out or req.tokens_out
        outcome = Outcome.COMPLETED if event.outcome == Outcome.COMPLETED.value else Outcome.FAILED
        if outcome is Outcome.COMPLETED and req.model in self.means:  # O_avg, as a LocalNode's runtime adds it
            self.means[req.model].add(req.tokens_out)
        reason = FinishReason(event.reason) if event.reason in FinishReason._value2member_map_ else None
        self.end_here(event.request_id, outcome, event.detail, reason)

    def evicted(self, event: EvictedEvent) -> None:
        req = self.release(event.progress.request_id)
        if req is None:
            return
        req.evictions += 1
        req.fault = event.fault
        if event.fault:
            req.lost = ENGINE_HUNG
        resume_from(req, event.progress, f"evicted from {self.node.node_id}: {event.why}")
        self.listener.request_evicted(self.node, req)

    def instance(self, event: InstanceEvent) -> None:
        inst = self.instances.get(event.instance_id)
        if inst is None:
            return
        if event.state != "ready":
            self.lose(inst, f"instance {inst.instance_id} failed to load: {event.error}")
            return
        if event.loaded_from:
            self.loaded_from[inst.instance_id] = event.loaded_from
        inst.loaded = True
        inst.idle_since = _now()
        self.settled(inst, True)
        self.listener.instance_loaded(self.node, inst.instance_id)


def resume_from(req: ServedRequest, progress: Progress, note: str) -> None:
    """A request off its node: its produced tokens follow its prompt, to be recomputed
    where it resumes (mesh.node.runtime NodeRuntime.take_back does the same in-process)."""
    er = req.engine_request
    req.engine_request = dataclasses.replace(er, prompt_token_ids=list(er.token_ids()[:er.prompt_len])
                                             + progress.token_ids)
    req.tokens_out = progress.tokens_out
    if req.first_token_s is None and progress.first_token_age_s is not None:  # no tokens streamed here
        req.first_token_s = asyncio.get_running_loop().time() - progress.first_token_age_s
    req.attempts.append(note)
    req.node_id = req.instance_id = None


def _now() -> float:
    return asyncio.get_running_loop().time()
