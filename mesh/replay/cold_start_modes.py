"""Cold starts by where the weights come from, for replays (issue 7 item 6).

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
- `multicast-live`: `multicast` plus live scaling after BlitzScale 5.2 (cooperative
  execution with an overloaded instance). What is modelled, exactly: a new instance whose
  multicast starts while a fully loaded instance of the model (its partner) is free to
  cooperate - at most one new instance per loaded instance - starts serving as soon as
  block 0 arrives. While it holds the first fraction `f` of the layers (the longest prefix
  of blocks 0..l-1 it has, since layers run in order), the pair (partner + new instance)
  can serve `min(2, 1/(1-f))` instances' worth of requests with the best split of layers
  (the partner runs layers l..L of the new instance's requests), so the new instance adds
  `c(f) = min(1, f/(1-f))` of an instance: its iteration of full-speed duration W takes
  until the integral of c over time reaches W, re-evaluated at every block arrival. The
  partner's own iterations are not slowed (its lost capacity is already subtracted: c(f)
  is the pair's gain, not the new instance's own speed). Without a free partner the new
  instance waits for all its blocks (stop-the-world), as in `multicast`.

What this does not model (docs/multicast.md, "Weights by network"): contention on the
receivers' downlinks or with serving traffic; bandwidth sharing (overlapping multicasts
queue on a source's uplink instead); the
activation transfers between partner and new instance; ZigZag's request reordering
(ignored: the pair capacity used is its upper bound under the best split); lambdaScale's
execution pipelines across several receivers (4.3) and KV recomputation at mode switch
(4.4); the shadow validation of the policy still assumes the full-speed iteration times of
a live instance.

Pure functions (`stop_the_world_s`, `live_capacity`, `live_finish`, `prefix_fractions`)
have no clock; the engines read time only from the event loop.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from mesh.engines.engine_api import Engine
from mesh.engines.simulated import SimulatedEngine
from mesh.policy.batching import IterationTimes
from mesh.perf.load_times import NET_BYTES_PER_S, PCIE_BYTES_PER_S, CostModel, block_sizes, schedule, weights_load_s
from mesh.policy.multicast import make_plan
from mesh.policy.param_pool import ParameterPool
from mesh.node.runtime import InstancePlan

if TYPE_CHECKING:
    from typing import Callable

    from mesh.control.cluster_view import ClusterView

    EngineFactory = Callable[[InstancePlan, str, float, int], Engine]  # mesh.replay.simulator.EngineFactory

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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown weights mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.plan not in ("binomial", "chain", "naive"):
            raise ValueError(f"unknown plan {self.plan!r}: binomial, chain or naive")
        if not (self.ssd_bytes_per_s > 0 and self.pcie_bytes_per_s > 0 and self.net_bytes_per_s > 0
                and self.block_bytes > 0 and self.latency_s >= 0 and self.fixed_s >= 0):
            raise ValueError(f"bandwidths and block size must be > 0, latency and fixed time >= 0: {self}")

    def nominal_bytes_per_s(self) -> float:
        """The bandwidth of one uncontended cold start (for the policy's expected load time)."""
        return {"ssd": self.ssd_bytes_per_s, "host": self.pcie_bytes_per_s}.get(self.mode, self.net_bytes_per_s)


# --- pure models ---------------------------------------------------------------------------

def stop_the_world_s(config: WeightsConfig, weight_bytes: int, from_host: bool) -> float:
    """A load that serves only once every byte is in: from host memory over PCIe, or the SSD."""
    return weights_load_s(weight_bytes, config.pcie_bytes_per_s if from_host else config.ssd_bytes_per_s, config.fixed_s)


def live_capacity(fraction: float) -> float:
    """Instances' worth of serving a live instance adds to its partner when it holds the first
    `fraction` of the layers (BlitzScale 5.2, best split): min(1, f / (1 - f))."""
    if fraction >= 1.0:
        return 1.0
    if fraction <= 0.0:
        return 0.0
    return min(1.0, fraction / (1.0 - fraction))


def prefix_fractions(arrivals: Sequence[tuple[float, int]], sizes: Sequence[int]) -> list[tuple[float, float]]:
    """(time, fraction of the model's bytes in the longest held prefix of blocks), at each
    time the prefix grows; `arrivals` are (time, block)."""
    total = float(sum(sizes))
    held: set[int] = set()
    nxt, prefix = 0, 0
    out: list[tuple[float, float]] = []
    for t, block in sorted(arrivals):
        held.add(block)
        grew = False
        while nxt in held:
            prefix += sizes[nxt]
            nxt += 1
            grew = True
        if grew:
            if out and out[-1][0] == t:
                out[-1] = (t, prefix / total)
            else:
                out.append((t, prefix / total))
    return out


def live_finish(start: float, work_s: float, steps: Sequence[tuple[float, float]]) -> float:
    """When an iteration of full-speed duration `work_s`, started at `start`, ends on a live
    instance whose prefix fraction follows `steps` ((time, fraction), increasing): the time
    at which the integral of live_capacity(fraction(t)) from `start` reaches `work_s`."""
    if work_s <= 0:
        return start
    frac = 0.0
    for t, f in steps:
        if t <= start:
            frac = f
    t = start
    left = work_s
    for t_next, f_next in steps:
        if t_next <= t:
            continue
        rate = live_capacity(frac)
        if rate > 0 and left <= rate * (t_next - t):
            return t + left / rate
        left -= rate * (t_next - t)
        t, frac = t_next, f_next
    rate = live_capacity(frac)
    if rate <= 0:
        raise ValueError("a live iteration can never finish: no layer ever arrives")
    return t + left / rate


# --- the replay side -----------------------------------------------------------------------

class LiveTimes:
    """Iteration times of a live instance: the full-speed times, stretched by live_finish
    while its layers arrive (reads the event loop's clock when an iteration starts)."""

    def __init__(self, base: IterationTimes, steps: Sequence[tuple[float, float]]) -> None:
        self.base = base
        self.steps = list(steps)
        self.full_at = steps[-1][0] if steps else 0.0

    def _stretch(self, work: float) -> float:
        now = asyncio.get_running_loop().time()
        if now >= self.full_at:
            return work
        return live_finish(now, work, self.steps) - now

    def prefill_s(self, prompt_len: int) -> float:
        return self._stretch(self.base.prefill_s(prompt_len))

    def decode_s(self, batch: int, avg_context: float) -> float:
        return self._stretch(self.base.decode_s(batch, avg_context))


class WeightsEngine(SimulatedEngine):
    """A simulated engine whose load time (and, live, early iteration times) the weights
    model decides when the load starts."""

    def __init__(self, model_weights: "WeightsModel", plan: InstancePlan, node_id: str, **kwargs) -> None:
        super().__init__(plan.model, plan.times, **kwargs)
        self._weights = model_weights
        self._plan = plan
        self._node_id = node_id

    async def load(self) -> None:
        await asyncio.sleep(0)  # instances placed in the same instant join one multicast
        ready_at, times = self._weights.loading(self._plan, self._node_id)
        if times is not None:
            self.times = times
        delay = ready_at - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)


