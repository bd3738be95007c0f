"""A node agent as the cluster dispatcher sees it: `AgentNode`, the service's `ClusterNode`.

The dispatcher and the policies (mesh.control.dispatcher, mesh.control.schedulers) decide;
this class carries each decision to one node agent process (local or on another machine)
over its control connection (mesh.wire.agent_protocol) and keeps the dispatcher's view of the
node current from the agent's events:

- validation (`validate`, `validate_group`, `validate_new`) runs in the agent, against its
  live NodeRuntime and learnt iteration times (shadow validation, LLM-Mesh 5.3, 6.4);
- `try_admit` is the agent's `admit`, validate + admit in one step of its loop;
- `take_back` and the agent's `evicted` event return a running request with the tokens it
  produced, so the dispatcher can resume it on another node (7.1, 6.4): its prompt plus
  those tokens are prefilled there, and its stream goes on where it stopped;
- tokens and `done` events update the request the dispatcher holds (`ServedRequest`:
  first-token time, progress, outcome), whose `on_output`/`on_done` feed the client.

The mirror of the node's instances and requests changes before a call goes out (and is
undone on refusal), so an event that overtakes the reply to its own call still finds its
request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Collection, Mapping, Sequence

from mesh.engines.engine_api import FinishReason
from mesh.control.agent_client import AgentCallError, AgentDown
from mesh.wire.agent_protocol import AdmitEntry, Code, DoneEvent, EvictedEvent, InstanceEvent, InstanceSpec, Probe
from mesh.wire.agent_protocol import NodeEvent
from mesh.wire.agent_protocol import Progress, ProtocolError, TokensEvent, event_from_message, mean_output_to, slo_to_dict
from mesh.control.supervisor import AgentHandle
from mesh.policy.shadow import DEFAULT_MARGIN
from mesh.control.cluster_node import ClusterNode, InstanceState
from mesh.node.runtime import Admission, InstancePlan, NodeSpec
from mesh.node.request import Outcome, ServedRequest
from mesh.policy.kv_demand import RunningMean
from mesh.service.errors import ApiError

log = logging.getLogger("mesh.service.agent_node")

CALL_TIMEOUT_S = 30.0
STATS_EVERY_S = 1.0

# (plan, node) -> how the agent loads the planned instance (its weights placed on that
# node first, when the service multicasts them); raises to refuse the start.
LoadSpecFor = Callable[[InstancePlan, "AgentNode"], Awaitable[InstanceSpec]]
ProfileFor = Callable[[str, str], str | None]  # (model, node kind) -> its calibration profile file, if any


@dataclass(eq=False)
class MirroredInstance:
    """The dispatcher's view of one instance on the agent (an InstanceState)."""

    instance_id: str
    model: str
    requests: dict[str, ServedRequest] = field(default_factory=dict)
    loaded: bool = False
    idle_since: float = 0.0
    # Staged: its weights are still on their way here, its load not issued yet (`start_instance`).
    staged_bytes: int = 0  # what it will take of the node's memory (0: its load was issued)
    deferred: list[tuple[ServedRequest, bool]] = field(default_factory=list)  # admitted while staged: (req, compute)


AgentFactory = Callable[..., AgentHandle]  # (spec, on_up, on_down, on_event, settings)


