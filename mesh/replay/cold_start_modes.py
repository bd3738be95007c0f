"""Cold starts by where the weights come from, for replays.

Four modes (`WeightsConfig.mode`), all for GPU instances of one model:

- `ssd`: every cold start reads the weights from the node's local SSD:
  `fixed + bytes / ssd_bw` (default 3 GB/s, one NVMe drive).
- `host`: ServerlessLLM-style host cache: a node's first load of a model reads the SSD and
  keeps a copy in its host memory; later loads on that node copy host -> GPU over PCIe
  (`bytes / pcie_bw`, default 25 GB/s). Host memory is assumed large enough (no eviction).
- `multicast`: BlitzScale 5.1/5.3 and lambdaScale 4.2. The parameter pool
  (mesh.policy.param_pool) holds one host copy per model, placed at registration. A node
  with a host copy loads over PCIe; the others get the weights by network multicast. All
  instances of a model whose loads start at the same instant form one multicast; its
  sources are the pool's host copies and the nodes with a fully loaded instance of the
  model; the plan (`binomial` or `chain`, mesh.policy.multicast) is timed by
  `schedule()` (mesh.perf.load_times) under `CostModel(block_bytes, net_bw, latency)`, GPUDirect (the blocks land in
  GPU memory, no PCIe hop); a target's load time is its completion time. A node's uplink
  carries one multicast at a time: a multicast uses the sources whose uplink is free, else
  waits for the one that frees first (overlapping multicasts queue rather than share).
- `multicast-live`: `multicast` plus live scaling, by the rules of mesh.policy.live_scaling
  (the ones a live runtime uses). Block arrivals come from the multicast's schedule; a
  receiver's usable layers are its longest prefix of blocks (layers of equal bytes, the
  model's shape from mesh/modelfiles/shapes, else `WeightsConfig.layers`/`hidden_size`).
  * ZigZag (BlitzScale 5.2, Fig. 16): a new instance whose multicast starts while a fully
    loaded instance of the model (its partner) is not already partnered serves from its first
    layer on. Each of its iterations (full-speed time W) runs layer by layer on it as the
    layers arrive (`target_next`: W/L a layer); whenever the partner has no request waiting
    for prefill of its own (`source_pull`), it pulls the iteration with its activation
    (hidden x tokens x 2 bytes at the network bandwidth) and runs the remaining layers in
    (1 - f) W once its own iteration in flight ends, if that ends no later than the new
    instance alone would (`pull_helps`); the partner's next iteration then waits for it.
    From the last layer on, full speed; requests that had iterations pulled recompute their
    KV cache (prompt + tokens so far, as prefills) at the new instance's next iteration.
  * Execution pipelines (lambdaScale 4.3, Algorithm 2) for the receivers without a partner
    (a scale from zero): the multicast's sub-groups (binomial: `sub_groups`, one per source;
    chain: one per chain) form pipelines; from the first instant the members' held blocks
    cover the model (`stage_ranges`), each member serves, every iteration taking
    `pipeline_iteration_s` (W plus one activation hop per stage boundary, or the slowest
    stage times the batches in flight: the members with work), or the member alone if sooner. When every
    member holds the model, the mode switch (4.4): the pipeline's running requests are
    spread with `switch_assignment` and each member recomputes the KV cache of its share
    (prefills of prompt + tokens so far) before its next iteration.
  * Shadow validation predicts a live instance's iterations from its layers (the instance
    alone, mesh.policy.shadow.live_iteration_end): the engine gives its `layer_arrivals`.

What this does not model (docs/multicast.md, "Weights by network"): contention on the
receivers' downlinks or with serving traffic, including the activations' (their bytes are
counted, their time is a hop at full bandwidth); bandwidth sharing (overlapping multicasts
queue on a source's uplink instead); the runtime runs one iteration of an instance at a
time, so ZigZag's queue holds one batch (the live instance's current iteration) and two
batches never overlap across the pair (Fig. 15b's overlap of one request's layers with
another's on the partner); the KV cache the partner keeps for pulled layers (the twin
recomputes it at the end instead); a pipeline member's work for the other members' batches
is not charged to its node (balanced stages make the 2D pipeline's per-node work that of a
full instance, `pipeline_iteration_s` bounds the rest); the switch keeps requests on the
instance that admitted them (the runtime cannot move them), only the recompute cost follows
`switch_assignment`; shadow validation does not predict the partner's lent time or the
switch's recomputation.

Pure functions (`stop_the_world_s`, and mesh.policy.live_scaling's rules) have no clock;
the engines read time only from the event loop.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from mesh.engines.engine_api import Engine, StepResult
from mesh.engines.simulated import SimulatedEngine
from mesh.modelfiles.shape import layers_and_hidden
from mesh.perf.load_times import NET_BYTES_PER_S, PCIE_BYTES_PER_S, CostModel, block_sizes, schedule, weights_load_s
from mesh.policy.admission import InstancePlan
from mesh.policy.live_scaling import (
    LayerArrivals,
    Stage,
    ZigZagRequest,
    ZigZagState,
    activation_bytes,
    activation_s,
    block_layer_ends,
    execution_pipelines,
    pipeline_iteration_s,
    pull_helps,
    pulled_finish,
    recompute_tokens,
    solo_finish,
    source_pull,
    stage_ranges,
    switch_assignment,
    target_next,
)
from mesh.policy.multicast import chains, make_plan, sub_groups
from mesh.policy.param_pool import ParameterPool

if TYPE_CHECKING:
    from typing import Callable

    from mesh.control.fleet import Fleet

    EngineFactory = Callable[[InstancePlan, str, float, int], Engine]  # mesh.replay.simulator.EngineFactory

MODES: tuple[str, ...] = ("ssd", "host", "multicast", "multicast-live")
HOST_MEMORY_BYTES = 2 * 10**12  # per GPU node, for the pool's host copies (far more than needed)
_EPS = 1e-9


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


# --- pure models ---------------------------------------------------------------------------

def stop_the_world_s(config: WeightsConfig, weight_bytes: int, from_host: bool) -> float:
    """A load that serves only once every byte is in: from host memory over PCIe, or the SSD."""
    return weights_load_s(weight_bytes, config.pcie_bytes_per_s if from_host else config.ssd_bytes_per_s,
                          config.fixed_s)


def recompute_s(times, token_counts: Sequence[int], budget: int) -> float:
    """The KV recomputation of requests of `token_counts` tokens, as prefills of at most
    `budget` tokens each (lambdaScale 4.4)."""
    total, left = 0.0, sum(token_counts)
    while left > 0:
        chunk = min(left, budget)
        total += times.prefill_s(chunk)
        left -= chunk
    return total


# --- the replay side -----------------------------------------------------------------------

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


class WeightsEngine(SimulatedEngine):
    """A simulated engine whose load time (and, live, early iterations) the weights model
    decides when the load starts. Every engine of a run is one, so that a partner can lend
    its time to a live instance's iterations (`lent_until`)."""

    def __init__(self, model_weights: "WeightsModel", plan: InstancePlan, node_id: str, **kwargs) -> None:
        super().__init__(plan.model, plan.times, **kwargs)
        self._weights = model_weights
        self._plan = plan
        self._node_id = node_id
        self.role: LiveRole | None = None
        self.busy_until = -math.inf  # the end of its iteration in flight
        self.lent_until = -math.inf  # the end of the live instance's layers it runs (ZigZag)
        self.changed = asyncio.Event()  # set after each iteration (a partner may turn idle)
        self._tokens = 0  # tokens of the iteration about to run (its activation's rows)
        self._batch: list[str] = []
        self._pulled: set[str] = set()  # requests whose layers the partner ran (KV there)
        self._switched = False

    @property
    def layer_arrivals(self) -> LayerArrivals | None:
        """For shadow validation (mesh.node.memory_operations): a live instance's layers."""
        return self.role.arrivals if self.role is not None else None

    async def load(self) -> None:
        await asyncio.sleep(0)  # instances placed in the same instant join one multicast
        ready_at, role = self._weights.loading(self._plan, self._node_id, self)
        self.role = role
        delay = ready_at - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def unload(self) -> None:
        await super().unload()
        self._weights.engines.pop(self._plan.instance_id, None)

    # -- ZigZag's source side ------------------------------------------------------------
    def zigzag_idle(self) -> bool:
        """No request of its own waits for prefill (BlitzScale Fig. 16, line 5)."""
        return not self._pending

    def free_at(self, now: float) -> float:
        return max(now, self.busy_until, self.lent_until)

    # -- iterations ------------------------------------------------------------------------
    async def step(self) -> StepResult:
        loop = asyncio.get_running_loop()
        if self.lent_until > loop.time():  # running a live instance's layers first
            await asyncio.sleep(self.lent_until - loop.time())
        if self.role is not None and loop.time() >= self.role.until_s:
            await self._switch()
        try:
            return await super().step()
        finally:
            self.changed.set()
            self.changed = asyncio.Event()

    async def _prefill(self, take: int, switched: bool) -> StepResult:
        self._batch = list(self._pending)[:take]
        self._tokens = sum(self._pending[r][0] for r in self._batch)
        return await super()._prefill(take, switched)

    async def _decode(self, switched: bool) -> StepResult:
        self._batch = list(self._running)
        self._tokens = len(self._batch)
        return await super()._decode(switched)

    async def _pause(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        role = self.role
        if role is None or start >= role.until_s or start >= role.arrivals.full_s and role.pipeline is None:
            self.busy_until = start + seconds
            await asyncio.sleep(seconds)
            return
        hop = activation_s(role.hidden_size, max(1, self._tokens), role.link_bytes_per_s)
        if role.pipeline is not None:
            await self._pipelined(start, seconds, hop)
        else:
            await self._zigzag(start, seconds, hop)
        if loop.time() > start + seconds + hop + _EPS:  # it waited for layers
            self._weights.stats.waited.update(self._batch)

    async def _zigzag(self, start: float, work: float, hop: float) -> None:
        """One iteration as the target of ZigZag (module docstring)."""
        loop = asyncio.get_running_loop()
        role = self.role
        arr, layers = role.arrivals, role.arrivals.layers
        done, t = 0, start
        while done < layers:
            partner = self._weights.engines.get(role.partner or "")
            state = ZigZagState(layers, arr.held_at(t), (ZigZagRequest("iteration", 0, done),),
                                None, partner is not None and partner.zigzag_idle())
            pull = source_pull(state)
            if pull is not None and pull_helps(t, work, done, arr, partner.free_at(t), hop):
                end = pulled_finish(t, work, done, layers, partner.free_at(t), hop)
                partner.lent_until = max(partner.lent_until, end)
                stats = self._weights.stats
                stats.pulls += 1
                if done:
                    stats.activation_bytes += activation_bytes(role.hidden_size, max(1, self._tokens))
                self._pulled.update(self._batch)
                self.busy_until = end
                await asyncio.sleep(end - t)
                return
            if target_next(state) is not None:
                self.busy_until = t + work / layers
                await asyncio.sleep(work / layers)
                done += 1
            else:
                wait = arr.layer_at(done) - t
                if partner is None:
                    await asyncio.sleep(wait)
                else:
                    try:
                        await asyncio.wait_for(partner.changed.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
            t = loop.time()

    async def _pipelined(self, start: float, work: float, hop: float) -> None:
        """One iteration as a member of an execution pipeline (module docstring)."""
        role = self.role
        pipe = role.pipeline
        alone = solo_finish(start, work, role.arrivals)
        stages = pipe.stages(start)
        end = alone
        if stages is not None:
            engines = self._weights.engines
            batches = sum(1 for m in pipe.members if m in engines and engines[m].has_work())  # in flight
            through = start + pipeline_iteration_s(work, stages, hop, max(1, batches))
            if through < alone:
                end = through
                self._weights.stats.activation_bytes += (len(stages) - 1) * activation_bytes(
                    role.hidden_size, max(1, self._tokens))
        self.busy_until = end
        await asyncio.sleep(end - start)

    def _recompute_share(self) -> list[str]:
        """The requests whose KV cache this instance recomputes at the switch (4.4)."""
        pipe = self.role.pipeline
        if pipe is None:
            return [r for r in self._running if r in self._pulled]
        if pipe.assignment is None:
            engines = self._weights.engines
            reqs = [(rid, m) for m in pipe.members if m in engines for rid in engines[m]._running]
            live = [m for m in pipe.members if m in engines]
            pipe.assignment = switch_assignment(reqs, live) if live else {}
            self._weights.stats.switch_moves += sum(
                1 for m, rids in pipe.assignment.items() for rid in rids if rid not in engines[m]._running)
        return pipe.assignment.get(self._plan.instance_id, [])

    async def _switch(self) -> None:
        """Full instance from now: recompute the KV cache of its share (lambdaScale 4.4)."""
        share = self._recompute_share()
        engines = self._weights.engines
        tokens = []
        for rid in share:
            for eng in engines.values():
                entry = eng._running.get(rid)
                if entry is not None:
                    tokens.append(recompute_tokens(entry[0], eng._rounds - entry[2] + 1))
                    break
        self.role = None
        if tokens:
            self._weights.stats.recompute_tokens += sum(tokens)
            wait = recompute_s(self.times, tokens, self.prefill_token_budget)
            self.busy_until = asyncio.get_running_loop().time() + wait
            await asyncio.sleep(wait)


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


class WeightsModel:
    """Decides each new instance's cold start in a replay; one per run."""

    def __init__(self, config: WeightsConfig, cluster: "Fleet") -> None:
        self.config = config
        self.cluster = cluster
        self.pool = ParameterPool()
        for node in cluster.nodes:
            self.pool.add_node(node.node_id, HOST_MEMORY_BYTES)
        self.stats = WeightsStats()
        self.engines: dict[str, WeightsEngine] = {}  # instance id -> its engine, while loaded
        self._group: _Group | None = None
        self._by_instance: dict[str, _Group] = {}
        self._live: set[str] = set()  # instances serving before their last layer
        self._partners: dict[str, str] = {}  # live instance -> its partner instance
        self._cached: set[tuple[str, str]] = set()  # (model, node) host copies (mode host)
        self._uplink_free: dict[str, float] = {}  # node -> when its last planned send ends

    def factory(self) -> "EngineFactory":
        def make(plan: InstancePlan, kind: str, load_s: float, seed: int) -> Engine:
            node_id = plan.instance_id.rsplit("@", 1)[1].rsplit("#", 1)[0]
            self._join(plan, node_id)
            c = self.cluster.config
            engine = WeightsEngine(self, plan, node_id, kv_bytes_per_token=plan.kv_bytes_per_token,
                                   weight_bytes=plan.weight_bytes, context_window=plan.context_window,
                                   prefill_token_budget=plan.prefill_token_budget, max_batch=plan.max_batch,
                                   load_s=0.0, noise=c.noise, seed=seed)
            self.engines[plan.instance_id] = engine
            return engine
        return make

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

    def _count(self, how: str) -> None:
        self.stats.loads[how] = self.stats.loads.get(how, 0) + 1

    def loading(self, plan: InstancePlan, node_id: str, engine: WeightsEngine | None = None
                ) -> tuple[float, LiveRole | None]:
        """When the instance can serve, and how it serves before its last layer (None: it waits)."""
        now = self._now()
        mode = self.config.mode
        if engine is not None:
            self.engines[plan.instance_id] = engine
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
        layers, hidden = layers_and_hidden(model, cfg.layers, cfg.hidden_size)
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


@dataclass
class Engines:
    """For ReplayConfig.engines: called with each run's cluster, builds that run's
    WeightsModel (kept in `models`, for its statistics) and returns its engine factory."""

    config: WeightsConfig
    models: list[WeightsModel] = field(default_factory=list)

    def __call__(self, cluster: "Fleet") -> "EngineFactory":
        model = WeightsModel(self.config, cluster)
        self.models.append(model)
        return model.factory()
