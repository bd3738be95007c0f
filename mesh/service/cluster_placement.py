"""Placement: where a request runs. The control service's one interface to the cluster.

`ClusterPlacement` hands every request to the cluster dispatcher (mesh.control.dispatcher)
under one of the replay's policies (mesh.control.schedulers, `mesh serve --policy`), over
one `AgentNode` per node agent (mesh.service.agent_node). The dispatcher and the policy
that `mesh replay` evaluates in virtual time are the ones that decide here; this module
decides nothing about where a request goes. It

1. describes each model once, on a node agent that can run it (its shape, KV bytes per
   token and tokenizer, without loading it), and adds it to the cluster with its
   calibration profile (`--profile-dir`, <dir>/<model uid>.json) or the prior profile;
2. tokenizes the prompt on that agent, so the prompt length is known before placement:
   over the context window is a 400;
3. submits the request to the dispatcher: placed on an instance whose shadow validation
   passes (a new instance's cold start counted in its TTFT, LLM-Mesh 4, 5.3), with
   preemption and bin-packing under Mesh (7.1, 7.2), or waiting in the bounded queue with
   the replay's expiry rules and its per-tenant fair share (mesh.policy.queueing);
4. streams its tokens back (`RequestStream`). A request turned away before its first token
   raises a 429 with the reason and a Retry-After (the time left of a cold start under way
   for its model, else 1 s); one that fails after it started ends its stream with an error
   event. A request moved to another node (preemption, eviction, 6.4) keeps its stream:
   it resumes where it stopped.

A model registered once runs on every kind of node it has a format for (mesh.service.preparation:
the registered one, and one the service prepared for the other kind, such as a GGUF
converted to a Hugging Face folder for vLLM). It is described on an agent of each such kind
whose nodes are up, so the dispatcher gets a profile per kind and chooses the kind (CPU
first under `mesh`, GPU only under `sllm`); each instance loads its node kind's format.

Instances start with their weights from the node's own copy, which the weights plane
multicasts there first if needed (mesh.control.weights_plane). Nodes come and go while
serving (`add_node`, `remove_node`: the Ray cluster's membership, mesh.ray.membership):
a removed node's streams end with an error event and its copies leave the parameter pool.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Protocol

from mesh.engines.engine_api import EngineRequest
from mesh.control.agent_client import AgentCallError, AgentDown
from mesh.node.emulation import PROFILE_PREFIX, emulated_cold_start
from mesh.wire.agent_protocol import Code, InstanceSpec, slo_to_dict
from mesh.control.supervisor import AgentHandle, AgentSettings, LocalAgent
from mesh.perf.times import prior_profile
from mesh.policy.placement import ADMIT_REJECT, CPU, GPU, ColdStart, kind_rank
from mesh.policy.queueing import DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_TIMEOUT_S
from mesh.control.cluster_view import LIVE_USAGE_ENTRIES, ClusterView, ClusterConfig, ModelSpec
from mesh.control.dispatcher import Dispatcher
from mesh.node.runtime import InstancePlan, NodeSpec
from mesh.node.request import Outcome, ServedRequest
from mesh.tasks import cancel_all
from mesh.service.agent_node import AgentNode
from mesh.service.errors import (ApiError, bad_request, context_too_long, max_tokens_too_large, model_preparing,
                                 node_unavailable, overloaded)
from mesh.modelfiles.formats import EMULATED, ENGINE_OF_KIND, FORMAT_NAMES, engine_for
from mesh.service.preparation import FormatPreparer, formats_view
from mesh.service.registry import ModelRecord
from mesh.service.streams import Finished, Job, RequestStream, Tokens
from mesh.control.weights_plane import ModelFormat, WeightsError, WeightsPlane

log = logging.getLogger("mesh.service.cluster_placement")

CALL_TIMEOUT_S = 30.0
MEAN_OUTPUT_PRIOR = 128.0  # O_avg's starting value for a new model (6.1), tokens
# The demo model (SmolLM2-135M) starts in 7.0-7.9 s on a 2-core node (docs/evaluation.md): the
# engine's start-up, not its weights, dominates a small model's cold start.
DEFAULT_COLD_START_S = 7.5
# The weights transfer to a node without a copy, until one is measured: the demo model (98 MB)
# was multicast cpu-0 -> cpu-1 in 1.7 s on this project's 2-core machines (README, `mesh bench
# serve --cpu-nodes 2`), about 58 MB/s with the set-up; a conservative 50 MB/s.
DEFAULT_TRANSFER_BYTES_PER_S = 50e6


class Placement(Protocol):
    """What the control service needs from whatever places requests on nodes."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def submit(self, job: Job) -> RequestStream:
        """Place a request; raises ApiError (400 prompt too long, 429 not placeable in time,
        503 no node) or returns its stream of tokens."""

    def abort(self, request_id: str) -> None: ...

    async def forget_model(self, model_uid: str, then: Callable[[], None] | None = None) -> None:
        """The model was deleted: unload its idle instances now, its busy ones once idle; every
        trace of it goes then, and `then()` is called."""

    def model_registered(self, model: ModelRecord) -> None:
        """A model was registered: place its first host copy and prepare its format for the
        other kind of node (in the background)."""

    def model_formats(self, model: ModelRecord) -> dict[str, dict[str, Any]]:
        """Each kind of node's format of the model and its state (for the model views)."""

    async def scale_out(self, model: ModelRecord, nodes: list[str]) -> dict[str, Any]:
        """Start instances of `model` on `nodes` now; per node its instance or the error."""

    def view(self) -> dict[str, Any]:
        """Nodes, instances, memory budget and use, the dispatcher (for /admin/cluster, /metrics)."""

    def healthy(self) -> bool: ...

    def set_tenant_admission(self, tenant: str, admission: str | None) -> None:
        """`tenant`'s default admission choice for its models without their own (None: the service's)."""


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    policy: str = "mesh"  # mesh.control.schedulers.POLICIES
    keep_alive_s: float = 60.0
    start_timeout_s: float = 60.0
    max_batch: int = 64  # requests an instance runs at most: its plans, its validation and its engine's max_num_seqs
    profile_dir: str | None = None  # calibration profiles: <dir>/<model uid>[.<kind>].json (issue 4)
    cold_start_s: float = DEFAULT_COLD_START_S  # an instance's start-up besides its weights (ColdStart.fixed_s)
    queue_capacity: int = DEFAULT_QUEUE_CAPACITY
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    admission: str = ADMIT_REJECT  # the default admission choice (mesh.policy.placement.ADMISSIONS)
    exact_moves: bool = False  # InstanceSpec.exact_moves for every instance (mesh serve --exact-moves)
    agent: AgentSettings = field(default_factory=AgentSettings)