class AgentNode(ClusterNode):
    def __init__(self, spec: NodeSpec, agent_factory: AgentFactory, settings: Any, load_spec: LoadSpecFor,
                 profile_for: ProfileFor = lambda _model, _kind: None, margin: float = DEFAULT_MARGIN) -> None:
        self.margin = margin
        self.agent = agent_factory(spec, self._agent_up, self._agent_down, self._agent_event, settings)
        self._load_spec = load_spec
        self._profile_for = profile_for
        self._instances: dict[str, MirroredInstance] = {}
        self._means: dict[str, RunningMean] = {}  # O_avg per model: the cluster's, shared by every node (6.1)
        self._requests: dict[str, ServedRequest] = {}
        self.stats: dict[str, Any] = {}  # the agent's last `stats` reply
        self._budget_bytes = 0  # the memory budget in use (reservation station, 6.3)
        self._tasks: list[asyncio.Task] = []
        self._staging: set[asyncio.Task] = set()  # staged starts under way (`start_instance`)
        # Called when an instance left the node without the dispatcher asking (its load
        # failed, the agent died): the cluster forgets it.
        self.on_instance_gone: Callable[[str], None] | None = None
        self.on_change: Callable[[], None] | None = None  # capacity may have changed (agent up)
        self.on_down: Callable[["AgentNode"], None] | None = None  # the agent went down
        self.on_admitted: Callable[[ServedRequest], None] | None = None  # a request now runs here
        self.on_instance_stopped: Callable[[str, str], None] | None = None  # (model, instance) unloaded or lost
        self.last_start_error = ""  # why the last instance start failed (for the operator)
        self.busy_fraction = 0.0  # of the last stats interval, the node's engines were stepping
        self._load_waiters: dict[str, list[asyncio.Future]] = {}
        self._loaded_from: dict[str, str] = {}  # instance -> the source its agent said it loaded from
        self._stepping: str | None = None  # the instance whose iteration is in flight (the agent's `node` event)
        # (plan, node) -> must the planned instance's weights reach this node before its load
        # (the placement's weights plane says)? Then its start is staged (`start_instance`).
        self.transfer_first: Callable[[InstancePlan, "AgentNode"], bool] | None = None
        self.on_transfer: Callable[[int, float], None] | None = None  # (bytes, seconds) of a staged start's transfer

    # -- state -----------------------------------------------------------------------------
    @property
    def spec(self) -> NodeSpec:
        """The agent's: a remote agent's kind and memory come from its hello."""
        return self.agent.spec

    @property
    def instances(self) -> Mapping[str, InstanceState]:
        return self._instances

    @property
    def up(self) -> bool:
        return self.agent.up

    @property
    def stepping(self) -> str | None:
        """The instance whose iteration is in flight, as the agent last said: preemption skips
        it (7.1), as it skips a LocalNode's in a replay."""
        return self._stepping if self.up else None

    @property
    def capacity_bytes(self) -> int:
        return int(self.stats.get("memory", {}).get("capacity_bytes", self.spec.memory_bytes))

    def progress(self, request_id: str) -> int:
        req = self._requests.get(request_id)
        return req.tokens_out if req is not None else 0

    def used_bytes(self) -> int:
        """The agent's budget in use, and what the staged instances will take."""
        return self._budget_bytes + sum(i.staged_bytes for i in self._instances.values())

    def staging(self, instance_id: str) -> bool:
        inst = self._instances.get(instance_id)
        return inst is not None and inst.staged_bytes > 0

    def loaded_from(self, instance_id: str) -> str | None:
        return self._loaded_from.get(instance_id)

    def parked(self, model: str) -> bool:
        return model in self.stats.get("parked", {}).get("models", ())  # as of the last stats

    def can_fit(self, instance_bytes: int) -> bool:
        return self.capacity_bytes - self.used_bytes() >= instance_bytes

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.agent.start()
        self._tasks.append(asyncio.get_running_loop().create_task(self._poll_stats(), name=f"stats {self.node_id}"))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._staging]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.agent.stop()

    async def _poll_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            await self.refresh()

    async def refresh(self) -> None:
        """Read the agent's stats (memory budget, instances' batches and KV)."""
        if not self.up:
            return
        try:
            stats = await self.agent.client.call({"t": "stats"}, CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError):
            return
        prev = self.stats
        if prev and stats.get("uptime_s", 0) > prev.get("uptime_s", 0):
            self.busy_fraction = min(1.0, (stats["busy_s"] - prev["busy_s"]) / (stats["uptime_s"] - prev["uptime_s"]))
        self.stats = stats
        self._budget_bytes = int(stats.get("memory", {}).get("budget_bytes", self._budget_bytes))

    # -- verbs -------------------------------------------------------------------------------
    async def _ask(self, message: dict[str, Any]) -> Admission:
        """A validation the agent answers with {admit, reason}; a node that cannot answer refuses."""
        try:
            reply = await self.agent.client.call(message, CALL_TIMEOUT_S) if self.up else None
        except (AgentDown, AgentCallError) as exc:
            return Admission(False, refusal=f"node {self.node_id}: {exc}")
        if reply is None:
            return Admission(False, refusal=f"node {self.node_id} is {self.agent.state}")
        return Admission(bool(reply.get("admit")), refusal="" if reply.get("admit") else str(reply.get("reason")))

    async def validate(self, instance_id: str, req: ServedRequest, *, exclude: Collection[str] = ()) -> Admission:
        return await self._ask({"t": "validate", "instance_id": instance_id, "request": _probe(req, req.tokens_out),
                                "exclude": list(exclude)})

    async def validate_group(self, instance_id: str, reqs: Sequence[ServedRequest], done: Sequence[int]) -> Admission:
        return await self._ask({"t": "validate_group", "instance_id": instance_id,
                                "requests": [_probe(r, d) for r, d in zip(reqs, done, strict=True)]})

    async def validate_new(self, plan: InstancePlan, reqs: Sequence[ServedRequest], done: Sequence[int]) -> Admission:
        p = {"instance_id": plan.instance_id, "model": plan.model, "weight_bytes": plan.weight_bytes,
             "kv_bytes_per_token": plan.kv_bytes_per_token, "context_window": plan.context_window,
             "max_batch": plan.max_batch, "slo": slo_to_dict(plan.slo), "expected_load_s": plan.expected_load_s,
             "profile": self._profile_for(plan.model, self.spec.kind), "mean_output": mean_output_to(plan.mean_output)}
        return await self._ask({"t": "validate_new", "plan": p,
                                "requests": [_probe(r, d) for r, d in zip(reqs, done, strict=True)]})

    async def try_admit(self, instance_id: str, req: ServedRequest, *, compute: bool = True) -> Admission:
        inst = self._instances.get(instance_id)
        if inst is None or not self.up:
            return Admission(False, refusal=f"no instance {instance_id} on {self.node_id}")
        self._hold(inst, req)  # before the call: its first tokens may overtake the reply
        if inst.staged_bytes:  # its weights are on their way: sent to the agent once its load is issued
            inst.deferred.append((req, compute))
            return Admission(True)
        return await self._send_admit(inst, req, compute)

    async def _send_admit(self, inst: MirroredInstance, req: ServedRequest, compute: bool,
                          deferred: bool = False) -> Admission:
        """The agent's admit of a request held on `inst` (validation and admission in one step)."""
        instance_id = inst.instance_id
        er = req.engine_request
        entry = AdmitEntry(req.request_id, instance_id, list(er.prompt_token_ids[:er.prompt_len + req.tokens_out]),
                           er.sampling, _age(req.arrival_s), req.tokens_out, er.prompt_len, compute,
                           _age(req.first_token_s), req.late_s)
        try:
            reply = await self.agent.client.call({"t": "admit", "requests": [entry.to_dict()]}, CALL_TIMEOUT_S)
            result = reply["results"][0]
        except (AgentDown, AgentCallError, KeyError, IndexError) as exc:
            result = {"ok": False, "code": Code.FAILED.value, "reason": f"node {self.node_id}: {exc}"}
        if result.get("ok"):
            if self.on_admitted is not None:
                self.on_admitted(req)
            return Admission(True)
        if deferred:  # the dispatcher counted it placed: it is placed again
            self._hand_back(req, f"refused by {self.node_id} once its instance loaded: "
                                 f"{result.get('reason') or result.get('code')}")
            return Admission(False, refusal=str(result.get("reason") or result.get("code")))
        self._release(req.request_id)
        req.node_id = req.instance_id = None
        log.debug("%s refused %s on %s: %s", self.node_id, req.request_id, instance_id, result)
        return Admission(False, refusal=str(result.get("reason") or result.get("code")))

    async def take_back(self, request_id: str, why: str) -> ServedRequest | None:
        req = self._requests.get(request_id)
        if req is None or not self.up:
            return None
        try:
            reply = await self.agent.client.call({"t": "take_back", "request_id": request_id, "why": why}, CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError) as exc:  # it ended meanwhile, or the node is gone
            log.info("take_back of %s from %s: %s", request_id, self.node_id, exc)
            return None
        try:
            progress = Progress.from_dict(reply)
        except ProtocolError as exc:
            log.warning("take_back of %s from %s: %s", request_id, self.node_id, exc)
            return None
        self._release(request_id)
        _resume_from(req, progress, f"taken from {self.node_id} after {progress.tokens_out} tokens: {why}")
        return req

    async def start_instance(self, plan: InstancePlan) -> bool:
        """Issue the planned instance's load. One whose weights must first reach this node
        (`transfer_first(plan)`: the weights plane multicasts them, seconds to minutes) is
        staged instead: True at once, its transfer and load go on in the background
        (`_start_staged`), and the requests admitted to it meanwhile are sent to the agent
        once its load is issued (issue 32: a scale-out never holds its model's placement
        decision, nor the queue behind it, for a transfer). Its memory counts as used from
        now on, so another decision does not plan the same room."""
        if not self.up:
            return False
        inst = MirroredInstance(plan.instance_id, plan.model, idle_since=self._now())
        self._instances[plan.instance_id] = inst  # before the call: its ready event may overtake the reply
        if self.transfer_first is not None and self.transfer_first(plan, self):
            inst.staged_bytes = max(1, plan.weight_bytes)
            task = asyncio.get_running_loop().create_task(self._start_staged(plan, inst),
                                                          name=f"stage {plan.instance_id}")
            self._staging.add(task)
            task.add_done_callback(self._staging.discard)
            return True
        return await self._issue(plan, inst)

    async def _issue(self, plan: InstancePlan, inst: MirroredInstance) -> bool:
        """The load: its spec (the weights placed here first), then the agent's `load`."""
        try:
            spec = dataclasses.replace(await self._load_spec(plan, self), slo=slo_to_dict(plan.slo),
                                       expected_load_s=plan.expected_load_s, mean_output=mean_output_to(plan.mean_output))
            self._means[plan.model] = plan.mean_output
            if self._instances.get(plan.instance_id) is not inst:  # stopped while its weights moved
                return False
            await self.agent.client.call(spec.to_message(), CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - weights not placed, memory, engine: not started
            if self._instances.get(plan.instance_id) is inst:
                self._instances.pop(plan.instance_id, None)
            # the operator's detail: an error told to tenants redacted (an ApiError) keeps it as its cause
            detail = exc.__cause__ if isinstance(exc, ApiError) and exc.__cause__ is not None else exc
            log.warning("starting %s on %s failed: %s", plan.instance_id, self.node_id, detail)
            self.last_start_error = str(detail)
            return False
        # the memory budget in use came with the reply (the agent's `node` event follows it in
        # the same write): weights and initial KV cache, as the replay's station counts them
        return True

    async def _start_staged(self, plan: InstancePlan, inst: MirroredInstance) -> None:
        """A staged instance's transfer and load, then the requests admitted to it meanwhile
        go to the agent; if it cannot start (or one is refused there), they are handed back
        to the dispatcher to be placed again elsewhere, as evicted ones are."""
        issued = self._now()
        ok = await self._issue(plan, inst)
        inst.staged_bytes = 0
        if ok and self.on_transfer is not None:
            self.on_transfer(plan.weight_bytes, self._now() - issued)
        if ok and self._instances.get(plan.instance_id) is not inst:  # stopped while it moved: not kept
            await self._unload_quietly(plan.instance_id)
            ok = False
        deferred, inst.deferred = inst.deferred, []
        if not ok:
            ours = self._instances.get(plan.instance_id) is inst  # (not stopped, nor lost with its agent)
            if ours:
                self._instances.pop(plan.instance_id, None)
                self._settled(inst, False)
            for req, _ in deferred:
                self._hand_back(req, f"its instance {plan.instance_id} could not start on {self.node_id}: "
                                     f"{self.last_start_error or 'stopped'}")
            if ours and self.on_instance_gone is not None:
                self.on_instance_gone(plan.instance_id)
            return
        for req, compute in deferred:
            if req.outcome is None and req.request_id in inst.requests:
                await self._send_admit(inst, req, compute, deferred=True)

    async def _unload_quietly(self, instance_id: str) -> None:
        try:
            await self.agent.client.call({"t": "unload", "instance_id": instance_id}, CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError) as exc:
            log.warning("unloading %s on %s: %s", instance_id, self.node_id, exc)

    def _hand_back(self, req: ServedRequest, why: str) -> None:
        """A request admitted to a staged instance that could not take it: placed again."""
        if self._release(req.request_id) is None or req.outcome is not None:
            return
        req.attempts.append(why)
        req.node_id = req.instance_id = None
        if self.on_evict is not None:
            self.on_evict(req)
        else:
            req.end(Outcome.FAILED, self._now(), why)

    async def stop_instance(self, instance_id: str) -> None:
        inst = self._instances.pop(instance_id, None)
        if inst is None:
            return
        self._settled(inst, False)
        if not self.up or inst.staged_bytes:  # staged: its load was not issued (`_start_staged` cleans up)
            return
        try:
            await self.agent.client.call({"t": "unload", "instance_id": instance_id}, CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError) as exc:
            log.warning("unloading %s on %s: %s", instance_id, self.node_id, exc)
        await self.refresh()

    async def forget_model(self, model: str) -> None:
        """A deleted model with no instance left: its mean here and its state on the agent
        (fronts, tokenizer, learnt times, builds ahead, parked workers) go."""
        self._means.pop(model, None)
        if not self.up:  # a restarted agent has nothing of it
            return
        try:
            await self.agent.client.call({"t": "forget", "model": model}, CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError) as exc:
            log.warning("node %s could not forget model %s: %s", self.node_id, model, exc)

    async def wait_loaded(self, instance_id: str, timeout_s: float) -> bool:
        """Wait until the instance is ready (True) or gone: failed to load, unloaded (False)."""
        inst = self._instances.get(instance_id)
        if inst is None or inst.loaded:
            return inst is not None
        future = asyncio.get_running_loop().create_future()
        self._load_waiters.setdefault(instance_id, []).append(future)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return False

    def _settled(self, inst: MirroredInstance, loaded: bool) -> None:
        """The instance is ready (loaded=True) or no longer here: wake its waiters."""
        if not loaded:
            self._loaded_from.pop(inst.instance_id, None)
        for future in self._load_waiters.pop(inst.instance_id, ()):
            if not future.done():
                future.set_result(loaded)
        if not loaded and self.on_instance_stopped is not None:
            self.on_instance_stopped(inst.model, inst.instance_id)

    def fail_all(self, why: str) -> None:
        """The node left: every request it holds fails with `why`, its instances are gone."""
        for inst in list(self._instances.values()):
            self._lose_instance(inst, why)

    def abort(self, request_id: str, why: str) -> None:
        """Ask the agent to end the request (its `done` event, failed, ends it here); one
        held for a staged instance ends here."""
        req = self._requests.get(request_id)
        inst = self._instances.get(req.instance_id or "") if req is not None else None
        if inst is not None and any(r is req for r, _ in inst.deferred):
            inst.deferred = [(r, c) for r, c in inst.deferred if r is not req]
            self._end_here(request_id, Outcome.FAILED, why)
        elif self.up:
            self.agent.client.send({"t": "abort", "request_id": request_id})
        else:
            self._end_here(request_id, Outcome.FAILED, why)

    # -- the mirror ----------------------------------------------------------------------------
    def _hold(self, inst: MirroredInstance, req: ServedRequest) -> None:
        inst.requests[req.request_id] = req
        self._requests[req.request_id] = req
        req.node_id, req.instance_id = self.node_id, inst.instance_id

    def _release(self, request_id: str) -> ServedRequest | None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        inst = self._instances.get(req.instance_id or "")
        if inst is not None:
            inst.requests.pop(request_id, None)
            if not inst.requests:
                inst.idle_since = self._now()
        return req

    def _end_here(self, request_id: str, outcome: Outcome, detail: str, reason: FinishReason | None = None) -> None:
        req = self._release(request_id)
        if req is not None:
            req.end(outcome, self._now(), detail, reason)  # node_id stays: the dispatcher notes the node idle

    # -- agent events ------------------------------------------------------------------------------
    def _agent_event(self, _agent: AgentHandle, m: dict[str, Any]) -> None:
        try:
            event = event_from_message(m)
        except ProtocolError as exc:
            log.warning("node %s sent a malformed event: %s", self.node_id, exc)
            return
        now = self._now()
        if isinstance(event, TokensEvent):
            for rid, token_ids, text in event.items:
                req = self._requests.get(rid)
                if req is None:
                    continue
                if req.first_token_s is None:
                    req.first_token_s = now
                req.tokens_out += len(token_ids) or 1  # one item per token (simulated engines send no ids)
                if req.on_output is not None:
                    req.on_output(req, token_ids, [text] if text else [])
        elif isinstance(event, DoneEvent):
            req = self._requests.get(event.request_id)
            if req is None:
                return
            req.tokens_out = event.tokens_out or req.tokens_out
            outcome = Outcome.COMPLETED if event.outcome == Outcome.COMPLETED.value else Outcome.FAILED
            if outcome is Outcome.COMPLETED and req.model in self._means:  # O_avg, as a LocalNode's runtime adds it
                self._means[req.model].add(req.tokens_out)
            reason = FinishReason(event.reason) if event.reason in FinishReason._value2member_map_ else None
            self._end_here(event.request_id, outcome, event.detail, reason)
        elif isinstance(event, EvictedEvent):
            req = self._release(event.progress.request_id)
            if req is None:
                return
            req.evictions += 1
            req.fault = event.fault
            _resume_from(req, event.progress, f"evicted from {self.node_id}: {event.why}")
            if self.on_evict is not None:
                self.on_evict(req)
            else:
                req.end(Outcome.FAILED, now, event.why)
        elif isinstance(event, NodeEvent):
            self._stepping = event.stepping
            self._budget_bytes = event.budget_bytes
        elif isinstance(event, InstanceEvent):
            inst = self._instances.get(event.instance_id)
            if inst is None:
                return
            if event.state == "ready":
                if event.loaded_from:
                    self._loaded_from[inst.instance_id] = event.loaded_from
                inst.loaded = True
                inst.idle_since = now
                self._settled(inst, True)
                if self.on_loaded is not None:
                    self.on_loaded(inst.instance_id)
            else:
                self._lose_instance(inst, f"instance {inst.instance_id} failed to load: {event.error}")

    def _lose_instance(self, inst: MirroredInstance, why: str) -> None:
        self._instances.pop(inst.instance_id, None)
        self._settled(inst, False)
        for rid in list(inst.requests):
            self._end_here(rid, Outcome.FAILED, why)
        if self.on_instance_gone is not None:
            self.on_instance_gone(inst.instance_id)

    def _agent_up(self, agent: AgentHandle) -> None:
        log.warning("node agent %s is up (generation %d)", agent.node_id, agent.generation)
        # A reconnected agent that kept running holds instances nobody here knows: unload them.
        for view in (agent.client.info.get("instances") or []) if agent.client is not None else []:
            agent.client.send({"t": "unload", "instance_id": view.get("instance_id")})
        self._budget_bytes = 0
        self._stepping = None  # until the agent says
        if self.on_change is not None:
            self.on_change()

    def _agent_down(self, agent: AgentHandle, reason: str) -> None:
        why = f"node agent {agent.node_id} died ({reason}); it is being restarted"
        for inst in list(self._instances.values()):
            self._lose_instance(inst, why)
        self.stats = {}
        self._stepping = None
        if self.on_down is not None:
            self.on_down(self)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()


def _probe(req: ServedRequest, done: int) -> dict[str, Any]:
    """A request as the agent's validation needs it."""
    return Probe(req.request_id, req.prompt_len, req.engine_request.sampling.max_tokens,
                 _age(req.arrival_s), done, _age(req.first_token_s), req.late_s).to_dict()


def _age(t: float | None) -> float | None:
    """A time as seconds ago, for the agent's clock (the pace rule runs from the first token)."""
    return None if t is None else max(0.0, asyncio.get_running_loop().time() - t)


def _resume_from(req: ServedRequest, progress: Progress, note: str) -> None:
    """A request off its node: its produced tokens follow its prompt, to be recomputed
    where it resumes (mesh.node.runtime NodeRuntime.take_back does the same in-process)."""
    er = req.engine_request
    req.engine_request = dataclasses.replace(er, prompt_token_ids=list(er.prompt_token_ids[:er.prompt_len])
                                             + progress.token_ids)
    req.tokens_out = progress.tokens_out
    if req.first_token_s is None and progress.first_token_age_s is not None:  # no tokens streamed here
        req.first_token_s = asyncio.get_running_loop().time() - progress.first_token_age_s
    req.attempts.append(note)
    req.node_id = req.instance_id = None
