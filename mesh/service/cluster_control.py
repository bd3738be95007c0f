"""The cluster control: the control service's one interface to the cluster (its nodes, its models
and where its requests go).

`ClusterControl` hands every request to the cluster dispatcher (mesh.control.dispatcher)
under one of the replay's policies (mesh.control.schedulers, `mesh serve --policy`), over
one `AgentNode` per node agent (mesh.control.agent_node). The dispatcher and the policy
that `mesh replay` evaluates in virtual time are the ones that decide here; this module
decides nothing about where a request goes. It composes three parts along their seams:

- node membership (`NodePool`, mesh.control.node_pool): the node agents, up or down, and
  nodes that join or leave while serving (`add_node`, `remove_node`: the Ray cluster's
  membership, mesh.ray.membership); a removed node's streams end with an error event and
  its copies leave the parameter pool;
- the model catalogue (`ModelCatalogue`, mesh.service.model_catalogue): each registered
  model described on a node agent of each kind that can run it, its profiles, formats,
  first host copy and cold-start and admission choices, and its deletion;
- the request path (`RequestPath`, mesh.service.request_path): a request tokenized,
  submitted to the dispatcher, streamed back, or cancelled.

Instances start with their weights from the node's own copy, which the weights plane
multicasts there first if needed (mesh.control.weights_plane).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from mesh.control.agent_node import AgentNode
from mesh.control.dispatcher import Dispatcher
from mesh.control.fleet import LIVE_USAGE_ENTRIES, ClusterConfig, Fleet
from mesh.control.load_timing import WeightsConfig
from mesh.control.node_pool import NodePool
from mesh.control.supervisor import AgentHandle, AgentSettings, LocalAgent
from mesh.control.weights_plane import WeightsPlane
from mesh.engines.emulation import emulated_cold_start
from mesh.perf.load_times import ColdStart
from mesh.policy.dispatch_rules import ADMIT_REJECT, CPU, GPU
from mesh.policy.node_spec import NodeSpec
from mesh.policy.queueing import DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_TIMEOUT_S
from mesh.service.errors import ApiError, bad_request
from mesh.service.model_catalogue import ModelCatalogue
from mesh.service.preparation import FormatPreparer
from mesh.service.registry import ModelRecord
from mesh.service.request_path import RequestPath
from mesh.service.streams import Job, RequestStream

log = logging.getLogger(__name__)

# The demo model (SmolLM2-135M) starts in 7.0-7.9 s on a 2-core node (docs/evaluation.md): the
# engine's start-up, not its weights, dominates a small model's cold start.
DEFAULT_COLD_START_S = 7.5
# The weights transfer to a node without a copy, until one is measured: the demo model (98 MB)
# was multicast cpu-0 -> cpu-1 in 1.7 s on this project's 2-core machines (README, `mesh bench
# serve --cpu-nodes 2`), about 58 MB/s with the set-up; a conservative 50 MB/s.
DEFAULT_TRANSFER_BYTES_PER_S = 50e6


class ClusterInterface(Protocol):
    """What the control service needs from the cluster side (ClusterControl, or a test's double)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def kill_agents(self) -> None:
        """End the agent processes this service runs now (a stop that overran its time or
        was cut short by a signal)."""

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
class ClusterSettings:
    policy: str = "mesh"  # mesh.control.schedulers.POLICIES
    keep_alive_s: float = 60.0
    start_timeout_s: float = 60.0
    max_batch: int = 64  # requests an instance runs at most: its plans, its validation and its engine's max_num_seqs
    profile_dir: str | None = None  # calibration profiles: <dir>/<model uid>[.<kind>].json
    cold_start_s: float = DEFAULT_COLD_START_S  # an instance's start-up besides its weights (ColdStart.fixed_s)
    queue_capacity: int = DEFAULT_QUEUE_CAPACITY
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    admission: str = ADMIT_REJECT  # the default admission choice (mesh.policy.dispatch_rules.ADMISSIONS)
    exact_moves: bool = False  # InstanceSpec.exact_moves for every instance (mesh serve --exact-moves)
    agent: AgentSettings = field(default_factory=AgentSettings)
    # emulated nodes' loads by the replay's weights model (mesh.control.load_timing: multicast,
    # live scaling); None: from host memory (ColdStart)
    emulated_weights: WeightsConfig | None = None


class ClusterControl:
    def __init__(self, nodes: list[NodeSpec], settings: ClusterSettings | None = None,
                 agent_factory: Callable[..., AgentHandle] = LocalAgent,
                 weights: Callable[[dict[str, AgentHandle]], WeightsPlane] | None = None,
                 formats: FormatPreparer | None = None) -> None:
        """`agent_factory(spec, on_up, on_down, on_event, settings)` makes each node's agent
        handle (tests pass one that runs the agent in-process); `weights(agents)` makes the
        weights plane (None: nodes load models from the registry's path); `formats`
        prepares each model's format for the other kind of node (None: a model runs on its
        registered format's kind only)."""
        self.settings = settings or ClusterSettings()
        s = self.settings
        config = ClusterConfig(
            cpu_nodes=sum(n.kind == CPU for n in nodes), gpu_nodes=sum(n.kind == GPU for n in nodes),
            cold_start=_cold_start(s), keep_alive_s=s.keep_alive_s, deadlines=s.agent.deadlines,
            max_batch=s.max_batch, admission=s.admission)
        self.cluster = Fleet(config, usage_entries=LIVE_USAGE_ENTRIES)  # bounded: a months-long run
        self.dispatcher = Dispatcher.for_policy(self.cluster, s.policy, queue_capacity=s.queue_capacity,
                                                queue_timeout_s=s.queue_timeout_s)
        self.catalogue = ModelCatalogue(self.cluster, self.dispatcher, _emulated_kinds(nodes, s.agent.emulate),
                                        formats, profile_dir=s.profile_dir, exact_moves=s.exact_moves)
        self.catalogue.emulated_loads.weights = s.emulated_weights if s.agent.emulate else None
        self.cluster.holds_copy = self.catalogue.holds_copy
        self.pool = NodePool(self.cluster, self.dispatcher, s.agent, agent_factory, self.catalogue, s.start_timeout_s)
        self.requests = RequestPath(self.cluster, self.dispatcher, self.catalogue, self.pool.agents, formats)
        for spec in nodes:
            self.pool.add(spec)
        self.weights = weights(self.pool.agents) if weights is not None else None
        self.pool.weights = self.catalogue.weights = self.weights
        self.formats = formats
        if formats is not None:
            kinds = self.catalogue.emulated_kinds  # emulated: no format
            formats.kinds = lambda: {n.kind for n in self.pool.nodes()} - kinds
            formats.on_ready = self.catalogue.format_ready

    @property
    def agents(self) -> dict[str, AgentHandle]:
        """Node id -> its agent."""
        return self.pool.agents

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.weights is not None:
            await self.weights.start()
        await self.cluster.start()
        await self.pool.start()
        if self.formats is not None:
            self.formats.ensure_all()  # models registered before this start that lack a format

    async def stop(self) -> None:
        if self.formats is not None:
            await self.formats.stop()
        await self.catalogue.stop()
        await self.cluster.stop()
        if self.weights is not None:
            await self.weights.stop()

    def kill_agents(self) -> None:
        for agent in list(self.pool.agents.values()):  # (also from the stop's watchdog thread)
            agent.kill_process()

    def set_tenant_admission(self, tenant: str, admission: str | None) -> None:
        self.cluster.set_tenant_admission(tenant, admission)

    def healthy(self) -> bool:
        return self.pool.healthy()

    # ---- membership: nodes that join or leave while serving ---------------------------------
    async def add_node(self, spec: NodeSpec, agent_factory: Callable[..., AgentHandle] | None = None) -> AgentHandle:
        """A node joined: start its agent handle (made by `agent_factory`, default the
        cluster control's). It gets models by multicast on first use."""
        new_kind = spec.kind not in {n.kind for n in self.pool.nodes()}
        node = await self.pool.add_node(spec, agent_factory)
        if new_kind and self.formats is not None:
            self.formats.ensure_all()  # formats for this kind can be prepared now
        self.dispatcher.capacity_freed()
        return node.agent

    async def remove_node(self, node_id: str, reason: str) -> None:
        await self.pool.remove_node(node_id, reason)

    # ---- models --------------------------------------------------------------------------------
    def model_registered(self, model: ModelRecord) -> None:
        self.catalogue.model_registered(model)

    def model_formats(self, model: ModelRecord) -> dict[str, dict[str, Any]]:
        return self.catalogue.model_formats(model)

    async def forget_model(self, model_uid: str, then: Callable[[], None] | None = None) -> None:
        await self.catalogue.forget_model(model_uid, then)

    async def preload(self, record: ModelRecord, wait: bool = False) -> None:
        """Start an instance of `record` now where the policy would start a new one
        (`Scheduler.prestart`): a warm start for the first request. `wait`: until it is loaded
        (or failed)."""
        try:
            await self.catalogue.described(record)
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
        kinds = self.catalogue.runnable_kinds(record)
        wrong = [n for n in nodes if self.cluster.node(n).kind not in kinds]
        if wrong:
            formats = self.catalogue.model_formats(record)
            missing = sorted({self.cluster.node(n).kind for n in wrong})
            why = "; ".join(f"its {k.upper()} format is {formats[k]['state']}"
                            + (f" ({formats[k]['reason']})" if formats[k].get("reason") else "")
                            for k in missing if k in formats)
            raise bad_request(f"nodes {wrong} are {'/'.join(k.upper() for k in missing)} nodes, and model "
                              f"{record.name} runs on {'/'.join(k.upper() for k in kinds)} nodes only now"
                              + (f": {why}" if why else ""), "nodes")
        described = await self.catalogue.described(record)

        async def one(node_id: str) -> dict[str, Any]:
            node: AgentNode = self.cluster.node(node_id)  # type: ignore[assignment]
            if not node.up:
                return {"node": node_id, "ok": False, "error": f"node agent {node_id} is {node.agent.state}"}
            if node.kind not in described.kinds:  # its kind's agent could not read the model's format
                return {"node": node_id, "ok": False, "error": f"model {record.name} could not be described on "
                        f"{node.kind.upper()} nodes (see the service's log)"}
            running = [r for r in self.cluster.instances_of(record.uid) if r.node is node]
            node.last_start_error = ""
            ref = running[0] if running else await self.cluster.start_instance(self.cluster.plan(record.uid, node),
                                                                               node)
            if ref is None:
                why = node.last_start_error or "its memory budget is full"
                return {"node": node_id, "ok": False, "error": f"node {node_id} could not start it: {why}"}
            ready = await node.wait_loaded(ref.instance_id, self.settings.start_timeout_s)
            if not ready:  # (a staged start's transfer or load failed: the node says why)
                why = f": {node.last_start_error}" if node.last_start_error else ""
                return {"node": node_id, "ok": False, "error": f"instance {ref.instance_id} failed to load{why}"}
            return {"node": node_id, "ok": True, "instance_id": ref.instance_id,
                    "weights": self.catalogue.origin(ref.instance_id)}

        return {"results": await asyncio.gather(*(one(n) for n in nodes))}

    # ---- requests ----------------------------------------------------------------------------
    async def submit(self, job: Job) -> RequestStream:
        return await self.requests.submit(job)

    def abort(self, request_id: str) -> None:
        self.requests.abort(request_id)

    def waiting(self) -> int:
        """Requests waiting in the dispatcher's queue."""
        return self.requests.waiting()

    # ---- views ------------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        return {
            "nodes": self.pool.view(),
            # the models the cluster knows (a deleted one leaves once its requests have ended)
            "described": self.catalogue.view(),
            "cluster_models": sorted(self.cluster.models),
            "weights": self.weights.view() if self.weights is not None else None,
            "dispatcher": self.requests.view(),
        }


