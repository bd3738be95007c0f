"""Placement: where a request runs. The control service's one interface to the nodes.

`Placement` is what the HTTP layer uses: `submit(job) -> RequestStream`, `abort`,
`forget_model`, `view`, `healthy`, `start`/`stop`. The cluster dispatcher (issue 3) can
replace `LocalPlacement` behind it.

`LocalPlacement` is the embedded default: the local node agents (`--cpu-nodes` CPU agents,
plus GPU agents where vLLM finds GPUs), at most one instance per model per node, started on
the first request for it (cold start) and recycled after `keep_alive_s` idle. A request is

1. given a node (mesh.policy.node_choice: the model's instance that takes requests, else a
   scale-out to a node without one, host copies of the weights first) and that node's
   instance (loaded if none, from the node's own copy of the weights, which the weights
   plane multicasts there first if needed (mesh.service.weights_plane); if the node's
   memory budget refuses the load, idle instances are recycled, least recently used first);
2. tokenized on the agent, so its prompt length is known: over the context window is a 400;
3. queued for admission on its node. A per-node worker sends the queue, most urgent TTFT
   deadline first, to the agent in one `admit` batch; the agent validates and admits each
   atomically (shadow validation on both subsystems, LLM-Mesh 5.3/6.4) and refuses the
   rest of an instance's batch after its first refusal, keeping arrival order. Refused
   requests wait for capacity (a request finishing, an instance ready, or a 100 ms tick)
   until their TTFT deadline, then get a 429 with the reason. The deadline of a request
   that waited for a cold start counts from when its instance became ready: the load is
   not the request's fault, and TTFT metrics still show it.

A node agent that dies fails its running requests (an error event on a stream that started)
and its instances; its queued requests (not yet admitted) are placed again, on another node
when one is up (else 503); the supervisor restarts it and the next request loads again.

Nodes come and go while serving (`add_node`, `remove_node`: the Ray cluster's membership,
mesh.cluster.ray_nodes): a removed node's streams end with an error event, its queued
requests are placed on other nodes, and its copies leave the parameter pool.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

from mesh.agent.client import AgentCallError, AgentDown
from mesh.agent.protocol import Code, InstanceSpec, sampling_to_dict, slo_to_dict
from mesh.agent.supervisor import AgentHandle, AgentSettings, LocalAgent
from mesh.policy.node_choice import NodeView, choose_node
from mesh.runtime.node import NodeSpec
from mesh.runtime.tasks import cancel_all
from mesh.service.errors import ApiError, bad_request, context_too_long, internal_error, node_unavailable, overloaded
from mesh.service.registry import ModelRecord
from mesh.service.streams import Finished, Job, RequestStream, Tokens
from mesh.service.weights_plane import WeightsError, WeightsPlane

log = logging.getLogger("mesh.service.placement")

ADMIT_BATCH = 64
RETRY_TICK_S = 0.1
CALL_TIMEOUT_S = 30.0
HOUSEKEEPING_S = 1.0  # stats poll and keep-alive check


class Placement(Protocol):
    """What the control service needs from whatever places requests on nodes."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def submit(self, job: Job) -> RequestStream:
        """Place a request; raises ApiError (400 prompt too long, 429 no capacity in time,
        503 no node) or returns its stream of tokens."""

    def abort(self, request_id: str) -> None: ...

    async def forget_model(self, model_uid: str) -> None:
        """The model was deleted: unload its idle instances."""

    def model_registered(self, model: ModelRecord) -> None:
        """A model was registered: place its first host copy (in the background)."""

    async def scale_out(self, model: ModelRecord, nodes: list[str]) -> dict[str, Any]:
        """Start instances of `model` on `nodes` now; per node its instance or the error."""

    def view(self) -> dict[str, Any]:
        """Nodes, instances, memory budget and use, queue lengths (for /admin/cluster, /metrics)."""

    def healthy(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    keep_alive_s: float = 60.0
    start_timeout_s: float = 60.0
    max_num_seqs: int = 64
    profile_dir: str | None = None  # calibration profiles: <dir>/<model uid>.json (issue 4)
    agent: AgentSettings = field(default_factory=AgentSettings)


@dataclass(eq=False)
class Instance:
    instance_id: str
    node_id: str
    generation: int
    model: ModelRecord
    ready: asyncio.Future
    state: str = "loading"  # loading, ready, failed
    ready_at: float = math.inf
    active: int = 0  # admitted and not done
    pinned: int = 0  # requests being placed on it (tokenizing, queued)
    idle_since: float = 0.0
    weights: str = "registry path"  # where its engine's weights came from


@dataclass(eq=False)
class _Waiter:
    job: Job
    ids: list[int]
    instance: Instance
    slo_start: float
    deadline: float
    stream: RequestStream
    done: asyncio.Future
    reason: str = "queued: the node's earlier requests took its capacity until the deadline"
    tried: bool = False  # sent to the agent at least once


class _Retry(Exception):
    """The instance disappeared under the request: place it again."""


class LocalPlacement:
    def __init__(self, nodes: list[NodeSpec], settings: PlacementSettings | None = None,
                 agent_factory: Callable[..., AgentHandle] = LocalAgent,
                 weights: Callable[[dict[str, AgentHandle]], WeightsPlane] | None = None) -> None:
        """`agent_factory(spec, on_up, on_down, on_event, settings)` makes each node's agent
        handle (tests pass one that runs the agent in-process); `weights(agents)` makes the
        weights plane (None: nodes load models from the registry's path)."""
        self.settings = settings or PlacementSettings()
        self._agent_factory = agent_factory
        self.agents: dict[str, AgentHandle] = {
            n.node_id: agent_factory(n, self._agent_up, self._agent_down, self._agent_event, self.settings.agent)
            for n in nodes}
        self.weights = weights(self.agents) if weights is not None else None
        self.instances: dict[str, Instance] = {}
        self._by_model: dict[tuple[str, str], Instance] = {}
        self._streams: dict[str, tuple[RequestStream, Instance]] = {}
        self._queues: dict[str, list[_Waiter]] = {n: [] for n in self.agents}
        self._kicks: dict[str, asyncio.Event] = {}
        self._stats: dict[str, dict[str, Any]] = {}
        self._busy: dict[str, float] = {}
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._workers: dict[str, asyncio.Task] = {}  # node -> its admission worker
        self._loads: set[asyncio.Task] = set()
        self._started = False

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.weights is not None:
            await self.weights.start()
        for node_id, agent in self.agents.items():
            self._kicks[node_id] = asyncio.Event()
            await agent.start()
            self._workers[node_id] = loop.create_task(self._admission_worker(node_id), name=f"admission {node_id}")
        self._started = True
        self._tasks.append(loop.create_task(self._housekeeping(), name="placement housekeeping"))
        for agent in self.agents.values():
            if agent.remote:  # on another machine: served once reachable
                continue
            if not await agent.wait_up(self.settings.start_timeout_s):
                raise RuntimeError(f"node agent {agent.node_id} did not start: {agent.last_error or 'timeout'}")

    async def stop(self) -> None:
        await cancel_all([*self._tasks, *self._workers.values(), *self._loads])
        await asyncio.gather(*(a.stop() for a in self.agents.values()), return_exceptions=True)
        if self.weights is not None:
            await self.weights.stop()

    def healthy(self) -> bool:
        return all(a.up for a in self.agents.values())

    # ---- membership: nodes that join or leave while serving ---------------------------------
    async def add_node(self, spec: NodeSpec, agent_factory: Callable[..., AgentHandle] | None = None) -> AgentHandle:
        """A node joined: start its agent handle (made by `agent_factory`, default the
        placement's) and its admission worker. It gets models by multicast on first use."""
        if spec.node_id in self.agents:
            raise ValueError(f"node {spec.node_id} is already placed on")
        factory = agent_factory or self._agent_factory
        agent = factory(spec, self._agent_up, self._agent_down, self._agent_event, self.settings.agent)
        self.agents[spec.node_id] = agent
        self._queues[spec.node_id] = []
        self._kicks[spec.node_id] = asyncio.Event()
        if self._started:
            await agent.start()
            self._workers[spec.node_id] = asyncio.get_running_loop().create_task(
                self._admission_worker(spec.node_id), name=f"admission {spec.node_id}")
        log.warning("node %s joined (%s)", spec.node_id, spec.kind)
        return agent

    async def remove_node(self, node_id: str, reason: str) -> None:
        """A node left (its machine died or was removed): its streams end with an error event,
        its queued requests are placed again elsewhere, its instances are gone and its copies
        leave the parameter pool; /admin/cluster no longer lists it."""
        agent = self.agents.get(node_id)
        if agent is None:
            return
        self._fail_node(agent, node_unavailable(f"node {node_id} left the cluster ({reason})"))
        del self.agents[node_id]  # all of it before the first await: re-placed requests see it gone
        self._queues.pop(node_id, None)
        self._kicks.pop(node_id, None)
        self._busy.pop(node_id, None)
        if self.weights is not None:
            self.weights.node_removed(node_id)
        worker = self._workers.pop(node_id, None)
        await cancel_all([worker] if worker is not None else [])
        await agent.stop()
        log.warning("node %s left: %s", node_id, reason)

    # ---- requests ----------------------------------------------------------------------------
    async def submit(self, job: Job) -> RequestStream:
        for attempt in range(3):
            try:
                return await self._submit_once(job)
            except _Retry:
                continue
        raise node_unavailable("the model's instance kept disappearing while the request was placed")

    async def _submit_once(self, job: Job) -> RequestStream:
        agent = self._choose_agent(job.model)
        try:
            inst = await self._ensure_instance(agent, job.model)
        except ApiError:
            if self.agents.get(agent.node_id) is not agent or not agent.up:
                raise _Retry() from None  # the node went away while the instance loaded: another one
            raise
        inst.pinned += 1  # not recycled while this request is being placed
        try:
            return await self._place(agent, inst, job)
        finally:
            inst.pinned -= 1
            if inst.active == 0 and inst.pinned == 0:
                inst.idle_since = asyncio.get_running_loop().time()

    async def _place(self, agent: AgentHandle, inst: Instance, job: Job) -> RequestStream:
        ids = job.prompt_token_ids
        if ids is None:
            ids = await self._tokenize(agent, inst, job)
        window = job.model.context_length
        if len(ids) + 1 > window:
            raise context_too_long(len(ids), window, "messages" if job.messages is not None else "prompt")
        if job.sampling.max_tokens <= 0:  # not given: up to the context window
            job = replace(job, sampling=replace(job.sampling, max_tokens=window - len(ids)))
        loop = asyncio.get_running_loop()
        slo_start = max(job.arrival_s, inst.ready_at)
        deadline = slo_start + job.model.slo.ttft_s(len(ids))
        stream = RequestStream(job.request_id, len(ids), agent.node_id, inst.instance_id, on_abort=self.abort)
        waiter = _Waiter(job, ids, inst, slo_start, deadline, stream, loop.create_future())
        queue = self._queues.get(agent.node_id)
        if queue is None or self.agents.get(agent.node_id) is not agent:
            raise _Retry()  # the node left while the request was tokenized
        self._streams[job.request_id] = (stream, inst)
        queue.append(waiter)
        self._kick(agent.node_id)
        try:
            await waiter.done
        except BaseException:
            if waiter in queue:
                queue.remove(waiter)
            if waiter.done.done() and not waiter.done.cancelled() and waiter.done.exception() is None:
                stream.abort()  # admitted, then cancelled: its done event ends the bookkeeping
            else:
                self._streams.pop(job.request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        agent = self.agents.get(entry[1].node_id)
        if agent is not None and agent.client is not None:
            agent.client.send({"t": "abort", "request_id": request_id})

    def _choose_agent(self, model: ModelRecord) -> AgentHandle:
        """GGUF and OpenVINO IR models run on CPU nodes (OpenVINO); Hugging Face folders on
        GPU nodes (vLLM, issue 6). Which node of the kind: mesh.policy.node_choice."""
        kind = model.node_kind
        nodes = [a for a in self.agents.values() if a.spec.kind == kind]
        if not nodes and kind == "gpu":
            raise bad_request("Hugging Face folders need a GPU node (vLLM), and this server has none; export the "
                              "model to OpenVINO IR or GGUF and register that.", "model")
        choice = choose_node(self._node_views(model), kind, model.weight_bytes)
        if choice is None:
            states = ", ".join(f"{a.node_id} {a.state}" for a in nodes) or "none configured"
            raise node_unavailable(f"no {kind.upper()} node agent is up ({states})")
        if choice.new_instance and any(i.model.uid == model.uid for i in self.instances.values()):
            log.info("scale-out of %s/%s: %s", model.tenant, model.name, choice.reason)
        return self.agents[choice.node_id]

    def _node_views(self, model: ModelRecord) -> list[NodeView]:
        held = set(self.weights.holders(model.uid)) if self.weights is not None else set()
        views = []
        for node_id, agent in self.agents.items():
            memory = self._stats.get(node_id, {}).get("memory", {})
            capacity = int(memory.get("capacity_bytes", agent.spec.memory_bytes))
            free = int(memory.get("free_bytes", capacity))
            inst = self._by_model.get((node_id, model.uid))
            live = inst is not None and inst.generation == agent.generation and inst.state != "failed"
            waiting = [w for w in self._queues[node_id] if w.instance is inst] if live else []
            views.append(NodeView(
                node_id, agent.spec.kind, agent.up, free, capacity - free,
                instance=inst.state if live else None, refusing=any(w.tried for w in waiting),
                active=inst.active if live else 0, queued=len(waiting), host_copy=node_id in held))
        return views

    async def _ensure_instance(self, agent: AgentHandle, model: ModelRecord) -> Instance:
        key = (agent.node_id, model.uid)
        inst = self._by_model.get(key)
        if inst is None or inst.generation != agent.generation or inst.state == "failed":
            inst = Instance(f"{model.uid}-{agent.node_id}-{next(self._ids)}", agent.node_id, agent.generation, model,
                            asyncio.get_running_loop().create_future())
            inst.ready.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
            self._by_model[key] = inst
            self.instances[inst.instance_id] = inst
            task = asyncio.get_running_loop().create_task(self._load(agent, inst), name=f"load {inst.instance_id}")
            self._loads.add(task)
            task.add_done_callback(self._loads.discard)
        await asyncio.shield(inst.ready)
        return inst

    async def _load(self, agent: AgentHandle, inst: Instance) -> None:
        model = inst.model
        profile = None
        if self.settings.profile_dir:
            from pathlib import Path

            candidate = Path(self.settings.profile_dir) / f"{model.uid}.json"
            profile = str(candidate) if candidate.is_file() else None
        engine = "vllm" if agent.spec.kind == "gpu" else "openvino"
        try:
            path = model.path
            if self.weights is not None and self.weights.carries(model):
                copy = await self.weights.copy_on(model, agent.node_id)
                path, inst.weights = copy.path, copy.how
            spec = InstanceSpec(inst.instance_id, model.uid, path, model.context_length, slo_to_dict(model.slo),
                                self.settings.max_num_seqs, profile, engine)
            for _ in range(len(self.instances) + 1):
                try:
                    await agent.client.call(spec.to_message(), CALL_TIMEOUT_S)
                    return  # the agent answers `instance` ready/failed when the load ends
                except AgentCallError as exc:
                    if exc.code != Code.MEMORY.value or not await self._recycle_one(agent, exclude=inst):
                        raise
            raise AgentCallError(Code.MEMORY.value, "node memory stays full", {})
        except AgentCallError as exc:
            if exc.code == Code.MEMORY.value:
                error = overloaded(f"node {agent.node_id} has no memory for this model while its instances are busy: {exc}")
            else:
                error = ApiError(503, f"The model failed to load: {exc}", "server_error", "model", "model_load_failed")
            self._instance_failed(inst, error)
        except AgentDown as exc:
            self._instance_failed(inst, node_unavailable(str(exc)))
        except WeightsError as exc:
            self._instance_failed(inst, ApiError(503, f"The model's weights could not reach node {agent.node_id}: "
                                                      f"{exc}", "server_error", "model", "weights_unavailable"))
        except Exception as exc:  # noqa: BLE001 - must not leave waiters hanging
            log.exception("loading %s failed", inst.instance_id)
            self._instance_failed(inst, node_unavailable(f"loading failed: {exc}"))

    def _instance_failed(self, inst: Instance, error: ApiError) -> None:
        inst.state = "failed"
        if not inst.ready.done():
            inst.ready.set_exception(error)
        self._forget_instance(inst)

    def _forget_instance(self, inst: Instance) -> None:
        self.instances.pop(inst.instance_id, None)
        if self.weights is not None:
            self.weights.instance_stopped(inst.model.uid, inst.instance_id)
        key = (inst.node_id, inst.model.uid)
        if self._by_model.get(key) is inst:
            del self._by_model[key]

    async def _recycle_one(self, agent: AgentHandle, exclude: Instance) -> bool:
        """Unload the least recently used idle instance on the agent; False if none is idle."""
        waiting = {w.instance.instance_id for w in self._queues.get(agent.node_id, ())}
        idle = [i for i in self.instances.values() if i.node_id == agent.node_id and i is not exclude
                and i.state == "ready" and i.active == 0 and i.pinned == 0 and i.instance_id not in waiting]
        for inst in sorted(idle, key=lambda i: i.idle_since):
            if await self._unload(agent, inst):
                return True
        return False

    async def _unload(self, agent: AgentHandle, inst: Instance) -> bool:
        self._forget_instance(inst)
        try:
            await agent.client.call({"t": "unload", "instance_id": inst.instance_id}, CALL_TIMEOUT_S)
            return True
        except AgentCallError as exc:
            if exc.code == Code.BUSY.value:  # a request got in: keep it
                self.instances[inst.instance_id] = inst
                self._by_model.setdefault((inst.node_id, inst.model.uid), inst)
            return exc.code == Code.NO_INSTANCE.value
        except AgentDown:
            return False

    async def _tokenize(self, agent: AgentHandle, inst: Instance, job: Job) -> list[int]:
        message: dict[str, Any] = {"t": "tokenize", "instance_id": inst.instance_id}
        if job.messages is not None:
            message["messages"] = job.messages
        else:
            message["prompt"] = job.prompt
        try:
            reply = await agent.client.call(message, CALL_TIMEOUT_S)
        except AgentCallError as exc:
            if exc.code in (Code.NO_INSTANCE.value, Code.NOT_READY.value):
                raise _Retry() from exc
            raise bad_request(str(exc).replace(job.model.uid, job.model.name),
                              "messages" if job.messages is not None else "prompt") from exc
        except AgentDown as exc:
            raise node_unavailable(str(exc)) from exc
        return [int(t) for t in reply["ids"]]

    # ---- admission -----------------------------------------------------------------------------
    async def _admission_worker(self, node_id: str) -> None:
        kick = self._kicks[node_id]
        queue = self._queues[node_id]
        loop = asyncio.get_running_loop()
        while True:
            if queue:
                timeout = RETRY_TICK_S
                try:
                    await asyncio.wait_for(kick.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
            else:
                await kick.wait()
            kick.clear()
            if not queue:
                continue
            now = loop.time()
            for w in [w for w in queue if w.deadline <= now and w.tried]:  # untried: ask once, for the reason
                queue.remove(w)
                if not w.done.done():
                    w.done.set_exception(overloaded(w.reason))
            queue.sort(key=lambda w: w.deadline)
            batch = [w for w in queue if not w.done.done()][:ADMIT_BATCH]
            if not batch:
                queue[:] = [w for w in queue if not w.done.done()]
                continue
            try:
                await self._admit_batch(node_id, batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the worker must survive anything
                log.exception("admission round on %s failed", node_id)

    async def _admit_batch(self, node_id: str, batch: list[_Waiter]) -> None:
        agent = self.agents[node_id]
        queue = self._queues[node_id]
        now = asyncio.get_running_loop().time()
        entries = [{"request_id": w.job.request_id, "instance_id": w.instance.instance_id,
                    "prompt_token_ids": w.ids, "sampling": sampling_to_dict(w.job.sampling),
                    "age_s": max(0.0, now - w.slo_start)} for w in batch]
        try:
            if agent.client is None:
                raise AgentDown(f"agent {node_id} is not connected")
            reply = await agent.client.call({"t": "admit", "requests": entries}, CALL_TIMEOUT_S)
        except AgentDown as exc:
            for w in batch:
                self._settle(queue, w, node_unavailable(str(exc)))
            return
        except AgentCallError as exc:  # the agent failed the whole call: find the request(s) it fails on
            if len(batch) > 1:
                for w in batch:
                    await self._admit_batch(node_id, [w])
                return
            log.warning("admission of %s on %s failed: %s", batch[0].job.request_id, node_id, exc)
            self._settle(queue, batch[0], internal_error())
            return
        for w, result in zip(batch, reply.get("results", [])):
            w.tried = True
            if w.done.done():  # the client went away while we asked: undo
                if result.get("ok"):  # its stream is forgotten, so its done event is ignored
                    agent.client.send({"t": "abort", "request_id": w.job.request_id})
                if w in queue:
                    queue.remove(w)
                continue
            code = result.get("code")
            if result.get("ok"):
                w.instance.active += 1
                self._settle(queue, w, None)
            elif code in (Code.REFUSED.value, Code.BATCH_FULL.value, Code.NOT_READY.value):
                w.reason = result.get("reason") or w.reason
            elif code == Code.NO_INSTANCE.value:
                self._streams.pop(w.job.request_id, None)
                self._settle(queue, w, _Retry())
            else:
                reason = (result.get("reason") or "the node refused the request").replace(
                    w.job.model.uid, w.job.model.name)
                self._settle(queue, w, bad_request(reason, "messages" if w.job.messages is not None else "prompt"))

    @staticmethod
    def _settle(queue: list[_Waiter], w: _Waiter, error: BaseException | None) -> None:
        if w in queue:
            queue.remove(w)
        if w.done.done():
            return
        if error is None:
            w.done.set_result(True)
        else:
            w.done.set_exception(error)

    # ---- agent events --------------------------------------------------------------------------
    def _agent_event(self, agent: AgentHandle, m: dict[str, Any]) -> None:
        kind = m.get("t")
        if kind == "evicted":  # no other node takes it here (the cluster dispatcher would): it fails
            kind, m = "done", {"request_id": m.get("request_id"), "outcome": "failed",
                               "detail": f"evicted for lack of memory: {m.get('why')}"}
        if kind == "tokens":
            for rid, token_ids, text in m.get("items", ()):
                entry = self._streams.get(rid)
                if entry is not None:
                    entry[0].push(Tokens(text, token_ids))
        elif kind == "done":
            rid = m.get("request_id")
            entry = self._streams.pop(rid, None)
            if entry is None:
                return
            stream, inst = entry
            inst.active = max(0, inst.active - 1)
            if inst.active == 0 and inst.pinned == 0:
                inst.idle_since = asyncio.get_running_loop().time()
            if m.get("outcome") == "completed":
                stream.push(Finished(m.get("reason") or "stop", int(m.get("tokens_out") or 0)))
            else:
                stream.push(node_unavailable(f"the request failed on node {agent.node_id}: {m.get('detail') or 'failed'}"))
            self._kick(agent.node_id)
        elif kind == "instance":
            inst = self.instances.get(m.get("instance_id"))
            if inst is None:
                return
            if m.get("state") == "ready":
                inst.state = "ready"
                inst.ready_at = inst.idle_since = asyncio.get_running_loop().time()
                if self.weights is not None:
                    self.weights.instance_started(inst.model.uid, inst.node_id, inst.instance_id)
                if not inst.ready.done():
                    inst.ready.set_result(True)
                self._kick(agent.node_id)
            else:
                self._instance_failed(inst, ApiError(503, f"The model failed to load: {m.get('error')}",
                                                     "server_error", "model", "model_load_failed"))

    def _agent_up(self, agent: AgentHandle) -> None:
        log.warning("node agent %s is up (pid %s, generation %d)", agent.node_id, agent.pid, agent.generation)

    def _kick(self, node_id: str) -> None:
        kick = self._kicks.get(node_id)
        if kick is not None:
            kick.set()

    def _agent_down(self, agent: AgentHandle, reason: str) -> None:
        if self.agents.get(agent.node_id) is not agent:
            return  # a removed node
        self._fail_node(agent, node_unavailable(f"node agent {agent.node_id} died ({reason}); it is being restarted"))
        if self.weights is not None:
            self.weights.node_down(agent.node_id)

    def _fail_node(self, agent: AgentHandle, error: ApiError) -> None:
        """The node's agent is gone: streams that started end with `error`; queued requests
        (not admitted yet) are placed again (another node, or 503 when none is up)."""
        queue = self._queues[agent.node_id]
        queued = {w.job.request_id for w in queue}
        for rid, (stream, inst) in list(self._streams.items()):
            if inst.node_id == agent.node_id:
                del self._streams[rid]
                if rid not in queued:
                    stream.push(error)
        for w in list(queue):
            self._settle(queue, w, _Retry())
        for inst in [i for i in self.instances.values() if i.node_id == agent.node_id]:
            self._instance_failed(inst, error)
        self._stats.pop(agent.node_id, None)

    # ---- housekeeping: stats, busy fraction, keep-alive ----------------------------------------------
    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            for node_id, agent in list(self.agents.items()):
                if not agent.up or self.agents.get(node_id) is not agent:
                    continue
                try:
                    stats = await agent.client.call({"t": "stats"}, CALL_TIMEOUT_S)
                except (AgentDown, AgentCallError):
                    continue
                if self.agents.get(node_id) is not agent:
                    continue  # removed while asked
                previous = self._stats.get(node_id)
                if previous is not None and stats["uptime_s"] > previous["uptime_s"]:
                    self._busy[node_id] = min(1.0, (stats["busy_s"] - previous["busy_s"]) /
                                              (stats["uptime_s"] - previous["uptime_s"]))
                self._stats[node_id] = stats
                await self._recycle_idle(agent)

    async def _recycle_idle(self, agent: AgentHandle) -> None:
        now = asyncio.get_running_loop().time()
        waiting = {w.instance.instance_id for w in self._queues.get(agent.node_id, ())}
        for inst in list(self.instances.values()):
            if (inst.node_id == agent.node_id and inst.state == "ready" and inst.active == 0 and inst.pinned == 0
                    and inst.instance_id not in waiting and now - inst.idle_since > self.settings.keep_alive_s):
                log.info("recycling idle instance %s (%s/%s)", inst.instance_id, inst.model.tenant, inst.model.name)
                await self._unload(agent, inst)

    async def forget_model(self, model_uid: str) -> None:
        for inst in [i for i in self.instances.values() if i.model.uid == model_uid]:
            agent = self.agents.get(inst.node_id)
            if inst.state == "ready" and inst.active == 0 and inst.pinned == 0 and agent is not None and agent.up:
                await self._unload(agent, inst)
            else:  # loading or busy: forget it; it is recycled when idle
                self._forget_instance(inst)
        if self.weights is not None:
            await self.weights.forget(model_uid)

    def model_registered(self, model: ModelRecord) -> None:
        if self.weights is None or not self.weights.carries(model):
            return
        task = asyncio.get_running_loop().create_task(self._first_copy(model), name=f"first copy {model.uid}")
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _first_copy(self, model: ModelRecord) -> None:
        try:
            await self.weights.register(model)
        except WeightsError as exc:  # the first request tries again
            log.warning("placing the first host copy of %s/%s failed: %s", model.tenant, model.name, exc)

    async def preload(self, model: ModelRecord) -> None:
        """Start an instance of `model` now (a warm start for the first request)."""
        try:
            await self._ensure_instance(self._choose_agent(model), model)
        except ApiError as exc:
            log.warning("preloading %s/%s failed: %s", model.tenant, model.name, exc.message)

    async def scale_out(self, model: ModelRecord, nodes: list[str]) -> dict[str, Any]:
        """Start `model` on each of `nodes` at once (their weights go in one multicast)."""
        unknown = [n for n in nodes if n not in self.agents]
        if unknown:
            raise bad_request(f"unknown nodes {unknown}; this server's nodes: {sorted(self.agents)}", "nodes")
        kind = model.node_kind
        wrong = [n for n in nodes if self.agents[n].spec.kind != kind]
        if wrong:
            raise bad_request(f"nodes {wrong} are not {kind.upper()} nodes, which this model needs", "nodes")

        async def one(node: str) -> dict[str, Any]:
            agent = self.agents[node]
            if not agent.up:
                return {"node": node, "ok": False, "error": f"node agent {node} is {agent.state}"}
            try:
                inst = await self._ensure_instance(agent, model)
            except ApiError as exc:
                return {"node": node, "ok": False, "error": exc.message}
            return {"node": node, "ok": True, "instance_id": inst.instance_id, "weights": inst.weights}

        return {"results": await asyncio.gather(*(one(n) for n in nodes))}

    # ---- views ------------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        nodes = []
        for node_id, agent in self.agents.items():
            stats = self._stats.get(node_id, {})
            by_id = {i["instance_id"]: i for i in stats.get("instances", [])}
            instances = []
            for inst in self.instances.values():
                if inst.node_id != node_id:
                    continue
                s = by_id.get(inst.instance_id, {})
                instances.append({
                    "instance_id": inst.instance_id, "tenant": inst.model.tenant, "model": inst.model.name,
                    "state": inst.state, "active": inst.active, "batch_size": s.get("batch_size", 0),
                    "pending": s.get("pending", 0), "kv_bytes_budget": s.get("kv_bytes_budget", 0),
                    "kv_bytes_in_use": s.get("kv_bytes_in_use", 0),
                    "kv_bytes_allocated": s.get("kv_bytes_allocated", 0), "weight_bytes": s.get("weight_bytes", 0),
                    "context_window": inst.model.context_length, "time_factors": s.get("time_factors"),
                    "weights": inst.weights,
                })
            queued = len(self._queues[node_id])
            nodes.append({
                "node_id": node_id, "kind": agent.spec.kind, "state": agent.state, "pid": agent.pid,
                "location": agent.location,
                "restarts": agent.restarts, "last_error": agent.last_error,
                "memory": stats.get("memory", {"capacity_bytes": agent.spec.memory_bytes}),
                "busy_fraction": self._busy.get(node_id, 0.0),
                "queue_length": queued + int(stats.get("queue_length", 0)),
                "admission_queue": queued, "running": stats.get("running", 0),
                "kv_bytes_in_use": stats.get("kv_bytes_in_use", 0),
                "iterations": stats.get("iterations", 0), "deadlines": stats.get("deadlines"),
                "instances": instances,
            })
        return {"nodes": nodes, "weights": self.weights.view() if self.weights is not None else None}