@dataclass
class _Group:
    model: str
    started: float
    targets: list[tuple[str, str, int]] = field(default_factory=list)  # (instance id, node, bytes)
    result: dict[str, tuple[float, list[tuple[float, float]] | None]] | None = None


@dataclass
class WeightsStats:
    loads: dict[str, int] = field(default_factory=dict)  # how -> count (ssd, host, multicast, live)
    multicasts: int = 0
    multicast_targets: int = 0
    load_s: list[float] = field(default_factory=list)  # per instance: load start -> serving


class WeightsModel:
    """Decides each new instance's cold start in a replay; one per run."""

    def __init__(self, config: WeightsConfig, cluster: "ClusterView") -> None:
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

    def factory(self) -> "EngineFactory":
        def make(plan: InstancePlan, kind: str, load_s: float, seed: int) -> Engine:
            node_id = plan.instance_id.rsplit("@", 1)[1].rsplit("#", 1)[0]
            self._join(plan, node_id)
            c = self.cluster.config
            return WeightsEngine(self, plan, node_id, kv_bytes_per_token=plan.kv_bytes_per_token,
                                 weight_bytes=plan.weight_bytes, context_window=plan.context_window,
                                 prefill_token_budget=plan.prefill_token_budget, max_batch=plan.max_batch,
                                 load_s=0.0, noise=c.noise, seed=seed)
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

    def loading(self, plan: InstancePlan, node_id: str) -> tuple[float, LiveTimes | None]:
        """When the instance can serve, and its live iteration times (None: full speed)."""
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
        ready, steps = g.result[plan.instance_id]
        self.stats.load_s.append(ready - now)
        return ready, (LiveTimes(plan.times, steps) if steps else None)

    def _multicast(self, g: _Group) -> dict[str, tuple[float, list[tuple[float, float]] | None]]:
        cfg = self.config
        model = g.model
        size = g.targets[0][2]
        if model not in self.pool.models():
            self.pool.register(model, size)
        hosts = set(self.pool.host_copies(model))
        now = g.started
        out: dict[str, tuple[float, list[tuple[float, float]] | None]] = {}
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
                arrivals[tt.transfer.receiver].append((tt.finish_s, tt.transfer.block))
        partners = [r.instance_id for r in full if r.instance_id not in self._partners.values()]
        for iid, node in by_net:
            done = now + cfg.fixed_s + sched.completion_s[node]
            if cfg.mode == "multicast-live" and partners:
                self._partners[iid] = partners.pop(0)
                steps = [(now + cfg.fixed_s + t, f) for t, f in prefix_fractions(arrivals[node], sizes)]
                self._count("live")
                self._live.add(iid)
                asyncio.get_running_loop().call_at(done, self._end_live, iid)
                out[iid] = (steps[0][0], steps)
            else:
                self._count("multicast")
                out[iid] = (done, None)
        return out

    def _end_live(self, iid: str) -> None:
        self._live.discard(iid)
        self._partners.pop(iid, None)


@dataclass
class Engines:
    """For ReplayConfig.engines: called with each run's cluster, builds that run's
    WeightsModel (kept in `models`, for its statistics) and returns its engine factory."""

    config: WeightsConfig
    models: list[WeightsModel] = field(default_factory=list)

    def __call__(self, cluster: "ClusterView") -> "EngineFactory":
        model = WeightsModel(self.config, cluster)
        self.models.append(model)
        return model.factory()