def _emulated_kinds(nodes: list[NodeSpec], emulate: dict[str, str]) -> frozenset[str]:
    """The mixed rig (`mesh serve --cpu-nodes N --emulate DEVICE:M`): kinds of node whose nodes
    all emulate, beside real ones; they run real models emulated from their shape
    (mesh.engines.emulation)."""
    emulating = set(emulate)
    real = {n.kind for n in nodes if n.node_id not in emulating}
    return frozenset({n.kind for n in nodes if n.node_id in emulating} - real) if real else frozenset()


def _cold_start(s: ClusterSettings) -> ColdStart:
    """The service's cold-start model: on emulated nodes the replay's, with the emulated
    GPU's host-to-GPU bandwidth (mesh.engines.emulation.emulated_cold_start)."""
    kw: dict[str, Any] = {"fixed_s": s.cold_start_s, "net_bytes_per_s": DEFAULT_TRANSFER_BYTES_PER_S}
    if s.agent.emulate and s.emulated_weights is not None:  # the policies expect an uncontended load, as the replay's
        nominal = s.emulated_weights.nominal_bytes_per_s()
        return ColdStart(nominal, nominal, **kw)
    if s.agent.emulate:
        return emulated_cold_start(set(s.agent.emulate.values()), s.agent.emulate_profiles, **kw)
    return ColdStart(**kw)
