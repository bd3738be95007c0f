"""When a new instance's weights are in, by where they come from: the cluster side of cold starts.

The modes (`WeightsConfig.mode`: ssd, host, multicast, multicast-live) and what each models
are in mesh.replay.cold_start_modes' docstring and docs/multicast.md ("Weights by network").
This is the decision part, one for both sides: a replay's simulated engines
(mesh.replay.cold_start_modes.WeightsModel) and the emulated nodes of `mesh serve
--emulate-weights` (mesh.control.emulated_loads sends its decision in InstanceSpec's
emulated_load_s, emulated_layers and emulated_partner). `LoadTiming.loading` gives each
new instance when it can serve and, live, its `LiveRole`: its usable layers over time (from
the multicast's block arrivals) and its ZigZag partner or its execution pipeline, by the
rules of mesh.policy.live_scaling.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mesh.modelfiles.shape import layers_and_hidden
from mesh.perf.load_times import NET_BYTES_PER_S, PCIE_BYTES_PER_S, CostModel, block_sizes, schedule, weights_load_s
from mesh.policy.admission import InstancePlan
from mesh.policy.live_scaling import LayerArrivals, Stage, block_layer_ends, execution_pipelines, stage_ranges
from mesh.policy.multicast import chains, make_plan, sub_groups
from mesh.policy.param_pool import ParameterPool

if TYPE_CHECKING:
    from mesh.control.fleet import Fleet

MODES: tuple[str, ...] = ("ssd", "host", "multicast", "multicast-live")
HOST_MEMORY_BYTES = 2 * 10**12  # per GPU node, for the pool's host copies (far more than needed)


@dataclass(frozen=True)
class WeightsConfig:
    mode: str = "ssd"
    ssd_bytes_per_s: float = 3e9  # one NVMe drive, about 3 GB/s sequential read
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S  # PCIe 4.0 x16, pinned memory (mesh.perf.load_times)
    net_bytes_per_s: float = NET_BYTES_PER_S  # 200 Gbit/s RDMA per GPU (BlitzScale's setups: 100-200 Gbps)
    block_bytes: int = 256 * 2**20
    plan: str = "binomial"
    latency_s: float = 10e-6  # per block transfer
    fixed_s: float = 0.0  # engine start-up per instance, on top of the weights
    layers: int = 32  # a model without a shape file (mesh/modelfiles/shapes): Llama-2-7B's
    hidden_size: int = 4096

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown weights mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.plan not in ("binomial", "chain", "naive"):
            raise ValueError(f"unknown plan {self.plan!r}: binomial, chain or naive")
        if not (self.ssd_bytes_per_s > 0 and self.pcie_bytes_per_s > 0 and self.net_bytes_per_s > 0
                and self.block_bytes > 0 and self.latency_s >= 0 and self.fixed_s >= 0
                and self.layers >= 1 and self.hidden_size >= 1):
            raise ValueError(f"bandwidths, block size, layers and hidden size must be > 0, latency and fixed "
                             f"time >= 0: {self}")

    def nominal_bytes_per_s(self) -> float:
        """The bandwidth of one uncontended cold start (for the policy's expected load time)."""
        return {"ssd": self.ssd_bytes_per_s, "host": self.pcie_bytes_per_s}.get(self.mode, self.net_bytes_per_s)



def stop_the_world_s(config: WeightsConfig, weight_bytes: int, from_host: bool) -> float:
    """A load that serves only once every byte is in: from host memory over PCIe, or the SSD."""
    return weights_load_s(weight_bytes, config.pcie_bytes_per_s if from_host else config.ssd_bytes_per_s,
                          config.fixed_s)


@dataclass
class Pipeline:
    """An execution pipeline of receivers (lambdaScale 4.3): members (instance ids, in
    Algorithm 2's order), each member's block arrivals (time, block), and the layer each
    block ends on."""

    members: list[str]
    blocks: dict[str, list[tuple[float, int]]]
    layer_ends: tuple[int, ...]
    assignment: dict[str, list[str]] | None = None  # the mode switch's, once made

    def stages(self, t: float) -> list[Stage] | None:
        held = {m: {b for s, b in arr if s <= t} for m, arr in self.blocks.items()}
        return stage_ranges(self.members, held, self.layer_ends)

    def cover_s(self) -> float:
        """The first instant the members together hold every layer."""
        for t in sorted({s for arr in self.blocks.values() for s, _ in arr}):
            if self.stages(t) is not None:
                return t
        return math.inf

    def switch_s(self) -> float:
        """When every member holds the whole model (the mode switch, 4.4)."""
        return max(max(s for s, _ in arr) for arr in self.blocks.values())


@dataclass
class LiveRole:
    """How a new instance serves before its last layer: its own usable layers over time,
    and its ZigZag partner or its pipeline."""

    arrivals: LayerArrivals
    hidden_size: int
    link_bytes_per_s: float
    partner: str | None = None
    pipeline: Pipeline | None = None

    @property
    def until_s(self) -> float:
        """When it serves as a full instance (after the switch's recomputation)."""
        return self.pipeline.switch_s() if self.pipeline is not None else self.arrivals.full_s



@dataclass(frozen=True)
class EmulatedLoad:
    """An emulated node's load as InstanceSpec carries it: how long until its last layer is
    in (`load_s`), and, where it serves before that as the target of ZigZag, its usable
    layers over the load ((seconds after its start, layers), `LayerArrivals.steps`), its
    partner instance and the link its activations cross."""

    load_s: float
    layer_steps: tuple[tuple[float, int], ...] | None = None
    partner: str | None = None
    link_bytes_per_s: float = NET_BYTES_PER_S


@dataclass
class _Group:
    model: str
    started: float
    targets: list[tuple[str, str, int]] = field(default_factory=list)  # (instance id, node, bytes)
    result: dict[str, tuple[float, LiveRole | None]] | None = None


@dataclass
class WeightsStats:
    loads: dict[str, int] = field(default_factory=dict)  # how -> count (ssd, host, multicast, live, pipeline)
    multicasts: int = 0
    multicast_targets: int = 0
    load_s: list[float] = field(default_factory=list)  # per instance: load start -> serving
    pulls: int = 0  # live iterations the partner finished (ZigZag)
    pipelines: int = 0  # execution pipelines formed (of two members or more)
    activation_bytes: int = 0  # hidden states across the network
    recompute_tokens: int = 0  # KV recomputed at switches
    switch_moves: int = 0  # requests switch_assignment would move to another member
    waited: set[str] = field(default_factory=set)  # requests in iterations that waited for layers


class LoadTiming:
    """Decides each new instance's cold start, by the weights mode: when it serves, and how
    before its last layer (a LiveRole). One per replay run (its simulated engines), or one
    per service whose emulated nodes load by it (ModelCatalogue.load_spec)."""

    def __init__(self, config: WeightsConfig, cluster: "Fleet") -> None:
        self.config = config
        self.cluster = cluster
        self.pool = ParameterPool()
        for node in cluster.nodes:
            self.pool.add_node(node.node_id, HOST_MEMORY_BYTES)
        self.stats = WeightsStats()
        self._group: _Group | None = None
        self._by_instance: dict[str, _Group] = {}
        self._live: set[str] = set()  # instances serving before their last layer
        self._partners: dict[str, str] = {}  # live instance -> its partner instance
        self._cached: set[tuple[str, str]] = set()  # (model, node) host copies (mode host)
        self._uplink_free: dict[str, float] = {}  # node -> when its last planned send ends

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _join(self, plan: InstancePlan, node_id: str) -> None:
        if self.config.mode not in ("multicast", "multicast-live"):
            return
        now = self._now()
        g = self._group
        if g is None or g.model != plan.model or g.result is not None:  # closed by its first load
            g = self._group = _Group(plan.model, now)
        g.targets.append((plan.instance_id, node_id, plan.weight_bytes))
        self._by_instance[plan.instance_id] = g

    def _base(self, model: str) -> str:
        """The catalog model `model` is a replica of (its shape): Fleet.models' base, else itself."""
        return getattr(self.cluster, "models", {}).get(model, model)

    def _count(self, how: str) -> None:
        self.stats.loads[how] = self.stats.loads.get(how, 0) + 1

    def emulated_load(self, plan: InstancePlan, node_id: str, wait_s: float = 0.0) -> EmulatedLoad:
        """An emulated node's load of the planned instance, starting now (after `wait_s` for
        the node's loads under way), as InstanceSpec carries it. Each load is its own
        multicast (the service plans one instance at a time), so a pipeline role (several
        targets at once) does not arise here."""
        self._join(plan, node_id)
        now = self._now()
        ready, role = self.loading(plan, node_id)
        if role is None or role.partner is None:
            return EmulatedLoad(wait_s + max(0.0, ready - now))
        steps = tuple((wait_s + max(0.0, t - now), n) for t, n in role.arrivals.steps)
        return EmulatedLoad(wait_s + max(0.0, role.arrivals.full_s - now), steps, role.partner,
                            role.link_bytes_per_s)

    def loading(self, plan: InstancePlan, node_id: str) -> tuple[float, LiveRole | None]:
        """When the instance can serve, and how it serves before its last layer (None: it waits)."""
        now = self._now()
        mode = self.config.mode
        if mode in ("ssd", "host"):
            cached = mode == "host" and (plan.model, node_id) in self._cached
            self._count("host" if cached else "ssd")
            if mode == "host":
                self._cached.add((plan.model, node_id))
            ready = now + stop_the_world_s(self.config, plan.weight_bytes, cached)
            self.stats.load_s.append(ready - now)
            return ready, None
        g = self._by_instance.pop(plan.instance_id)
        if g.result is None:
            g.result = self._multicast(g)
        ready, role = g.result[plan.instance_id]
        self.stats.load_s.append(ready - now)
        return ready, role

    def _groups(self, sources: list[str], targets: list[str]) -> list[list[str]]:
        """The plan's receiver groups, for Algorithm 2: binomial sub-groups, chains, or one
        group per target (naive: every target alone)."""
        if self.config.plan == "binomial":
            return sub_groups(sources, targets)
        if self.config.plan == "chain":
            return [ch[1:] for ch in chains(sources, targets)]
        return [[t] for t in targets]

    def _multicast(self, g: _Group) -> dict[str, tuple[float, LiveRole | None]]:
        cfg = self.config
        model = g.model
        size = g.targets[0][2]
        if model not in self.pool.models():
            self.pool.register(model, size)
        hosts = set(self.pool.host_copies(model))
        now = g.started
        out: dict[str, tuple[float, LiveRole | None]] = {}
        by_net: list[tuple[str, str]] = []
        for iid, node, nbytes in g.targets:
            if node in hosts:
                self._count("host")
                out[iid] = (now + stop_the_world_s(cfg, nbytes, True), None)
            else:
                by_net.append((iid, node))
        if not by_net:
            return out
        targets = list(dict.fromkeys(node for _, node in by_net))
        full = [r for r in self.cluster.instances_of(model) if r.inst.loaded and r.instance_id not in self._live]
        sources = [loc.node for loc in self.pool.sources(model, exclude=targets, use_instances=False)]
        sources += [n for n in dict.fromkeys(r.node.node_id for r in full) if n not in sources and n not in targets]
        # A node's uplink carries one multicast at a time: use the sources that are free now,
        # else wait for the one that frees first (overlapping multicasts queue, not share).
        free = [n for n in sources if self._uplink_free.get(n, -math.inf) <= now]
        if not free:
            free = [min(sources, key=lambda n: (self._uplink_free[n], n))]
        begin = max(now, *(self._uplink_free.get(n, -math.inf) for n in free))
        sizes = block_sizes(size, cfg.block_bytes)
        sched = schedule(make_plan(cfg.plan, free, targets, len(sizes)),
                         CostModel(cfg.block_bytes, cfg.net_bytes_per_s, cfg.latency_s), sizes)
        for tt in sched.transfers:
            sender = tt.transfer.sender
            self._uplink_free[sender] = max(self._uplink_free.get(sender, -math.inf), begin + tt.finish_s)
        now = begin  # the plan's clock starts when its sources are free
        self.stats.multicasts += 1
        self.stats.multicast_targets += len(targets)
        arrivals: dict[str, list[tuple[float, int]]] = {t: [] for t in targets}
        for tt in sched.transfers:
            if tt.transfer.receiver in arrivals:
                arrivals[tt.transfer.receiver].append((now + cfg.fixed_s + tt.finish_s, tt.transfer.block))
        layers, hidden = layers_and_hidden(self._base(model), cfg.layers, cfg.hidden_size)
        ends = block_layer_ends(sizes, layers)
        partners = [r.instance_id for r in full if r.instance_id not in self._partners.values()]
        alone: list[tuple[str, str]] = []
        for iid, node in by_net:
            done = now + cfg.fixed_s + sched.completion_s[node]
            if cfg.mode == "multicast-live" and partners:
                partner = partners.pop(0)
                self._partners[iid] = partner
                role = LiveRole(LayerArrivals.from_blocks(arrivals[node], ends), hidden, cfg.net_bytes_per_s,
                                partner=partner)
                self._count("live")
                self._live.add(iid)
                asyncio.get_running_loop().call_at(done, self._end_live, iid)
                out[iid] = (role.arrivals.first_s, role)
            else:
                alone.append((iid, node))
                out[iid] = (done, None)
        if cfg.mode == "multicast-live" and len(alone) > 1:
            self._pipelines(alone, arrivals, ends, hidden, free, out)
        for iid, _ in alone:
            self._count("multicast" if out[iid][1] is None else "pipeline")
        return out

    def _pipelines(self, alone: list[tuple[str, str]], arrivals: dict[str, list[tuple[float, int]]],
                   ends: tuple[int, ...], hidden: int, sources: list[str],
                   out: dict[str, tuple[float, LiveRole | None]]) -> None:
        """lambdaScale 4.3: receivers without a partner form execution pipelines (Algorithm 2
        over the plan's groups); a pipeline serves from when its members cover the model."""
        iid_of = dict((node, iid) for iid, node in reversed(alone))  # one instance per node
        nodes = [n for n in dict.fromkeys(node for _, node in alone)]
        groups = [[n for n in grp if n in iid_of] for grp in self._groups(sources, nodes)]
        for members in execution_pipelines(groups):
            if len(members) < 2:
                continue
            pipe = Pipeline([iid_of[n] for n in members], {iid_of[n]: arrivals[n] for n in members}, ends)
            cover = pipe.cover_s()
            if not cover < min(out[iid_of[n]][0] for n in members):
                continue
            self.stats.pipelines += 1
            for n in members:
                iid = iid_of[n]
                self._live.add(iid)  # not a source nor a partner before its last block
                asyncio.get_running_loop().call_at(out[iid][0], self._end_live, iid)
                role = LiveRole(LayerArrivals.from_blocks(arrivals[n], ends), hidden, self.config.net_bytes_per_s,
                                pipeline=pipe)
                out[iid] = (cover, role)

    def _end_live(self, iid: str) -> None:
        self._live.discard(iid)
        self._partners.pop(iid, None)