@dataclass
class _Model:
    """A registered model as the cluster knows it."""

    record: ModelRecord
    front: str  # the node whose agent tokenizes its prompts
    path: str  # its weights as that node sees them
    kinds: tuple[str, ...] = ()  # the kinds of node it was described on (its ModelSpec's profiles)
    vocab_size: int | None = None  # the smallest vocabulary its described formats report (None: unknown)


class ClusterPlacement:
    def __init__(self, nodes: list[NodeSpec], settings: PlacementSettings | None = None,
                 agent_factory: Callable[..., AgentHandle] = LocalAgent,
                 weights: Callable[[dict[str, AgentHandle]], WeightsPlane] | None = None,
                 formats: FormatPreparer | None = None) -> None:
        """`agent_factory(spec, on_up, on_down, on_event, settings)` makes each node's agent
        handle (tests pass one that runs the agent in-process); `weights(agents)` makes the
        weights plane (None: nodes load models from the registry's path); `formats`
        prepares each model's format for the other kind of node (None: a model runs on its
        registered format's kind only)."""
        self.settings = settings or PlacementSettings()
        self._agent_factory = agent_factory
        s = self.settings
        config = ClusterConfig(
            cpu_nodes=sum(n.kind == CPU for n in nodes), gpu_nodes=sum(n.kind == GPU for n in nodes),
            cold_start=_cold_start(s), keep_alive_s=s.keep_alive_s, deadlines=s.agent.deadlines,
            max_batch=s.max_batch, admission=s.admission)
        self.cluster = ClusterView(config, usage_entries=LIVE_USAGE_ENTRIES)  # bounded: a months-long run
        self.cluster.holds_copy = self._holds_copy
        self.dispatcher = Dispatcher.for_policy(self.cluster, s.policy, queue_capacity=s.queue_capacity,
                                                queue_timeout_s=s.queue_timeout_s)
        self.agents: dict[str, AgentHandle] = {}  # node id -> its agent (the weights plane reads it)
        # The mixed rig (`mesh serve --cpu-nodes N --emulate DEVICE:M`): kinds of node whose nodes all
        # emulate, beside real ones; they run real models emulated from their shape (mesh.node.emulation)
        emulating = set(s.agent.emulate)
        real = {n.kind for n in nodes if n.node_id not in emulating}
        self.emulated_kinds = frozenset({n.kind for n in nodes if n.node_id in emulating} - real) if real else frozenset()
        self._shapes: dict[str, str] = {}  # model uid -> its emulated name on those kinds
        for spec in nodes:
            self._add(spec, agent_factory)
        self.weights = weights(self.agents) if weights is not None else None
        self.formats = formats
        if formats is not None:
            formats.kinds = lambda: {n.kind for n in self._nodes()} - self.emulated_kinds  # emulated: no format
            formats.on_ready = self._format_ready
        self._models: dict[str, _Model] = {}
        self._describing: dict[str, asyncio.Future] = {}
        self._registering: dict[str, asyncio.Task] = {}  # model -> its registration's copy and description
        self._requests: dict[str, ServedRequest] = {}
        self._begin: dict[str, Callable[[ServedRequest], None]] = {}  # request -> its stream's start, until admitted
        self._how: dict[str, str] = {}  # instance -> where its weights came from
        self._profile_kinds: dict[tuple[str, int], str | None] = {}  # (profile file, mtime) -> its device kind
        self.placed_by_kind: Counter[str] = Counter()  # requests by the kind of node that first admitted them
        self._started = False
        self._tasks: set[asyncio.Task] = set()

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.weights is not None:
            await self.weights.start()
        await self.cluster.start()
        self._started = True
        for node in self._nodes():
            if node.agent.remote:  # on another machine: served once reachable
                continue
            if not await node.agent.wait_up(self.settings.start_timeout_s):
                raise RuntimeError(f"node agent {node.node_id} did not start: {node.agent.last_error or 'timeout'}")
        if self.formats is not None:
            self.formats.ensure_all()  # models registered before this start that lack a format

    async def stop(self) -> None:
        if self.formats is not None:
            await self.formats.stop()
        await cancel_all(list(self._tasks))
        await self.cluster.stop()
        if self.weights is not None:
            await self.weights.stop()

    def set_tenant_admission(self, tenant: str, admission: str | None) -> None:
        self.cluster.set_tenant_admission(tenant, admission)

    def healthy(self) -> bool:
        return all(a.up for a in self.agents.values())

    def _nodes(self) -> list[AgentNode]:
        return list(self.cluster.nodes)  # type: ignore[arg-type] - the service's nodes are AgentNodes

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- membership: nodes that join or leave while serving ---------------------------------
    def _add(self, spec: NodeSpec, factory: Callable[..., AgentHandle]) -> AgentNode:
        node = AgentNode(spec, factory, self.settings.agent, self._load_spec, self._profile_for,
                         margin=self.cluster.config.margin)
        self.cluster.add_node(node)
        cluster_loaded = node.on_loaded
        node.on_loaded = lambda iid, n=node: (cluster_loaded(iid), self._instance_ready(n, iid))
        node.on_instance_stopped = self._instance_stopped
        node.on_down = self._node_down
        node.on_change = self.dispatcher.capacity_freed
        node.on_admitted = self._admitted
        # a start that must first move the weights there is staged: no decision waits for a transfer
        node.transfer_first = lambda plan, n: not self._holds_copy(plan.model, n)
        node.on_transfer = self.cluster.cold_starts.record_transfer
        self.agents[spec.node_id] = node.agent
        return node

    async def add_node(self, spec: NodeSpec, agent_factory: Callable[..., AgentHandle] | None = None) -> AgentHandle:
        """A node joined: start its agent handle (made by `agent_factory`, default the
        placement's). It gets models by multicast on first use."""
        if spec.node_id in self.agents:
            raise ValueError(f"node {spec.node_id} is already placed on")
        new_kind = spec.kind not in {n.kind for n in self._nodes()}
        node = self._add(spec, agent_factory or self._agent_factory)
        if self._started:
            await node.start()
        log.warning("node %s joined (%s)", spec.node_id, spec.kind)
        if new_kind and self.formats is not None:
            self.formats.ensure_all()  # formats for this kind can be prepared now
        self.dispatcher.capacity_freed()
        return node.agent

    async def remove_node(self, node_id: str, reason: str) -> None:
        """A node left (its machine died or was removed): its streams end with an error event,
        its instances are gone and its copies leave the parameter pool; /admin/cluster no
        longer lists it."""
        if node_id not in self.cluster.node_seq:
            return
        self.cluster.node(node_id).fail_all(f"node {node_id} left the cluster ({reason})")
        node: AgentNode = self.cluster.remove_node(node_id)  # type: ignore[assignment]
        del self.agents[node_id]
        for model in [m for m in self._models.values() if m.front == node_id]:
            self._models.pop(model.record.uid, None)  # described again on another node
        if self.weights is not None:
            self.weights.node_removed(node_id)
        await node.stop()
        log.warning("node %s left: %s", node_id, reason)

    def _node_down(self, node: AgentNode) -> None:
        if self.weights is not None and self.agents.get(node.node_id) is node.agent:
            self.weights.node_down(node.node_id)

    # ---- models --------------------------------------------------------------------------------
    async def _model(self, record: ModelRecord) -> _Model:
        """The model in the cluster, described on first use (once, however many ask), and
        again when it changed (a format became ready) or a kind of node it can run on came up."""
        known = self._models.get(record.uid)
        if known is not None and known.record == record and set(self._kinds_up(record)) <= set(known.kinds):
            return known
        pending = self._describing.get(record.uid)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._describing[record.uid] = pending
            try:
                pending.set_result(await self._describe(record))
            except BaseException as exc:
                pending.set_exception(exc)
                pending.exception()  # retrieved: a caller gets it below
            finally:
                self._describing.pop(record.uid, None)
        return await asyncio.shield(pending)

    def _kinds_up(self, record: ModelRecord) -> list[str]:
        """The kinds of node that can run the model now: it has a format ready for them and
        one of their agents is up; CPU first."""
        up = {n.kind for n in self._nodes() if n.up}
        return [k for k in self._runnable_kinds(record) if k in up]

    def _runnable_kinds(self, record: ModelRecord) -> tuple[str, ...]:
        """The kinds of node that can run the model once up: its formats' (ModelRecord.node_kinds)
        and, in the mixed rig, the emulated kinds, which emulate a real model from its shape."""
        if not self.emulated_kinds:
            return record.node_kinds
        if record.kind == EMULATED:  # a catalog model runs on the emulated nodes only
            return tuple(k for k in record.node_kinds if k in self.emulated_kinds)
        return tuple(sorted({*record.node_kinds, *self.emulated_kinds}, key=kind_rank))

    def _emulates(self, record: ModelRecord, kind: str) -> bool:
        """Do nodes of `kind` run this real model emulated (the mixed rig)?"""
        return record.kind != EMULATED and kind in self.emulated_kinds

    def _engine(self, record: ModelRecord, kind: str) -> str:
        return EMULATED if self._emulates(record, kind) else engine_for(record.kind, kind)

    def _shape(self, record: ModelRecord) -> str:
        """A real model's emulated name: its architecture, read once from its registered file."""
        if record.uid not in self._shapes:
            from mesh.node.emulation import shape_name
            from mesh.modelfiles.shape import architecture_of

            try:
                self._shapes[record.uid] = shape_name(architecture_of(record.path, record.uid))
            except (OSError, ValueError) as exc:
                raise ApiError(503, f"The model's shape cannot be read for its emulated nodes: {exc}", "server_error",
                               "model", "model_load_failed") from exc
        return self._shapes[record.uid]

    def _check_servable(self, record: ModelRecord) -> None:
        """Raise unless a kind of node the policy uses can run the model now: a 503 while
        its nodes are down or its format for them is being prepared, a 400 if it can never
        run here (what it would need is said)."""
        usable = self.dispatcher.policy.kinds
        if any(k in usable for k in self._kinds_up(record)):
            return
        here = {n.kind for n in self._nodes()}
        ready = [k for k in self._runnable_kinds(record) if k in usable and k in here]
        if ready:
            states = ", ".join(f"{n.node_id} {n.agent.state}" for n in self._nodes() if n.kind in ready)
            raise node_unavailable(f"no {'/'.join(k.upper() for k in ready)} node agent is up ({states})")
        formats = self.model_formats(record)
        for kind in usable:
            if kind in here and formats.get(kind, {}).get("state") == "preparing":
                raise model_preparing(f"its {FORMAT_NAMES[formats[kind]['format']]} for {kind.upper()} nodes is being "
                                      f"prepared from the registered {FORMAT_NAMES[record.kind]}")
        native = record.native_kind
        if native in usable and native not in here and native == CPU:  # CPU nodes come and go (Ray membership)
            raise node_unavailable("no CPU node agent is up (none configured)")
        if native not in here:  # a server without GPUs does not gain one
            why = f"and this server has no {native.upper()} node"
        else:
            why = (f"which the placement policy {self.dispatcher.policy.name} does not use (it uses "
                   f"{'/'.join(k.upper() for k in usable)} nodes)")
        other = [f"its {k.upper()} format: {f['state']}" + (f" ({f['reason']})" if f.get("reason") else "")
                 for k, f in formats.items() if k != native]
        raise bad_request(f"{FORMAT_NAMES[record.kind]}s run on {native.upper()} nodes ({ENGINE_OF_KIND[native]}), "
                          f"{why}; " + "; ".join(other) + ".", "model")

    def _describer(self, record: ModelRecord, kind: str) -> AgentNode:
        """The node of `kind` that describes the model (and so builds it ahead, on a CPU node):
        one that holds its weights there (the first host copy, BlitzScale 5.3: where the
        dispatcher's locality puts its first instance, and no copy to make), else a local
        agent (it reads the registry's path), else any that is up."""
        up = sorted((n for n in self._nodes() if n.kind == kind and n.up), key=lambda n: n.agent.remote)
        if self.weights is not None and record.kind != EMULATED and not self._emulates(record, kind):
            try:
                held = set(self.weights.holders(ModelFormat.of(record, kind).key))
            except KeyError:  # no format for that kind (yet)
                return up[0]
            return next((n for n in up if n.node_id in held), up[0])
        return up[0]

    def model_formats(self, model: ModelRecord) -> dict[str, dict[str, Any]]:
        if self.formats is not None:
            return self.formats.view(model)
        return formats_view(model, "this server prepares no formats", False)

    async def _describe(self, record: ModelRecord) -> _Model:
        """Describe the model on an agent of each kind of node that can run it now (its
        shape in that kind's format), and give the cluster a profile per kind: the
        dispatcher chooses among them. The first kind's agent (CPU first) tokenizes."""
        kinds = self._kinds_up(record)
        if not kinds:
            self._check_servable(record)  # raises the clear 400/503
            raise node_unavailable(f"no node agent that can run {record.name} is up")
        profiles: dict[str, Any] = {}
        vocabs: list[Any] = []
        front: tuple[AgentNode, str] | None = None
        for kind in kinds:
            node = self._describer(record, kind)
            try:
                path, _ = await self._copy_on(record, node)
                shape = await node.agent.client.call(
                    {"t": "describe", "model": record.uid, "path": path, "engine": self._engine(record, kind),
                     "context_window": record.context_length,
                     # what a load would ask for: the agent builds that instance ahead and parks it
                     "max_num_seqs": self.cluster.config.max_batch, "exact_moves": self.settings.exact_moves},
                    CALL_TIMEOUT_S)
            except (ApiError, AgentCallError, AgentDown) as exc:
                if front is not None:  # the kinds described so far serve; this one is left out
                    log.warning("model %s/%s is not run on %s nodes: describing it on %s failed: %s", record.tenant,
                                record.name, kind.upper(), node.node_id, exc)
                    continue
                if isinstance(exc, ApiError):
                    raise
                if isinstance(exc, AgentCallError):  # its text names server paths: logged, not told (issue 32)
                    log.error("model %s/%s: describing it on %s failed: %s", record.tenant, record.name,
                              node.node_id, exc)
                    raise ApiError(503, f"Model {record.name} cannot be read on node {node.node_id}; the operator's "
                                   "log has the detail.", "server_error", "model", "model_load_failed") from exc
                raise node_unavailable(str(exc)) from exc
            profiles[kind] = self._profile(record, kind, shape)
            vocabs.append(shape.get("vocab_size"))
            front = front or (node, path)
        # An emulated model's base is its catalog model ("llama-2-7b"), as a replay's replicas'
        # are: what the policies look up by base (ServerlessLLM's concurrency targets, 8.1)
        # is then the replay's, not a target tailored to an unknown model.
        base = record.path if record.kind == EMULATED else record.uid
        self.cluster.add_model(record.uid, ModelSpec(base, profiles), MEAN_OUTPUT_PRIOR, record.slo)
        self.cluster.set_cold_start_choice(record.uid, record.cold_start)
        self.cluster.set_admission(record.uid, record.admission)
        known = [int(v) for v in vocabs if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        model = _Model(record, front[0].node_id, front[1], tuple(profiles), min(known) if known else None)
        self._models[record.uid] = model
        return model

    def _profile(self, record: ModelRecord, kind: str, shape: dict[str, Any]) -> Any:
        """What the dispatcher plans the model's instances with: its calibration profile
        if there is one for this kind of node, else the prior the agents validate with."""
        if "profile" in shape:  # an emulated model: its catalog profile on the node's device (mesh.node.emulation)
            from mesh.perf.profile import profile_from_dict

            return profile_from_dict(shape["profile"], f"{record.name} on {kind} nodes")
        path = self._profile_for(record.uid, kind)
        if path is not None:
            from mesh.perf.profile import load_profile

            return load_profile(path)
        return prior_profile(record.uid, kind, int(shape["weight_bytes"]), int(shape["kv_bytes_per_token"]),
                             int(shape["context_window"]))

    def _profile_for(self, model_uid: str, kind: str) -> str | None:
        """The model's calibration profile for `kind` nodes (issue 4): `<dir>/<uid>.<kind>.json`,
        else `<dir>/<uid>.json`, whichever is a profile of that kind (a model that runs on
        both kinds has one per kind); None if neither is. An emulated model's is its catalog
        name, which each agent resolves on the device it emulates (mesh.node.emulation)."""
        model = self._models.get(model_uid)
        if model is not None and model.record.kind == EMULATED:
            return PROFILE_PREFIX + model.record.path
        if model is not None and self._emulates(model.record, kind):
            return PROFILE_PREFIX + self._shape(model.record)
        if not self.settings.profile_dir:
            return None
        for name in (f"{model_uid}.{kind}.json", f"{model_uid}.json"):
            candidate = Path(self.settings.profile_dir) / name
            if candidate.is_file() and self._profile_kind(candidate) == kind:
                return str(candidate)
        return None

    def _profile_kind(self, path: Path) -> str | None:
        """The device kind of a profile file (read once per version of the file)."""
        from mesh.perf.profile import ProfileError, load_profile

        key = (str(path), path.stat().st_mtime_ns)
        if key not in self._profile_kinds:
            try:
                self._profile_kinds[key] = load_profile(path).device_kind
            except ProfileError as exc:
                log.warning("cannot use profile %s: %s", path, exc)
                self._profile_kinds[key] = None
        return self._profile_kinds[key]

    async def _copy_on(self, record: ModelRecord, node: AgentNode) -> tuple[str, str]:
        """The weights of the model's format for `node`'s kind as `node` sees them and how
        they got there: its own copy (multicast there first if needed) or, without a weights
        plane, the registry's (or the prepared) path."""
        if record.kind == EMULATED:  # a catalog name: nothing to carry, the node emulates it
            return record.path, EMULATED
        if self._emulates(record, node.kind):  # its shape: nothing to carry either
            return self._shape(record), EMULATED
        fmt = ModelFormat.of(record, node.kind)
        if self.weights is None or not self.weights.carries(fmt):
            return fmt.path, "registry path" if fmt.native else "prepared path"
        try:
            copy = await self.weights.copy_on(fmt, node.node_id)
        except WeightsError as exc:  # its text names paths and file facts: logged, not told (issue 32)
            log.error("model %s/%s: its weights could not reach node %s: %s", record.tenant, record.name,
                      node.node_id, exc)
            raise ApiError(503, f"The model's weights could not reach node {node.node_id}; the operator's log has "
                           "the detail. Retry shortly.", "server_error", "model", "weights_unavailable") from exc
        return copy.path, copy.how

    async def _load_spec(self, plan: InstancePlan, node: AgentNode) -> InstanceSpec:
        """How `node`'s agent loads the planned instance (the dispatcher chose the node)."""
        record = self._models[plan.model].record
        path, self._how[plan.instance_id] = await self._copy_on(record, node)
        emulates = record.kind == EMULATED or self._emulates(record, node.kind)
        emulated = self.cluster.simulated_load_s(plan, node.kind) if emulates else None
        return InstanceSpec(plan.instance_id, record.uid, path, record.context_length, slo_to_dict(record.slo),
                            plan.max_batch, self._profile_for(record.uid, node.kind),
                            self._engine(record, node.kind), exact_moves=self.settings.exact_moves,
                            emulated_load_s=emulated)  # an emulated load takes the replay's engine's

    def _holds_copy(self, model_uid: str, node: Any) -> bool:
        """Does `node` hold the model's weights for its kind (no transfer before a load)? Yes
        without a weights plane (nodes read the registry's path)."""
        model = self._models.get(model_uid)
        if self.weights is None or model is None or model.record.kind == EMULATED or node.kind in self.emulated_kinds:
            return True
        try:
            fmt = ModelFormat.of(model.record, node.kind)
        except KeyError:
            return True
        return not self.weights.carries(fmt) or node.node_id in self.weights.holders(fmt.key)

    def _instance_ready(self, node: AgentNode, instance_id: str) -> None:
        inst = node.instances.get(instance_id)
        if self.weights is not None and inst is not None:
            self.weights.instance_started(inst.model, node.node_id, instance_id)
        self.dispatcher.capacity_freed()

    def _instance_stopped(self, model_uid: str, instance_id: str) -> None:
        self._how.pop(instance_id, None)
        if self.weights is not None:
            self.weights.instance_stopped(model_uid, instance_id)

    def model_registered(self, model: ModelRecord) -> None:
        if model.kind == EMULATED:  # no file: nothing to prepare or to place
            return
        if self.formats is not None:
            self.formats.ensure(model)
        task = asyncio.get_running_loop().create_task(self._first_copy_then_describe(model),
                                                      name=f"first copy {ModelFormat.of(model).key}")
        self._registering[model.uid] = task  # a deletion meanwhile cancels it
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t, uid=model.uid: self._registering.pop(uid, None)
                               if self._registering.get(uid) is t else None)

    def _format_ready(self, model: ModelRecord, kind: str) -> None:
        """A format prepared for `kind` is ready: it joins the parameter pool (its first host
        copy on a node of that kind); the model's next request describes it there too."""
        fmt = ModelFormat.of(model, kind)
        self._spawn(self._first_copy(fmt), f"first copy {fmt.key}")

    async def _first_copy(self, fmt: ModelFormat) -> None:
        """Place the first host copy of a model's format (none without a weights plane)."""
        if self.weights is None or not self.weights.carries(fmt):
            return
        try:
            await self.weights.register(fmt)
        except WeightsError as exc:  # the first request tries again
            log.warning("placing the first host copy of %s (%s nodes) failed: %s", fmt.label, fmt.node_kind, exc)

    async def _first_copy_then_describe(self, model: ModelRecord) -> None:
        """A model just registered: its first host copy, then its description on its nodes
        (its shape, its tokenizer and, on CPU nodes, its first instance built and parked:
        mesh.node.park_ahead), all before its first request, which would otherwise wait for them."""
        await self._first_copy(ModelFormat.of(model))
        try:
            await self._model(model)
        except ApiError as exc:  # its first request describes it again, and says why it cannot
            log.warning("describing %s/%s at its registration failed: %s", model.tenant, model.name, exc.message)

    async def forget_model(self, model_uid: str, then: Callable[[], None] | None = None) -> None:
        """Every trace of a deleted model goes: its registration's work under way, its idle
        instances now and its busy ones once their requests end, its node copies when no
        instance reads them (now, or once a busy one or a load being issued has ended: a copy
        removed under a load failed it); then, with none left, its
        spec and books in the cluster, its decision lock, and its state on every agent
        (`_forget_when_idle`), and `then()` is called (the service's metric series go). The
        cluster keeps its spec until then: requests for it still in flight are planned with it."""
        registering = self._registering.pop(model_uid, None)
        if registering is not None:
            registering.cancel()
        self._models.pop(model_uid, None)
        self._shapes.pop(model_uid, None)
        for ref in list(self.cluster.instances_of(model_uid)):
            if not ref.requests:
                await self.cluster.stop_instance(ref)
        if self.weights is not None and not self.cluster.instances_of(model_uid) \
                and not self.cluster.issuing(model_uid):  # else once no instance reads them (_forget_when_idle)
            await self.weights.forget(model_uid)
        if self.formats is not None:
            await self.formats.forget(model_uid)
        self._spawn(self._forget_when_idle(model_uid, then), f"forget {model_uid}")

    async def _forget_when_idle(self, model_uid: str, then: Callable[[], None] | None, every_s: float = 0.5) -> None:
        """Once the deleted model's requests have ended (its busy instances are stopped as they
        go idle, not kept alive), it leaves the cluster, the dispatcher and the agents."""
        while True:
            pending = self._describing.get(model_uid)
            if pending is not None:
                await asyncio.wait([pending])
            self._models.pop(model_uid, None)  # a description that ended meanwhile
            for ref in list(self.cluster.instances_of(model_uid)):
                if not ref.requests:
                    await self.cluster.stop_instance(ref)
            # requests in flight first (they are planned with its spec), then its instances
            if model_uid not in self._describing and self.dispatcher.forget_model(model_uid) \
                    and self.cluster.forget_model(model_uid):
                break
            await asyncio.sleep(every_s)
        if self.weights is not None:  # its node copies, if a busy instance or a load being issued kept them
            await self.weights.forget(model_uid)
        await asyncio.gather(*(node.forget_model(model_uid) for node in self._nodes()))
        if then is not None:
            then()

    async def preload(self, record: ModelRecord, wait: bool = False) -> None:
        """Start an instance of `record` now where the policy would start a new one
        (`Scheduler.prestart`): a warm start for the first request. `wait`: until it is loaded
        (or failed)."""
        try:
            await self._model(record)
        except ApiError as exc:
            log.warning("preloading %s/%s failed: %s", record.tenant, record.name, exc.message)
            return
        ref = await self.dispatcher.policy.prestart(record.uid)
        if ref is None:
            log.warning("preloading %s/%s: no node can host it now", record.tenant, record.name)
        elif wait and not await ref.node.wait_loaded(ref.instance_id, self.settings.start_timeout_s):
            log.warning("preloading %s/%s: its instance did not load", record.tenant, record.name)

    async def scale_out(self, record: ModelRecord, nodes: list[str]) -> dict[str, Any]:
        """Start `record` on each of `nodes` at once (their weights go in one multicast);
        an operator's order, not a policy decision."""
        unknown = [n for n in nodes if n not in self.agents]
        if unknown:
            raise bad_request(f"unknown nodes {unknown}; this server's nodes: {sorted(self.agents)}", "nodes")
        kinds = self._runnable_kinds(record)
        wrong = [n for n in nodes if self.cluster.node(n).kind not in kinds]
        if wrong:
            formats = self.model_formats(record)
            missing = sorted({self.cluster.node(n).kind for n in wrong})
            why = "; ".join(f"its {k.upper()} format is {formats[k]['state']}"
                            + (f" ({formats[k]['reason']})" if formats[k].get("reason") else "")
                            for k in missing if k in formats)
            raise bad_request(f"nodes {wrong} are {'/'.join(k.upper() for k in missing)} nodes, and model "
                              f"{record.name} runs on {'/'.join(k.upper() for k in kinds)} nodes only now"
                              + (f": {why}" if why else ""), "nodes")
        described = await self._model(record)

        async def one(node_id: str) -> dict[str, Any]:
            node: AgentNode = self.cluster.node(node_id)  # type: ignore[assignment]
            if not node.up:
                return {"node": node_id, "ok": False, "error": f"node agent {node_id} is {node.agent.state}"}
            if node.kind not in described.kinds:  # its kind's agent could not read the model's format
                return {"node": node_id, "ok": False, "error": f"model {record.name} could not be described on "
                        f"{node.kind.upper()} nodes (see the service's log)"}
            running = [r for r in self.cluster.instances_of(record.uid) if r.node is node]
            node.last_start_error = ""
            ref = running[0] if running else await self.cluster.start_instance(self.cluster.plan(record.uid, node), node)
            if ref is None:
                why = node.last_start_error or "its memory budget is full"
                return {"node": node_id, "ok": False, "error": f"node {node_id} could not start it: {why}"}
            ready = await node.wait_loaded(ref.instance_id, self.settings.start_timeout_s)
            if not ready:  # (a staged start's transfer or load failed: the node says why)
                why = f": {node.last_start_error}" if node.last_start_error else ""
                return {"node": node_id, "ok": False, "error": f"instance {ref.instance_id} failed to load{why}"}
            return {"node": node_id, "ok": True, "instance_id": ref.instance_id,
                    "weights": self._how.get(ref.instance_id, "registry path")}

        return {"results": await asyncio.gather(*(one(n) for n in nodes))}

    # ---- requests ----------------------------------------------------------------------------
    async def submit(self, job: Job) -> RequestStream:
        if self.formats is not None:
            self.formats.ensure(job.model)  # a model that lacks a format gets it prepared on first use
        self._check_servable(job.model)  # none up: a 503 now rather than a wait
        model = await self._model(job.model)
        ids = job.prompt_token_ids
        if ids is None:
            ids = await self._tokenize(model, job)
        elif model.vocab_size is not None:  # checked here, before the ids go to a node (issue 32)
            bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
            if bad is not None:
                raise bad_request(f"Token id {bad} in 'prompt' is outside the vocabulary of {job.model.name} "
                                  f"(ids 0 to {model.vocab_size - 1}).", "prompt", "invalid_token_id")
        window = job.model.context_length
        if len(ids) + 1 > window:
            raise context_too_long(len(ids), window, "messages" if job.messages is not None else "prompt")
        sampling = job.sampling
        if sampling.max_tokens <= 0:  # not given: up to the context window
            sampling = replace(sampling, max_tokens=window - len(ids))
        elif sampling.max_tokens > window - len(ids):
            raise max_tokens_too_large(sampling.max_tokens, len(ids), window)
        loop = asyncio.get_running_loop()
        stream = RequestStream(job.request_id, len(ids), on_abort=self.abort)
        started: asyncio.Future = loop.create_future()  # admitted on a node, or ended before

        def begin(req: ServedRequest) -> None:
            """Admitted (or ended without a node): the HTTP response starts."""
            if not started.done():
                node = self.cluster.node(req.node_id) if req.node_id in self.cluster.node_seq else None
                self.placed_by_kind[node.kind if node is not None else "unknown"] += 1
                stream.node_id, stream.instance_id = req.node_id or "", req.instance_id or ""
                started.set_result(True)

        def output(req: ServedRequest, token_ids: Any, texts: Any) -> None:
            if req.outcome is not None:  # ended (aborted) while it was being placed: stop it there
                if req.node_id is not None:
                    self.cluster.node(req.node_id).abort(req.request_id, "the client went away")
                return
            stream.push(Tokens("".join(texts or ()), list(token_ids or ())))

        def done(req: ServedRequest) -> None:
            self._requests.pop(req.request_id, None)
            self._begin.pop(req.request_id, None)
            if req.outcome is Outcome.COMPLETED:
                begin(req)
                stream.push(Finished(req.finish_reason.value if req.finish_reason else "stop", req.tokens_out))
                return
            error = (overloaded(_reason(req.detail), self._retry_after_s(req.model), self.dispatcher.admission(req))
                     if req.outcome is Outcome.REJECTED else node_unavailable(_reason(req.detail)))
            if started.done():
                stream.push(error)
            else:
                started.set_exception(error)

        req = ServedRequest(EngineRequest(job.request_id, len(ids), sampling, list(ids)), job.model.uid,
                            job.arrival_s, job.model.slo, on_output=output, on_done=done, tenant=job.model.tenant)
        self._requests[job.request_id] = req
        self._begin[job.request_id] = begin
        self.dispatcher.submit(req)
        try:
            await asyncio.shield(started)
        except asyncio.CancelledError:
            self.abort(job.request_id)
            raise
        return stream

    async def _tokenize(self, model: _Model, job: Job) -> list[int]:
        """On an agent with a loaded instance of the model (its engine's tokenizer is built),
        else on the describing agent, which builds the tokenizer alone (once, seconds)."""
        text = {"messages": job.messages} if job.messages is not None else {"prompt": job.prompt}
        # an abort of the request cancels its tokenize (its client left); the tenant takes its turn there
        text = {**text, "request_id": job.request_id, "tenant": job.model.tenant}
        front = {"t": "tokenize", "model": model.record.uid, "path": model.path,
                 "engine": engine_for(model.record.kind, self.cluster.node(model.front).kind),
                 "context_window": model.record.context_length, **text}
        ready = [r for r in self.cluster.instances_of(model.record.uid) if r.node.up and r.inst.loaded]
        tries = [(r.node.node_id, {"t": "tokenize", "instance_id": r.instance_id, **text}) for r in ready[:1]]
        for node_id, message in [*tries, (model.front, front)]:
            agent = self.agents.get(node_id)
            try:
                if agent is None or agent.client is None:
                    raise AgentDown(f"node {node_id} is not connected")
                try:
                    reply = await agent.client.call(message, CALL_TIMEOUT_S)
                except (asyncio.CancelledError, AgentDown):  # the client left (or no answer in time):
                    agent.client.send({"t": "abort", "request_id": job.request_id})  # its job leaves the queue
                    raise
            except AgentCallError as exc:
                if exc.code in (Code.NO_INSTANCE.value, Code.NOT_READY.value):
                    continue  # the instance left meanwhile: the describing agent tokenizes
                # the agent's text may name server paths: logged, and the tenant told what to do (issue 32)
                log.warning("request %s: tokenizing for %s/%s on %s failed: %s", job.request_id, job.model.tenant,
                            job.model.name, node_id, exc)
                raise bad_request(f"Model {job.model.name} cannot tokenize this "
                                  f"{'conversation' if job.messages is not None else 'prompt'}: its tokenizer or chat "
                                  f"template refused it. Check the input; the operator's log has the detail under "
                                  f"request {job.request_id}.", "messages" if job.messages is not None else "prompt",
                                  "tokenization_failed") from exc
            except AgentDown as exc:
                if node_id != model.front:
                    continue
                self._models.pop(model.record.uid, None)  # described again on a node that is up
                raise node_unavailable(str(exc)) from exc
            return [int(t) for t in reply["ids"]]
        raise node_unavailable(f"node {model.front} cannot tokenize for {job.model.name}")

    def _admitted(self, req: ServedRequest) -> None:
        begin = self._begin.pop(req.request_id, None)
        if begin is not None:
            begin(req)

    def _retry_after_s(self, model_uid: str) -> float:
        """When a turned-away request of this model may do better: once the cold start of
        an instance of it under way ends (the time left of its predicted load), else in a
        second. The header rounds it up to whole seconds, at least 1."""
        left = self.cluster.cold_start_left_s(model_uid)
        return 1.0 if left is None else left

    def abort(self, request_id: str) -> None:
        """The client went away: stop the request wherever it is (waiting, or on a node)."""
        req = self._requests.get(request_id)
        if req is None or req.outcome is not None:
            return
        if req.node_id is not None and req.node_id in self.cluster.node_seq:
            self.cluster.node(req.node_id).abort(request_id, "the client went away")
        else:  # waiting in the dispatcher's queue (it leaves it) or being placed
            req.end(Outcome.FAILED, asyncio.get_running_loop().time(), "aborted: the client went away")

    def waiting(self) -> int:
        """Requests waiting in the dispatcher's queue."""
        return len(self.dispatcher.queue)

    # ---- views ------------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        nodes = []
        for node in self._nodes():
            stats = node.stats
            by_id = {i["instance_id"]: i for i in stats.get("instances", [])}
            instances = []
            for iid, inst in node.instances.items():
                model = self._models.get(inst.model)
                record = model.record if model is not None else None
                s = by_id.get(iid, {})
                instances.append({
                    "instance_id": iid, "tenant": record.tenant if record else None,
                    "model": record.name if record else inst.model,
                    "state": "ready" if inst.loaded else "loading", "active": len(inst.requests),
                    "batch_size": s.get("batch_size", 0), "pending": s.get("pending", 0),
                    "kv_bytes_budget": s.get("kv_bytes_budget", 0), "kv_bytes_in_use": s.get("kv_bytes_in_use", 0),
                    "kv_bytes_allocated": s.get("kv_bytes_allocated", 0), "weight_bytes": s.get("weight_bytes", 0),
                    "context_window": record.context_length if record else None,
                    "time_factors": s.get("time_factors"), "weights": self._how.get(iid, "registry path"),
                })
            agent = node.agent
            nodes.append({
                "node_id": node.node_id, "kind": node.kind, "state": agent.state, "pid": agent.pid,
                "location": agent.location, "restarts": agent.restarts, "last_error": agent.last_error,
                "memory": stats.get("memory", {"capacity_bytes": node.spec.memory_bytes}),
                "busy_fraction": node.busy_fraction, "queue_length": int(stats.get("queue_length", 0)),
                "running": stats.get("running", 0), "kv_bytes_in_use": stats.get("kv_bytes_in_use", 0),
                "iterations": stats.get("iterations", 0), "deadlines": stats.get("deadlines"),
                "emulate": stats.get("emulate"),  # the device an emulated node emulates (mesh serve --emulate)
                "models": stats.get("models", []),  # the models its agent holds state for (a deleted one: none)
                "calls": {t: c.view() for t, c in sorted(agent.client.call_times.items())} if agent.client else {},
                "frames_in": agent.client.frames_in if agent.client else 0,  # from the agent, this connection
                "instances": instances,
            })
        d = self.dispatcher
        tenants = Counter(r.tenant for r in d.waiting_requests())
        return {
            "nodes": nodes,
            # the models the cluster knows (a deleted one leaves once its requests have ended)
            "described": {uid: {"tenant": m.record.tenant, "name": m.record.name} for uid, m in self._models.items()},
            "cluster_models": sorted(self.cluster.models),
            "weights": self.weights.view() if self.weights is not None else None,
            "dispatcher": {
                "policy": d.policy.name, "waiting": len(d.queue), "in_flight": len(d.requests),
                "waiting_by_tenant": dict(tenants),
                "queue_capacity": d.queue.capacity, "queue_timeout_s": d.queue_timeout_s,
                "admission": self.cluster.config.admission, "placed_by_kind": dict(self.placed_by_kind),
                "placed_at_arrival": d.stats.placed_at_arrival, "placed_from_queue": d.stats.placed_from_queue,
                "preemptions": d.policy.stats.preemptions, "moved_requests": d.policy.stats.preempted_requests,
                "evictions_rescheduled": d.stats.rescheduled, "new_instances": d.policy.stats.new_instances,
                "warm_ups": d.policy.stats.warm_ups, "instances_recycled": self.cluster.instances_recycled,
                "rejected": dict(d.stats.rejected), "failed": dict(d.stats.failed),
                "decisions": d.stats.decisions, "decision_s_mean": d.stats.decision_s / max(1, d.stats.decisions),
                "decision_s_max": d.stats.decision_max_s,
                "decision_wait_s_mean": d.stats.decision_wait_s / max(1, d.stats.decisions),
                "decision_times": d.stats.decision_times.snapshot(),  # seconds, log buckets (mesh.control.latency)
            },
        }


def _cold_start(s: PlacementSettings) -> ColdStart:
    """The service's cold-start model: on emulated nodes the replay's, with the emulated
    GPU's host-to-GPU bandwidth (mesh.node.emulation.emulated_cold_start)."""
    kw: dict[str, Any] = {"fixed_s": s.cold_start_s, "net_bytes_per_s": DEFAULT_TRANSFER_BYTES_PER_S}
    if s.agent.emulate:
        return emulated_cold_start(set(s.agent.emulate.values()), s.agent.emulate_profiles, **kw)
    return ColdStart(**kw)


def _reason(detail: str) -> str:
    """A request's end detail without its outcome prefix ("rejected: queue full: ...")."""
    for prefix in ("rejected: ", "failed: "):
        if detail.startswith(prefix):
            return detail[len(prefix):]
    return detail or "no reason given"
