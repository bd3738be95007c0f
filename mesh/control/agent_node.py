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
  those tokens are prefilled there, and its stream goes on where it stopped; a lost node
  (`lose`: its agent died, froze, left, or its network went) returns every request it held
  the same way, with the tokens the service had streamed;
- tokens and `done` events update the request the dispatcher holds (`ServedRequest`:
  first-token time, progress, outcome), whose `on_output`/`on_done` feed the client.

The node's instances and the requests placed on them are its book (mesh.control.node_book),
which changes before a call goes out (and is undone on refusal), so an event that overtakes
the reply to its own call still finds its request. What happens unasked (a request evicted,
an instance loaded, gone or stopped, the agent up or down, a staged start's weights moved)
goes to the node's `AgentNodeListener`, given when it is made (the service's NodePool).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Awaitable, Callable, Collection, Mapping, Protocol, Sequence, overload

from mesh.control.agent_client import AgentCallError, AgentClient, AgentDown
from mesh.control.cluster_node import CONNECTION, EXITED, HEARTBEAT, ClusterNode, HostedInstance
from mesh.control.node_book import AgentInstance, BookListener, NodeBook, resume_from
from mesh.control.supervisor import AgentHandle
from mesh.policy.admission import Admission, InstancePlan
from mesh.policy.node_spec import NodeSpec
from mesh.policy.shadow import DEFAULT_MARGIN
from mesh.policy.slo import Deadlines
from mesh.tasks import cancel_all
from mesh.wire.agent_protocol import (
    Abort,
    Admit,
    AdmitEntry,
    AdmitResult,
    Code,
    DoneEvent,
    EvictedEvent,
    Forget,
    InstanceEvent,
    InstanceSpec,
    NewInstance,
    NodeEvent,
    Probe,
    ProtocolError,
    Request,
    Stats,
    TakeBack,
    TokensEvent,
    Unload,
    Validate,
    ValidateGroup,
    ValidateNew,
    ValidationReply,
    event_from_message,
    mean_output_to,
    slo_to_dict,
)
from mesh.wire.served_request import Outcome, ServedRequest

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
STATS_EVERY_S = 1.0

# (plan, node) -> how the agent loads the planned instance (its weights placed on that
# node first, when the service multicasts them); raises to refuse the start: the error's
# text is the operator's detail (`last_start_error`, logged).
LoadSpecFor = Callable[[InstancePlan, "AgentNode"], Awaitable[InstanceSpec]]
ProfileFor = Callable[[str, str], str | None]  # (model, node kind) -> its calibration profile file, if any
# (plan, node) -> must the planned instance's weights reach the node before its load (the
# placement's weights plane says)? Then its start is staged (`AgentNode.start_instance`).
TransferFirst = Callable[[InstancePlan, "AgentNode"], bool]

AgentFactory = Callable[..., AgentHandle]  # (spec, on_up, on_down, on_event, settings)


class StartRefused(Exception):
    """A `LoadSpecFor` that cannot make the spec: its text is the operator's detail (an error
    told to tenants is redacted; this one is logged and kept as `last_start_error`)."""


class AgentNodeListener(BookListener, Protocol):
    """What an AgentNode reports unasked: its book's events (a request evicted, an instance
    loaded, gone or stopped), its agent up or down, and a staged start's weights transfer."""

    def agent_up(self, node: AgentNode) -> None:
        """The node's agent is up (again): its capacity may have changed."""

    def agent_down(self, node: AgentNode) -> None:
        """The node's agent went down (its requests were handed back first)."""

    def weights_moved(self, node: AgentNode, nbytes: int, seconds: float) -> None:
        """A staged start's weights reached the node: `nbytes` in `seconds`."""


