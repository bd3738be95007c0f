"""The fleet: the cluster's nodes and the model instances on them (LLM-Mesh 4, 8.1).

The fleet holds the nodes (one ClusterNode each), knows which instances of which model run where,
starts instances with a modelled cold start (mesh.perf.load_times.ColdStart: weights from
host memory over PCIe to a GPU, or already in a CPU node's memory), recycles instances
idle past keep-alive, and records how many nodes of each kind are in use over time. It
decides nothing about where requests go: the schedulers (mesh.control.schedulers) do.

Time comes only from the event loop: the same code runs live and in a virtual-time replay.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mesh.control.cluster_node import ClusterNode, HostedInstance
from mesh.modelfiles.formats import ENGINE_OF_KIND, unhonoured
from mesh.perf.load_times import (
    DEFAULT_CPU_MEMORY_BYTES,
    DEFAULT_GPU_MEMORY_BYTES,
    GIB,
    ColdStart,
    ColdStartTable,
    LoadRecord,
)
from mesh.perf.model import PerformanceModel
from mesh.perf.profile import Profile
from mesh.policy.admission import InstancePlan
from mesh.policy.dispatch_rules import (
    ADMISSIONS,
    ADMIT_REJECT,
    COLD_START_CHOICES,
    CPU,
    DEFAULT_KEEP_ALIVE_S,
    GPU,
    SERVE_LATE,
    InstanceView,
    NodeView,
    keep_alive_expired,
)
from mesh.policy.kv_demand import DEFAULT_WATERMARK, RunningMean, kv_require_bytes, recommend_bytes
from mesh.policy.node_spec import NodeSpec
from mesh.policy.shadow import DEFAULT_MARGIN
from mesh.policy.slo import SLO, DeadlineRule
from mesh.wire.served_request import ServedRequest

DEFAULT_MAX_BATCH = 256  # B_max of the profiles (LLM-Mesh 5.2)
LIVE_USAGE_ENTRIES = 4096  # a live service's node-usage change points kept (nothing reads them there; bounded)


class ClusterError(ValueError):
    """The cluster cannot run: no nodes, or a model that fits no node. Raised before a run."""


@dataclass(frozen=True)
class ModelSpec:
    """A base model on each kind of node: its profile and performance model (5.2)."""

    name: str
    profiles: dict[str, Profile]  # by node kind
    times: dict[str, PerformanceModel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind, profile in self.profiles.items():
            if profile.device_kind != kind:
                raise ClusterError(
                    f"model {self.name}: the profile for {kind} nodes is a {profile.device_kind} profile "
                    f"({profile.model} on {profile.device})"
                )
            self.times.setdefault(kind, PerformanceModel(profile))

    def min_bytes(self, kind: str, watermark: float) -> int:
        """Memory an idle instance takes: weights and the initial KV cache (Eq. 2 at L_min)."""
        p = self.profiles[kind]
        return p.weight_bytes + recommend_bytes(kv_require_bytes(p.kv_bytes_per_token, (), 0, p.max_context), watermark)


@dataclass(frozen=True)
class ClusterConfig:
    cpu_nodes: int = 4
    gpu_nodes: int = 4
    cpu_memory_bytes: int = DEFAULT_CPU_MEMORY_BYTES
    gpu_memory_bytes: int = DEFAULT_GPU_MEMORY_BYTES
    cold_start: ColdStart = ColdStart()
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    margin: float = DEFAULT_MARGIN
    watermark: float = DEFAULT_WATERMARK
    slo: SLO = SLO()
    deadlines: DeadlineRule = DeadlineRule.EQ1  # when tokens after the first are due (mesh.policy.slo)
    noise: float = 0.0  # relative std-dev of simulated iteration times
    seed: int = 0
    # requests an instance runs at most (plans, validation, the engine's max_num_seqs)
    max_batch: int = DEFAULT_MAX_BATCH
    cold_start_choice: str = SERVE_LATE  # a cold model's request that cannot make its TTFT (dispatch_rules.SERVE_LATE)
    admission: str = ADMIT_REJECT  # a fresh request that can no longer meet its SLO (dispatch_rules.ADMISSIONS)
    # A replay's CPU nodes' parking budget beside their memory (the agent's --park-bytes): where
    # > 0 they park stopped instances and build ahead the models whose first host copy they
    # hold, as the service's OpenVINO nodes do (mesh.replay.local_node); 0: they park nothing.
    park_bytes: int = 0
    # A replay's CPU nodes hold host copies as the service's weights plane places them: the
    # first where the parameter pool puts it at registration (BlitzScale 5.3), then one on
    # every node that started an instance (the multicast's copy stays); a load where none is
    # held waits for the transfer (Fleet.transfer_s). False: every node holds every
    # model (LLM-Mesh 8.1: all models cached in host memory).
    host_copies: bool = False

    def __post_init__(self) -> None:
        for name in ("cpu_nodes", "gpu_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ClusterError(f"{name.replace('_', ' ')} must be a non-negative integer, got {value!r}")
        if self.cpu_memory_bytes <= 0 or self.gpu_memory_bytes <= 0:
            raise ClusterError("node memory must be positive")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ClusterError(f"max batch must be a positive integer, got {self.max_batch!r}")
        if self.keep_alive_s < 0:
            raise ClusterError(f"keep-alive must be >= 0 s, got {self.keep_alive_s}")
        if self.park_bytes < 0:
            raise ClusterError(f"a parking budget is >= 0 bytes, got {self.park_bytes}")
        if self.cold_start_choice not in COLD_START_CHOICES:
            raise ClusterError(f"cold_start_choice must be one of {', '.join(COLD_START_CHOICES)}, "
                               f"got {self.cold_start_choice!r}")
        if self.admission not in ADMISSIONS:
            raise ClusterError(f"admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        try:
            object.__setattr__(self, "deadlines", DeadlineRule.parse(self.deadlines))
        except ValueError as exc:
            raise ClusterError(str(exc)) from None

    def node_specs(self) -> list[NodeSpec]:
        cpus = [NodeSpec(f"cpu{i}", CPU, self.cpu_memory_bytes) for i in range(self.cpu_nodes)]
        gpus = [NodeSpec(f"gpu{i}", GPU, self.gpu_memory_bytes) for i in range(self.gpu_nodes)]
        return cpus + gpus


def check_cluster(config: ClusterConfig, catalog: dict[str, ModelSpec], kinds: tuple[str, ...], policy: str) -> None:
    """Refuse, before a run, a cluster the policy cannot use: no node of a kind it uses, or
    a model that fits no node it may place it on."""
    if config.cpu_nodes + config.gpu_nodes == 0:
        raise ClusterError("the cluster has no nodes: give at least one CPU or GPU node (--cpu-nodes, --gpu-nodes)")
    counts = {CPU: config.cpu_nodes, GPU: config.gpu_nodes}
    usable = [k for k in kinds if counts[k] > 0]
    if not usable:
        raise ClusterError(
            f"policy {policy} uses only {' and '.join(kinds).upper()} nodes and the cluster has none "
            f"(--cpu-nodes {config.cpu_nodes}, --gpu-nodes {config.gpu_nodes})"
        )
    memory = {CPU: config.cpu_memory_bytes, GPU: config.gpu_memory_bytes}
    for name, spec in catalog.items():
        fits = [k for k in usable if k in spec.profiles and spec.min_bytes(k, config.watermark) <= memory[k]]
        if not fits:
            needs = ", ".join(
                f"{k}: {spec.min_bytes(k, config.watermark) / GIB:.1f} GiB of {memory[k] / GIB:.0f} GiB"
                for k in usable if k in spec.profiles
            ) or f"no profile for {'/'.join(usable)} nodes"
            raise ClusterError(f"model {name} fits no node policy {policy} may use ({needs})")


@dataclass(eq=False)
class InstanceRef:
    """One instance in the cluster."""

    instance_id: str
    model: str  # the replica ("llama-2-7b/f017")
    base: str  # its base model ("llama-2-7b")
    node: ClusterNode
    seq: int
    recycle: asyncio.TimerHandle | None = None
    ready_at: float = 0.0  # when its load is predicted to end (issue + its predicted cold start)

    @property
    def inst(self) -> HostedInstance:
        return self.node.instances[self.instance_id]

    @property
    def requests(self) -> dict[str, ServedRequest]:
        """The requests it holds (none once the node lost it: a node agent can, mid-decision)."""
        inst = self.node.instances.get(self.instance_id)
        return inst.requests if inst is not None else {}

    @property
    def batch_size(self) -> int:
        return len(self.requests)

    def view(self) -> InstanceView:
        n = self.node
        return InstanceView(self.instance_id, n.node_id, n.spec.kind, self.model, self.batch_size, self.seq)


class Fleet:
    """The nodes and their instances, which it starts, keeps alive and stops; the books the schedulers read."""
    def __init__(
        self,
        config: ClusterConfig,
        catalog: dict[str, ModelSpec] | None = None,
        models: dict[str, str] | None = None,
        mean_output_prior: dict[str, float] | None = None,
        *,
        on_capacity: Callable[[], None] | None = None,
        nodes: Sequence[ClusterNode] = (),
        usage_entries: int | None = None,
    ) -> None:
        """`models` maps each model (replica) to its base model in `catalog`; `mean_output_prior` gives
        O_avg's starting value per base model (6.1). `nodes`: the nodes to schedule from the start; models
        and nodes may be added and removed later (the service: registrations, Ray membership).
        `usage_entries`: the most change points of `usage` kept, the oldest going first (a service that
        runs for months; LIVE_USAGE_ENTRIES); None keeps them all (a replay's node-seconds read every one)."""
        catalog, models, mean_output_prior = catalog or {}, models or {}, mean_output_prior or {}
        unknown = sorted({b for b in models.values() if b not in catalog})
        if unknown:
            raise ClusterError(f"no model spec for {', '.join(unknown)}; known: {', '.join(sorted(catalog))}")
        self.config = config
        self.catalog = dict(catalog)
        self.models = dict(models)
        self.on_evict: Callable[[ServedRequest, ClusterNode], None] | None = None  # the dispatcher's
        self.on_capacity = on_capacity
        self._mean_output = {m: RunningMean(mean_output_prior.get(b, 256.0)) for m, b in models.items()}
        self._slo: dict[str, SLO] = {}  # a model's own SLO (the service's per-model SLOs); else config.slo
        self._cold_choice: dict[str, str] = {}  # a model's own cold_start choice; else config.cold_start_choice
        self._admission: dict[str, str] = {}  # a model's own admission choice; else its tenant's
        self._tenant_admission: dict[str, str] = {}  # a tenant's default for its models; else config.admission
        self._by_model: dict[str, list[InstanceRef]] = {}
        self._by_id: dict[str, InstanceRef] = {}
        self._ids = itertools.count()
        self._in_use = {CPU: 0, GPU: 0}
        self._unloads: set[asyncio.Task] = set()
        self._on_node: Counter[str] = Counter()  # instances per node (a node is in use while it has one)
        self._starting: Counter[str] = Counter()  # loads being issued, by model (not yet in the books)
        # (time, CPU nodes in use, GPU nodes in use) at each change
        self.usage: deque[tuple[float, int, int]] = deque([(0.0, 0, 0)], maxlen=usage_entries)
        self.instances_started = 0
        self.instances_recycled = 0
        self.cold_start_s = 0.0  # summed predicted cold starts
        self._loads_end: dict[str, float] = {}  # node id -> when the loads issued on it are predicted to end
        # Cold starts measured, not assumed: every node's loads per model and source, and the weights transfers
        self.cold_starts = ColdStartTable()
        self._loading: dict[str, tuple[float, float, str]] = {}  # instance -> (issued, its wait, node kind)
        # Does `node` hold a copy of the model's weights (the service's weights plane)? None:
        # every node does (LLM-Mesh 8.1: all models cached in CPU memory), so no transfer.
        self.holds_copy: Callable[[str, ClusterNode], bool] | None = None
        self.nodes: list[ClusterNode] = []
        self.node_seq: dict[str, int] = {}
        for node in nodes:
            self.add_node(node)

    # -- membership: models and nodes ---------------------------------------------------
    def add_node(self, node: ClusterNode) -> None:
        """Schedule on `node` from now on (not started here; made to report to this view)."""
        if node.node_id in self.node_seq:
            raise ClusterError(f"node {node.node_id} is already in the cluster")
        self.node_seq[node.node_id] = len(self.nodes)
        self.nodes.append(node)

    def remove_node(self, node_id: str) -> ClusterNode | None:
        """Stop scheduling on a node that left; its instances leave the books (their requests
        were ended or handed back by the node), and so do its measured loads: a node that
        joins later under the same id starts from its peers' loads, and the table does not
        grow with every node that comes and goes."""
        seq = self.node_seq.pop(node_id, None)
        if seq is None:
            return None
        node = self.nodes.pop(seq)
        self.node_seq = {n.node_id: k for k, n in enumerate(self.nodes)}
        for ref in [r for r in self._by_id.values() if r.node is node]:
            if ref.recycle is not None:
                ref.recycle.cancel()
            self._forget(ref)
        self.cold_starts.forget_node(node_id)
        return node

    def add_model(self, model: str, spec: ModelSpec, mean_output_prior: float, slo: SLO | None = None) -> None:
        """A model (its own base) that requests may name from now on; a new spec replaces the old."""
        self.catalog[spec.name] = spec
        self.models[model] = spec.name
        self._mean_output.setdefault(model, RunningMean(mean_output_prior))
        if slo is not None:
            self._slo[model] = slo

    def issuing(self, model: str) -> bool:
        """Is a load of `model` being issued (its instance not yet in the books)?"""
        return model in self._starting

    def forget_model(self, model: str) -> bool:
        """A deleted model leaves the books: its spec (and its base's, if no other model
        names it), mean, SLO, cold-start choice and measured loads. Only once it has no
        instance (requests still in flight are planned with its spec) and no load of it is
        being issued (its instance would be known to no one once it loads); False until then."""
        if self._by_model.get(model) or model in self._starting:
            return False
        self._by_model.pop(model, None)
        base = self.models.pop(model, None)
        if base is not None and base not in self.models.values():
            self.catalog.pop(base, None)
        self._mean_output.pop(model, None)
        self._slo.pop(model, None)
        self._cold_choice.pop(model, None)
        self.cold_starts.forget_model(model)
        return True

    def slo_of(self, model: str) -> SLO:
        return self._slo.get(model, self.config.slo)

    def cold_start_choice(self, model: str) -> str:
        """SERVE_LATE or REJECT for the model's requests that its cold start makes late."""
        return self._cold_choice.get(model, self.config.cold_start_choice)

    def set_cold_start_choice(self, model: str, choice: str) -> None:
        if choice not in COLD_START_CHOICES:
            raise ClusterError(f"cold_start must be one of {', '.join(COLD_START_CHOICES)}, got {choice!r}")
        self._cold_choice[model] = choice

    def admission(self, model: str, tenant: str = "") -> str:
        """The model's admission choice (dispatch_rules.ADMISSIONS): its own, else its tenant's
        default, else the cluster's."""
        own = self._admission.get(model)
        return own if own is not None else self._tenant_admission.get(tenant, self.config.admission)

    def set_tenant_admission(self, tenant: str, choice: str | None) -> None:
        """`tenant`'s default admission choice for its models without their own; None: the cluster's."""
        _set_admission(self._tenant_admission, tenant, choice)

    def set_admission(self, model: str, choice: str | None) -> None:
        """The model's own admission choice; None: its tenant's default, else the cluster's."""
        _set_admission(self._admission, model, choice)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.usage.clear()
        self.usage.append((self._now(), 0, 0))
        for node in self.nodes:
            await node.start()

    def check_nodes(self) -> None:
        """Raise if a node's token-level loop died (a bug: its requests would hang)."""
        for node in self.nodes:
            exc = node.failure()
            if exc is not None:
                raise RuntimeError(f"node {node.node_id}: its token-level loop crashed: {exc!r}") from exc

    async def stop(self) -> None:
        for ref in self._by_id.values():
            if ref.recycle is not None:
                ref.recycle.cancel()
        await asyncio.gather(*(n.stop() for n in self.nodes))

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    # -- views -----------------------------------------------------------------------
    def instances_of(self, model: str) -> list[InstanceRef]:  # not one its node lost, instance_gone on its way
        return [r for r in self._by_model.get(model, []) if r.instance_id in r.node.instances]

    def all_instances(self) -> list[InstanceRef]:
        return list(self._by_id.values())

    def instance(self, instance_id: str) -> InstanceRef | None:
        return self._by_id.get(instance_id)

    def instances_on(self, node: ClusterNode) -> list[InstanceRef]:
        return [self._by_id[i] for i in node.instances if i in self._by_id]  # not one still starting

    def node_views(self) -> list[NodeView]:
        return [
            NodeView(n.node_id, n.spec.kind, len(n.instances), n.used_bytes(), n.spec.memory_bytes, k)
            for k, n in enumerate(self.nodes) if n.up
        ]

    def node(self, node_id: str) -> ClusterNode:
        return self.nodes[self.node_seq[node_id]]

    def hosts(self, model: str) -> set[str]:
        """Nodes with an instance of `model`."""
        return {ref.node.node_id for ref in self.instances_of(model)}

    def fastest_prefill_s(self, model: str, prompt_len: int, kinds: tuple[str, ...]) -> float:
        """The quickest a prompt could be prefilled on any node kind the policy uses."""
        spec = self.catalog[self.models[model]]
        return min(spec.times[k].prefill_s(prompt_len) for k in kinds if k in spec.times)

    def in_use(self) -> tuple[int, int]:
        return self._in_use[CPU], self._in_use[GPU]

    # -- instances -------------------------------------------------------------------
    def plan(self, model: str, node: ClusterNode) -> InstancePlan:
        """A new instance of `model` on `node`, with its predicted cold start (4, 8.1)."""
        kind = node.spec.kind
        spec = self.catalog[self.models[model]]
        p = spec.profiles[kind]
        expected = self.expected_load_s(model, node)
        return InstancePlan(
            f"{model}@{node.node_id}#{next(self._ids)}", model, spec.times[kind], self.slo_of(model),
            p.kv_bytes_per_token, p.weight_bytes, p.max_context, p.max_context, self.config.max_batch,
            self._mean_output[model], expected, self.load_wait_s(node),
        )

    def expected_load_s(self, model: str, node: ClusterNode) -> float:
        """The predicted cold start of a new instance of `model` on `node`: waiting for the
        loads under way there, the weights transfer if the node holds no copy, and the load
        itself (`engine_load_s`)."""
        return self.load_wait_s(node) + self.transfer_s(model, node) + self.engine_load_s(model, node)

    def engine_load_s(self, model: str, node: ClusterNode) -> float:
        """The load itself, weights in place (read, convert or import, compile, tokenizer,
        KV allocation, warm-up; none of it where the node has the model parked): as measured
        on this node, else on its peers (nodes of its kind), else the prior (ColdStart:
        `--cold-start-s`, or a replay's measured table), with the initial KV cache allocation
        (LLM-Mesh Figure 8)."""
        kind = node.spec.kind
        peers = [n.node_id for n in self.nodes if n.spec.kind == kind]
        measured = self.cold_starts.expected_load_s(node.node_id, model, peers, parked=node.parked(model))
        if measured is not None:
            return measured
        base = self.models[model]
        spec = self.catalog[base]
        weight_bytes = spec.profiles[kind].weight_bytes
        kv0 = spec.min_bytes(kind, self.config.watermark) - weight_bytes
        return self.config.cold_start.instance_load_s(weight_bytes, kind, base, kv0)

    def simulated_load_s(self, plan: InstancePlan, kind: str, adopted_s: float | None = None) -> float:
        """How long a simulated (or emulated) engine's load of the planned instance takes
        (ColdStart.simulated_load_s, after the wait for the loads under way on its node;
        `adopted_s`: it adopts a parked worker, built in that many seconds more)."""
        return self.config.cold_start.simulated_load_s(plan.load_wait_s, plan.weight_bytes, kind,
                                                       self.models.get(plan.model), adopted_s)

    def holds(self, model: str, node: ClusterNode) -> bool:
        """Does `node` hold a copy of `model`'s weights (no transfer before its load)?"""
        return self.holds_copy is None or self.holds_copy(model, node)

    def holding(self, model: str) -> set[str] | None:
        """The nodes holding a copy of `model` (None: all of them), for the node order."""
        return None if self.holds_copy is None else {n.node_id for n in self.nodes if self.holds(model, n)}

    def transfer_s(self, model: str, node: ClusterNode) -> float:
        """The weights transfer a load on `node` waits for: none where it holds a copy, else
        the model's bytes at the measured transfer throughput (else the prior)."""
        if self.holds(model, node):
            return 0.0
        p = self.catalog[self.models[model]].profiles[node.spec.kind]
        return self.config.cold_start.transfer_s(p.weight_bytes, self.cold_starts.transfer_bytes_per_s())

    def cold_start_left_s(self, model: str) -> float | None:
        """The time left of the model's cold start under way (the one that ends first, as
        predicted when it was issued; 0 once overdue); None if no instance of it is loading.
        What a request turned away meanwhile is told to wait (Retry-After)."""
        loading = [r for r in self.instances_of(model) if not r.inst.loaded]
        if not loading:
            return None
        return max(0.0, min(r.ready_at for r in loading) - self._now())

    def load_wait_s(self, node: ClusterNode) -> float:
        """How long a load issued on `node` now waits for those already issued there: a node
        loads one instance at a time (ColdStart), so two models started together on one node
        are not both ready after one load time."""
        return max(0.0, self._loads_end.get(node.node_id, 0.0) - self._now())

    def can_host(self, model: str, node: ClusterNode) -> bool:
        spec = self.catalog[self.models[model]]
        kind = node.spec.kind
        return node.up and kind in spec.profiles and node.can_fit(spec.min_bytes(kind, self.config.watermark))

    async def start_instance(self, plan: InstancePlan, node: ClusterNode) -> InstanceRef | None:
        """Start the planned instance (issue its load); None if the node's memory refuses."""
        kind = node.spec.kind
        issued = self._now()
        transfer = not self.holds(plan.model, node)
        transfer_s = self.transfer_s(plan.model, node)
        self._starting[plan.model] += 1  # a deletion meanwhile waits for it (forget_model), then stops it
        try:
            if not await node.start_instance(plan):  # the service's node moves the weights there first
                return None
        finally:
            self._starting[plan.model] -= 1
            if not self._starting[plan.model]:
                del self._starting[plan.model]
        now = self._now()
        staged = node.staging(plan.instance_id)  # its weights still on their way: the node measures them
        if transfer and not staged:
            self.cold_starts.record_transfer(plan.weight_bytes, now - issued)
        wait = self.load_wait_s(node)
        load = self.engine_load_s(plan.model, node) + (transfer_s if staged else 0.0)
        ref = InstanceRef(plan.instance_id, plan.model, self.models[plan.model], node, self.instances_started,
                          ready_at=now + wait + load)
        self._loading[plan.instance_id] = (now, wait, kind)
        self._loads_end[node.node_id] = now + wait + load
        self.instances_started += 1
        self.cold_start_s += plan.expected_load_s
        self._by_model.setdefault(plan.model, []).append(ref)
        self._by_id[plan.instance_id] = ref
        self._on_node[node.node_id] += 1
        if self._on_node[node.node_id] == 1:
            self._usage_changed(kind, +1)
        return ref

    async def stop_instance(self, ref: InstanceRef) -> None:
        """Unload an instance that holds no requests."""
        if ref.recycle is not None:
            ref.recycle.cancel()
            ref.recycle = None
        if self._by_id.get(ref.instance_id) is not ref:
            return  # already stopped
        self._forget(ref)
        await ref.node.stop_instance(ref.instance_id)

    def request_evicted(self, node: ClusterNode, req: ServedRequest) -> None:
        """A request left `node` with its progress: the dispatcher places it again."""
        if self.on_evict is not None:
            self.on_evict(req, node)

    def instance_loaded(self, node: ClusterNode, instance_id: str) -> None:
        """An instance finished loading: its load is measured (from its issue, less its
        predicted wait for the loads before it on the node) under the source the node
        names; then keep-alive for it if it is unused."""
        issued = self._loading.pop(instance_id, None)
        ref = self._by_id.get(instance_id)
        if issued is not None and ref is not None:
            at, wait, kind = issued
            now = self._now()
            self.cold_starts.record(LoadRecord(node.node_id, kind, ref.model,
                                               node.loaded_from(instance_id) or "weights",
                                               max(0.0, now - at - wait), now))
        self.note_idle(node)

    def instance_gone(self, node: ClusterNode, instance_id: str) -> None:
        """The node lost an instance on its own (its load failed, the node went down)."""
        self._loading.pop(instance_id, None)
        ref = self._by_id.get(instance_id)
        if ref is not None:
            if ref.recycle is not None:
                ref.recycle.cancel()
            self._forget(ref)
            if self.on_capacity is not None:
                self.on_capacity()

    def _forget(self, ref: InstanceRef) -> None:
        """Take a stopping instance out of the cluster's books (no request is placed on it
        from now on)."""
        self._by_model[ref.model].remove(ref)
        if not self._by_model[ref.model]:
            del self._by_model[ref.model]
        del self._by_id[ref.instance_id]
        self._on_node[ref.node.node_id] -= 1
        if self._on_node[ref.node.node_id] == 0:
            self._usage_changed(ref.node.spec.kind, -1)

    def _usage_changed(self, kind: str, delta: int) -> None:
        self._in_use[kind] += delta
        now = self._now()
        entry = (now, self._in_use[CPU], self._in_use[GPU])
        if self.usage and self.usage[-1][0] == now:
            self.usage[-1] = entry
        else:
            self.usage.append(entry)

    # -- keep-alive (LLM-Mesh 4) -------------------------------------------------------
    def note_idle(self, node: ClusterNode) -> None:
        """Arm the keep-alive timer of every loaded instance on `node` that holds no
        requests (a loading one is armed when its load completes)."""
        loop = asyncio.get_running_loop()
        for instance_id, inst in node.instances.items():
            if inst.requests or not inst.loaded:
                continue
            ref = self._by_id.get(instance_id)
            if ref is not None and ref.recycle is None:  # None: already unloading
                ref.recycle = loop.call_at(inst.idle_since + self.config.keep_alive_s, self._recycle, ref)

    def _recycle(self, ref: InstanceRef) -> None:
        ref.recycle = None
        if self._by_id.get(ref.instance_id) is not ref:
            return
        inst = ref.node.instances.get(ref.instance_id)
        if inst is None or inst.requests or not inst.loaded:  # None: its node lost it (instance_gone follows)
            return
        now = self._now()
        if not keep_alive_expired(inst.idle_since, now, self.config.keep_alive_s):
            ref.recycle = asyncio.get_running_loop().call_at(inst.idle_since + self.config.keep_alive_s, self._recycle,
                                                             ref)
            return
        self.instances_recycled += 1
        self._forget(ref)  # at once: nothing is placed on it while it unloads
        task = asyncio.get_running_loop().create_task(self._unload(ref))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def _unload(self, ref: InstanceRef) -> None:
        await ref.node.stop_instance(ref.instance_id)
        if self.on_capacity is not None:
            self.on_capacity()


def _set_admission(choices: dict[str, str], key: str, choice: str | None) -> None:
    """Set (or, for None, clear) one admission choice, refusing a name dispatch_rules.ADMISSIONS lacks."""
    if choice is None:
        choices.pop(key, None)
    elif choice not in ADMISSIONS:
        raise ClusterError(f"admission must be one of {', '.join(ADMISSIONS)}, got {choice!r}")
    else:
        choices[key] = choice


def unable_nodes(nodes: Sequence[ClusterNode], reqs: Sequence[ServedRequest]) -> frozenset[str]:
    """Nodes whose engine cannot honour a field one of `reqs` uses (logprobs, penalties:
    mesh.modelfiles.formats.ENGINE_FEATURES): none of them is placed there."""
    features = frozenset().union(*(r.engine_request.sampling.features() for r in reqs))
    if not features:
        return frozenset()
    return frozenset(n.node_id for n in nodes
                     if n.kind in ENGINE_OF_KIND and unhonoured(ENGINE_OF_KIND[n.kind], features))