class AgentNode(ClusterNode):
    def __init__(self, spec: NodeSpec, agent_factory: AgentFactory, settings: Any, load_spec: LoadSpecFor,
                 listener: AgentNodeListener, profile_for: ProfileFor = lambda _model, _kind: None,
                 margin: float = DEFAULT_MARGIN, transfer_first: TransferFirst | None = None) -> None:
        """`listener`: whom the node reports to. `transfer_first`: which starts are staged
        (None: none is)."""
        self.margin = margin
        self.listener: AgentNodeListener = listener
        self.agent = agent_factory(spec, self._agent_up, self._agent_down, self._agent_event, settings)
        self._load_spec = load_spec
        self._profile_for = profile_for
        self._transfer_first = transfer_first
        self._book = NodeBook(self, listener)  # its instances and the requests placed on them
        self._instances = self._book.instances
        self.stats: dict[str, Any] = {}  # the agent's last `stats` reply (StatsReply), as /admin/cluster shows it
        self._budget_bytes = 0  # the memory budget in use (reservation station, 6.3)
        self._tasks: list[asyncio.Task] = []
        self._staging: set[asyncio.Task] = set()  # staged starts under way (`start_instance`)
        self.last_start_error = ""  # why the last instance start failed (for the operator)
        self.busy_fraction = 0.0  # of the last stats interval, the node's engines were stepping
        self._stepping: str | None = None  # the instance whose iteration is in flight (the agent's `node` event)

    # -- state -----------------------------------------------------------------------------
    @property
    def spec(self) -> NodeSpec:
        """The agent's: a remote agent's kind and memory come from its hello."""
        return self.agent.spec

    @property
    def layers_peer(self) -> tuple[str, str | None] | None:
        """The agent's layer port and its token (an emulating agent lends time to live
        instances there, mesh.node.lending); None while it has none or is down."""
        client = self.agent.client
        if client is None or client.hello is None or client.hello.layers is None:
            return None
        return client.hello.layers, self.agent.token

    @property
    def _client(self) -> AgentClient:
        """The connection to the agent; AgentDown while there is none."""
        client = self.agent.client
        if client is None:
            raise AgentDown(f"node {self.node_id} has no connection to its agent")
        return client

    @property
    def instances(self) -> Mapping[str, HostedInstance]:
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
        req = self._book.get(request_id)
        return req.tokens_out if req is not None else 0

    def used_bytes(self) -> int:
        """The agent's budget in use, and what the staged instances will take."""
        return self._budget_bytes + sum(i.staged_bytes for i in self._instances.values())

    def staging(self, instance_id: str) -> bool:
        inst = self._instances.get(instance_id)
        return inst is not None and inst.staged_bytes > 0

    def loaded_from(self, instance_id: str) -> str | None:
        return self._book.loaded_from.get(instance_id)

    def parked(self, model: str) -> bool:
        return model in self.stats.get("parked", {}).get("models", ())  # as of the last stats

    def can_fit(self, instance_bytes: int) -> bool:
        return self.capacity_bytes - self.used_bytes() >= instance_bytes

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.agent.start()
        self._tasks.append(asyncio.get_running_loop().create_task(self._poll_stats(), name=f"stats {self.node_id}"))

    async def stop(self) -> None:
        # cancel_all: a stats poll whose reply came with its cancellation would go on polling
        # (asyncio.wait_for before Python 3.12, mesh.tasks), and a gather on it wait forever
        await cancel_all([*self._tasks, *self._staging])
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
            stats = await self._client.call(Stats(), CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError):
            return
        prev = self.stats
        if prev and stats.uptime_s > prev.get("uptime_s", 0):
            self.busy_fraction = min(1.0, (stats.busy_s - prev["busy_s"]) / (stats.uptime_s - prev["uptime_s"]))
        self.stats = stats.to_fields()
        self._budget_bytes = int(stats.memory.get("budget_bytes", self._budget_bytes))

    # -- verbs -------------------------------------------------------------------------------
    async def _ask(self, request: Request[ValidationReply]) -> Admission:
        """A validation the agent answers with a ValidationReply; a node that cannot answer refuses."""
        if not self.up:
            return Admission(False, refusal=f"node {self.node_id} is {self.agent.state}")
        try:
            verdict = await self._client.call(request, CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError) as exc:
            return Admission(False, refusal=f"node {self.node_id}: {exc}")
        return Admission(verdict.admit, refusal="" if verdict.admit else verdict.reason)

    async def validate(self, instance_id: str, req: ServedRequest, *, exclude: Collection[str] = ()) -> Admission:
        return await self._ask(Validate(instance_id, _probe(req, req.tokens_out, req.deadlines), list(exclude)))

    async def validate_group(self, instance_id: str, reqs: Sequence[ServedRequest], done: Sequence[int]) -> Admission:
        return await self._ask(ValidateGroup(instance_id, [_probe(r, d, r.deadlines)
                                                           for r, d in zip(reqs, done, strict=True)]))

    async def validate_new(self, plan: InstancePlan, reqs: Sequence[ServedRequest], done: Sequence[int], *,
                           deadlines: Sequence[Deadlines] | None = None) -> Admission:
        moved = [r.deadlines for r in reqs] if deadlines is None else deadlines
        p = NewInstance(plan.instance_id, plan.model, plan.weight_bytes, plan.kv_bytes_per_token, plan.context_window,
                        plan.max_batch, plan.slo, plan.expected_load_s, self._profile_for(plan.model, self.spec.kind),
                        mean_output_to(plan.mean_output))
        return await self._ask(ValidateNew(p, [_probe(r, d, m) for r, d, m in zip(reqs, done, moved, strict=True)]))

    async def try_admit(self, instance_id: str, req: ServedRequest, *, compute: bool = True,
                        deadlines: Deadlines | None = None) -> Admission:
        inst = self._instances.get(instance_id)
        if inst is None or not self.up:
            return Admission(False, refusal=f"no instance {instance_id} on {self.node_id}")
        self._book.hold(inst, req)  # before the call: its first tokens may overtake the reply
        if inst.staged_bytes:  # its weights are on their way: sent to the agent once its load is issued
            if deadlines is not None:
                req.late_s = deadlines.late_s
            inst.deferred.append((req, compute))
            return Admission(True)
        return await self._send_admit(inst, req, compute, deadlines=deadlines)

    async def _send_admit(self, inst: AgentInstance, req: ServedRequest, compute: bool,
                          deferred: bool = False, deadlines: Deadlines | None = None) -> Admission:
        """The agent's admit of a request held on `inst` (validation and admission in one step),
        with `deadlines` in place of its own (kept if admitted)."""
        instance_id = inst.instance_id
        er = req.engine_request
        moved = req.deadlines if deadlines is None else deadlines
        entry = AdmitEntry(req.request_id, instance_id, list(er.token_ids()[:er.prompt_len + req.tokens_out]),
                           er.sampling, _age(req.arrival_s), req.tokens_out, er.prompt_len, compute,
                           _age(req.first_token_s), moved.late_s, req.best_effort)
        try:
            result = (await self._client.call(Admit([entry]), CALL_TIMEOUT_S)).results[0]
        except (AgentDown, AgentCallError, IndexError) as exc:
            result = AdmitResult(False, Code.FAILED.value, f"node {self.node_id}: {exc}")
        if result.ok:
            req.late_s = moved.late_s
            if req.on_admitted is not None:  # the one admitted event (the service's stream starts)
                req.on_admitted(req)
            return Admission(True)
        if inst.requests.get(req.request_id) is not req:
            # it left the node during the call (the node was lost, `lose`; or it ended): whoever
            # took it places it again, so it must not be placed from here too
            return Admission(True)
        if deferred:  # the dispatcher counted it placed: it is placed again
            self._hand_back(inst, req,
                            f"refused by {self.node_id} once its instance loaded: {result.reason or result.code}")
            return Admission(False, refusal=str(result.reason or result.code))
        self._book.release(req.request_id)
        req.node_id = req.instance_id = None
        log.debug("%s refused %s on %s: %s", self.node_id, req.request_id, instance_id, result)
        return Admission(False, refusal=str(result.reason or result.code))

    async def take_back(self, request_id: str, why: str) -> ServedRequest | None:
        req = self._book.get(request_id)
        if req is None or not self.up:
            return None
        try:
            progress = await self._client.call(TakeBack(request_id, why), CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError) as exc:  # it ended meanwhile, or the node is gone (or a malformed reply)
            log.info("take_back of %s from %s: %s", request_id, self.node_id, exc)
            return None
        self._book.release(request_id)
        resume_from(req, progress, f"taken from {self.node_id} after {progress.tokens_out} tokens: {why}")
        return req

    async def start_instance(self, plan: InstancePlan) -> bool:
        """Issue the planned instance's load. One whose weights must first reach this node
        (`transfer_first(plan)`: the weights plane multicasts them, seconds to minutes) is
        staged instead: True at once, its transfer and load go on in the background
        (`_start_staged`), and the requests admitted to it meanwhile are sent to the agent
        once its load is issued (so a scale-out never holds its model's placement
        decision, nor the queue behind it, for a transfer). Its memory counts as used from
        now on, so another decision does not plan the same room."""
        if not self.up:
            return False
        inst = AgentInstance(plan.instance_id, plan.model, idle_since=self._now())
        self._instances[plan.instance_id] = inst  # before the call: its ready event may overtake the reply
        if self._transfer_first is not None and self._transfer_first(plan, self):
            inst.staged_bytes = max(1, plan.weight_bytes)
            task = asyncio.get_running_loop().create_task(self._start_staged(plan, inst),
                                                          name=f"stage {plan.instance_id}")
            self._staging.add(task)
            task.add_done_callback(self._staging.discard)
            return True
        if await self._issue(plan, inst):
            return True
        if self._instances.get(plan.instance_id) is inst:
            self._instances.pop(plan.instance_id, None)
        return False

    async def _issue(self, plan: InstancePlan, inst: AgentInstance) -> bool:
        """The load: its spec (the weights placed here first), then the agent's `load`.
        False if it was not issued; the instance stays in `_instances` for the caller to
        clean up (a staged one's books go with it: `_start_staged`)."""
        try:
            spec = dataclasses.replace(await self._load_spec(plan, self), slo=slo_to_dict(plan.slo),
                                       expected_load_s=plan.expected_load_s,
                                       mean_output=mean_output_to(plan.mean_output))
            self._book.means[plan.model] = plan.mean_output
            if self._instances.get(plan.instance_id) is not inst:  # stopped while its weights moved
                return False
            await self._client.call(spec, CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - weights not placed, memory, engine: not started
            log.warning("starting %s on %s failed: %s", plan.instance_id, self.node_id, exc)
            self.last_start_error = str(exc)  # the operator's detail (`LoadSpecFor`)
            return False
        # the memory budget in use came with the reply (the agent's `node` event follows it in
        # the same write): weights and initial KV cache, as the replay's station counts them
        return True

    async def _start_staged(self, plan: InstancePlan, inst: AgentInstance) -> None:
        """A staged instance's transfer and load, then the requests admitted to it meanwhile
        go to the agent; if it cannot start (or one is refused there), they are handed back
        to the dispatcher to be placed again elsewhere, as evicted ones are."""
        issued = self._now()
        ok = await self._issue(plan, inst)
        inst.staged_bytes = 0
        if ok:
            self.listener.weights_moved(self, plan.weight_bytes, self._now() - issued)
        if ok and self._instances.get(plan.instance_id) is not inst:  # stopped while it moved: not kept
            await self._unload_quietly(plan.instance_id)
            ok = False
        deferred, inst.deferred = inst.deferred, []
        if not ok:
            ours = self._instances.get(plan.instance_id) is inst  # (not stopped, nor lost with its agent)
            if ours:
                self._instances.pop(plan.instance_id, None)
                self._book.settled(inst, False)
            for req, _ in deferred:
                self._hand_back(inst, req, f"its instance {plan.instance_id} could not start on {self.node_id}: "
                                     f"{self.last_start_error or 'stopped'}")
            if ours:
                self.listener.instance_gone(self, plan.instance_id)
            return
        for req, compute in deferred:
            if req.outcome is None and req.request_id in inst.requests:
                await self._send_admit(inst, req, compute, deferred=True)

    async def _unload_quietly(self, instance_id: str) -> None:
        try:
            await self._client.call(Unload(instance_id), CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError) as exc:
            log.warning("unloading %s on %s: %s", instance_id, self.node_id, exc)

    def _hand_back(self, inst: AgentInstance, req: ServedRequest, why: str) -> None:
        """A request admitted to a staged instance that could not take it: placed again."""
        if self._book.release(req.request_id, inst) is None or req.outcome is not None:
            return
        req.attempts.append(why)
        req.node_id = req.instance_id = None
        self.listener.request_evicted(self, req)

    async def stop_instance(self, instance_id: str) -> None:
        inst = self._instances.pop(instance_id, None)
        if inst is None:
            return
        self._book.settled(inst, False)
        if not self.up or inst.staged_bytes:  # staged: its load was not issued (`_start_staged` cleans up)
            return
        try:
            await self._client.call(Unload(instance_id), CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError) as exc:
            log.warning("unloading %s on %s: %s", instance_id, self.node_id, exc)
        await self.refresh()

    async def forget_model(self, model: str) -> None:
        """A deleted model with no instance left: its mean here and its state on the agent
        (fronts, tokenizer, learnt times, builds ahead, parked workers) go."""
        self._book.means.pop(model, None)
        if not self.up:  # a restarted agent has nothing of it
            return
        try:
            await self._client.call(Forget(model), CALL_TIMEOUT_S)
        except (AgentDown, AgentCallError) as exc:
            log.warning("node %s could not forget model %s: %s", self.node_id, model, exc)

    async def wait_loaded(self, instance_id: str, timeout_s: float) -> bool:
        """Wait until the instance is ready (True) or gone: failed to load, unloaded (False)."""
        return await self._book.wait_loaded(instance_id, timeout_s)

    def lose(self, why: str, cause: str) -> int:
        """The node is lost (`cause`, one of LOSS_CAUSES; `why` for the operator): its instances
        are gone, and every request it held goes back to the dispatcher with the progress this
        service saw (`hand_back_lost`). Returns how many."""
        n = self.hand_back_lost(self._book.lose_node(why), why, cause)
        if n:
            log.warning("node %s lost (%s): %d requests placed again with their progress", self.node_id, cause, n)
        return n

    def abort(self, request_id: str, why: str) -> None:
        """Ask the agent to end the request (its `done` event, failed, ends it here); one
        held for a staged instance ends here."""
        inst, req = self._book.find(request_id) or (None, None)
        if inst is not None and any(r is req for r, _ in inst.deferred):
            inst.deferred = [(r, c) for r, c in inst.deferred if r is not req]
            self._book.end_here(request_id, Outcome.FAILED, why)
        elif self.up:
            self._client.send(Abort(request_id))
        else:
            self._book.end_here(request_id, Outcome.FAILED, why)

    # -- agent events ------------------------------------------------------------------------------
    def _agent_event(self, _agent: AgentHandle, m: dict[str, Any]) -> None:
        try:
            event = event_from_message(m)
        except ProtocolError as exc:
            log.warning("node %s sent a malformed event: %s", self.node_id, exc)
            return
        if isinstance(event, TokensEvent):
            self._book.tokens(event)
        elif isinstance(event, DoneEvent):
            self._book.done(event)
        elif isinstance(event, EvictedEvent):
            self._book.evicted(event)
        elif isinstance(event, NodeEvent):
            self._stepping = event.stepping
            self._budget_bytes = event.budget_bytes
        elif isinstance(event, InstanceEvent):
            self._book.instance(event)

    def _agent_up(self, agent: AgentHandle) -> None:
        log.warning("node agent %s is up (generation %d)", agent.node_id, agent.generation)
        # A reconnected agent that kept running holds instances nobody here knows: unload them.
        client = agent.client
        if client is not None and client.hello is not None:
            for view in client.hello.instances:
                client.send(Unload(str(view.get("instance_id"))))
        self._budget_bytes = 0
        self._stepping = None  # until the agent says
        self.listener.agent_up(self)

    def _agent_down(self, agent: AgentHandle, reason: str) -> None:
        why = f"node agent {agent.node_id} died ({reason}); it is being restarted"
        self.lose(why, loss_cause(reason))
        self.stats = {}
        self._stepping = None
        self.listener.agent_down(self)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()


def loss_cause(reason: str) -> str:
    """The cause of a node loss from its agent handle's reason (mesh.control.agent_client's
    close reasons; the supervisor adds the exit status of a process it saw end)."""
    if "heartbeat" in reason:
        return HEARTBEAT
    if "exit status" in reason or "process exited" in reason:
        return EXITED
    return CONNECTION


def _probe(req: ServedRequest, done: int, deadlines: Deadlines) -> Probe:
    """A request as the agent's validation needs it, its deadlines running from `deadlines`."""
    return Probe(req.request_id, req.prompt_len, req.engine_request.sampling.max_tokens,
                 _age(req.arrival_s), done, _age(req.first_token_s), deadlines.late_s, req.best_effort)


@overload
def _age(t: float) -> float: ...


@overload
def _age(t: None) -> None: ...


def _age(t: float | None) -> float | None:
    """A time as seconds ago, for the agent's clock (the pace rule runs from the first token)."""
    return None if t is None else max(0.0, asyncio.get_running_loop().time() - t)
