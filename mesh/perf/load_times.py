"""How long a cold start takes: the one home of Mesh's load-time models.

A new instance's cold start, which shadow validation counts in the TTFT of the request that
would start it (LLM-Mesh 4, 5.3), is

    the wait for the loads under way on its node   (a node loads one instance at a time)
  + the weights transfer, if the node holds no copy (BlitzScale 5.1 / lambdaScale 4.2)
  + the load itself, weights in place               (measured: `ColdStartTable`; before that, the prior `ColdStart`)
  + the initial KV cache allocation                 (LLM-Mesh Figure 8: `kv_resize_s`)

This module holds each of these models once:
- memory operations (LLM-Mesh Figure 8): `kv_resize_s`, and the node memory of the paper's
  testbed (8.1) that the replay's and emulated nodes get;
- `weights_load_s`: a stop-the-world load, one pass over the weights at a bandwidth (the
  prior's loads and the replay's SSD and host-cache modes);
- `ColdStart`: the prior, and what a simulated or emulated engine's load takes;
- `ColdStartTable`: the loads measured per node, model and source, and a replay's cold
  starts from a service's export (`cold_start_times`);
- `CostModel`, `schedule`, `estimate`: how long a multicast plan takes (BlitzScale 5.1).

What decides stays in mesh.policy: the multicast plans (mesh.policy.multicast), the node
order that prefers a node holding a copy and the warm-up rule (mesh.policy.dispatch_rules). The
replay's simulated-time models (a multicast group's uplinks, live scaling after BlitzScale
5.2) are mesh.replay.cold_start_modes'. Which measure or prior a cluster's node gets is
Fleet.expected_load_s (mesh.control.fleet).

No I/O and no clock: times are arguments.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from mesh.policy.dispatch_rules import GPU
from mesh.policy.multicast import InvalidPlan, Plan, Transfer, make_plan

# --- memory operations (LLM-Mesh Figure 8, an A100) -----------------------------------------

GIB = 2**30
# A KV cache resize is proportional to the bytes it changes: 32 -> 64 GB in 1.9 s, 32 -> 16 GB
# in 0.3 s. The simulated engine charges it, and the cluster predicts an instance's cold start with it.
RESIZE_UP_S_PER_GIB = 1.9 / 32  # Figure 8: +32 GB in 1.9 s
RESIZE_DOWN_S_PER_GIB = 0.3 / 16  # Figure 8: -16 GB in 0.3 s

# Node memory (LLM-Mesh 8.1 testbed). GPU: the A100's 80 GB. CPU: 256 GB of DDR5 for
# instances (8 channels x 32 GB DIMMs, the usual 8 GB per core of a 32-core cloud node);
# the host copy of every model (8.1: all models cached in CPU memory) is not counted in it.
DEFAULT_GPU_MEMORY_BYTES = 80 * GIB
DEFAULT_CPU_MEMORY_BYTES = 256 * GIB


def kv_resize_s(from_bytes: int, to_bytes: int) -> float:
    """How long resizing a KV cache from `from_bytes` to `to_bytes` takes (Figure 8)."""
    delta = to_bytes - from_bytes
    per_gib = RESIZE_UP_S_PER_GIB if delta > 0 else RESIZE_DOWN_S_PER_GIB
    return abs(delta) / GIB * per_gib


# A load from the parked tier before any was measured: an adoption and the KV cache's resize
# (mesh bench coldstart's parked row: 0.6 ms to ready, median of 5; the resize allocates).
PARKED_PRIOR_S = 0.5


# --- weights ---------------------------------------------------------------------------------

# PCIe 4.0 x16 is 32 GB/s raw per direction, about 25 GB/s effective from pinned host memory
# (ServerlessLLM's loader, BlitzScale; the A100's host link, assumed: docs/roofline.md "Cold start").
PCIE_BYTES_PER_S = 25e9
# 200 Gbit/s RDMA per GPU (BlitzScale's setups: 100-200 Gbps).
NET_BYTES_PER_S = 200e9 / 8


def weights_load_s(weight_bytes: int, bytes_per_s: float, fixed_s: float = 0.0) -> float:
    """A stop-the-world load: a fixed start-up, then one pass over the weights at `bytes_per_s`
    (host to GPU over PCIe, a CPU node's pass over its memory, an SSD read)."""
    return fixed_s + weight_bytes / bytes_per_s


@dataclass(frozen=True, slots=True)
class ColdStart:
    """The prior: a cold start before any was measured (LLM-Mesh 4, 8.1: every model is
    cached in host memory).

    - GPU node: weights copied host -> GPU over PCIe from pinned host memory (ServerlessLLM's
      loader, BlitzScale), at PCIE_BYTES_PER_S by default. Callers that know the GPU pass its
      figure (mesh.perf.roofline.host_to_device_bytes_per_s: 55.3 GB/s measured on an H200,
      54.6 on an H100; pageable memory reaches 7-8 GB/s there, docs/roofline.md "Cold start").
    - CPU node: weights already in that node's memory; the OpenVINO instance still maps and
      lays them out, modelled as one pass over the weights at 50 GB/s (a quarter of the
      node's ~200 GB/s effective DDR5 bandwidth, docs/roofline.md): 0.27 s for Llama-2-7B.
    - plus a fixed engine start-up per instance (default 0; `mesh serve --cold-start-s`).
    - `measured`: loads measured elsewhere, by (model, node kind) (`cold_start_times`: a
      service's table, for a replay; `ANY_MODEL` for any model): they replace the model
      above for that model (the engine start-up and the initial KV cache included).
    - `net_bytes_per_s`: the weights transfer to a node that holds no copy, before one was
      measured (ColdStartTable.transfer_bytes_per_s).
    - `parked_s`: a load that adopts a parked worker (mesh.engines.parking), the fastest tier
      (ServerlessLLM 4.1); a replay's nodes park only where their ClusterConfig gives them a
      parking budget (the live replay's twin), and then load from it in this time.
    The initial KV cache allocation is added by the engine (resize time, LLM-Mesh Figure 8).
    A node loads one instance at a time (its weights cross one PCIe link or memory bus, and
    its engine's start-up runs on the node's cores): a load issued while others are under way
    there starts when they end (mesh.control.fleet.Fleet.load_wait_s). Live, on one core
    per node, two demo-model instances warmed up together on one node served their first
    tokens about 16 s after their first requests; one per node, after about 10 and 12 s.
    """

    pcie_bytes_per_s: float = PCIE_BYTES_PER_S
    cpu_load_bytes_per_s: float = 50e9
    fixed_s: float = 0.0
    measured: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (model, kind) -> load s
    net_bytes_per_s: float = NET_BYTES_PER_S
    parked_s: float = PARKED_PRIOR_S  # before any parked load was measured

    def __post_init__(self) -> None:
        if not (self.pcie_bytes_per_s > 0 and self.cpu_load_bytes_per_s > 0 and self.fixed_s >= 0
                and self.net_bytes_per_s > 0 and self.parked_s >= 0):
            raise ValueError(f"cold-start bandwidths must be positive and the fixed time >= 0, got {self}")

    def measured_s(self, model: str | None, node_kind: str) -> float | None:
        """A measured load of `model` (else of any model) on `node_kind` nodes, if given."""
        if not self.measured:
            return None
        found = self.measured.get((model, node_kind)) if model is not None else None
        return found if found is not None else self.measured.get((ANY_MODEL, node_kind))

    def load_s(self, weight_bytes: int, node_kind: str, model: str | None = None) -> float:
        """The load of the weights: measured, else a stop-the-world load at the node kind's bandwidth."""
        measured = self.measured_s(model, node_kind)
        if measured is not None:
            return measured
        bandwidth = self.pcie_bytes_per_s if node_kind == GPU else self.cpu_load_bytes_per_s
        return weights_load_s(weight_bytes, bandwidth, self.fixed_s)

    def instance_load_s(self, weight_bytes: int, node_kind: str, model: str | None, kv_bytes: int) -> float:
        """A new instance's load, weights in place, before the cluster measured one: measured
        elsewhere, else the load of its weights and the allocation of its initial KV cache of
        `kv_bytes` (LLM-Mesh Figure 8)."""
        measured = self.measured_s(model, node_kind)
        if measured is not None:
            return measured
        return self.load_s(weight_bytes, node_kind) + kv_resize_s(0, kv_bytes)

    def simulated_load_s(self, load_wait_s: float, weight_bytes: int, node_kind: str, model: str | None,
                         adopted_s: float | None = None) -> float:
        """How long a simulated (or emulated) engine's load takes: the wait for the loads under
        way on its node, then the load of its weights, or, where it adopts a parked worker
        (`adopted_s`: what is left of that worker's build, 0 once parked), that and `parked_s`.
        The node runtime allocates the initial KV cache after it (the engine's resize,
        `kv_resize_s`); `instance_load_s` predicts both."""
        if adopted_s is not None:
            return load_wait_s + adopted_s + self.parked_s
        return load_wait_s + self.load_s(weight_bytes, node_kind, model)

    def transfer_s(self, weight_bytes: int, bytes_per_s: float | None = None) -> float:
        """Moving the weights to a node without a copy, at `bytes_per_s` (measured) or the prior."""
        return weight_bytes / (bytes_per_s or self.net_bytes_per_s)


# --- measured loads -----------------------------------------------------------------------------
#
# The load itself is what the prior (`ColdStart`, `--cold-start-s`) guesses; `ColdStartTable`
# measures it. It keeps, per (node, model, source), the last few measured loads ("source":
# where the engine read the model from, e.g. OpenVINO's `gguf`, `prepared` (the node's IR
# cache) or `ir`), and predicts a node's next load of a model from the source of its latest
# load there (preparation only ever makes the next source faster, and one load is enough to
# learn it), else from the same model's latest loads on the node's peers (nodes of its kind),
# else nothing: the caller's prior. A load that adopted a parked worker (source `parked`,
# mesh.engines.parking: a built, warm pipeline kept after its instance stopped) predicts only
# the loads of a node that says it has the model parked now: a parked worker can be gone by
# the next load. Transfers are measured likewise, as bytes per second over every transfer to
# any node. A table can be written to JSON and read back (`to_dict`, `cold_start_times`), so
# that a replay can take its cold starts from what a service measured.

FORMAT = "mesh-cold-starts/1"
WINDOW = 5  # loads kept per (node, model, source): the median of the last few, robust to one slow load
RECORDS_KEPT = 1024  # the latest loads kept in order (views, export): a service that runs for months keeps no more
ANY_MODEL = "*"  # in a replay's table: the cold start of any model without its own entry
PARKED = "parked"  # the source of a load that adopted a parked worker (mesh.engines.parking)


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """One measured load: from its issue (the node's turn, weights in place) to ready."""

    node_id: str
    kind: str  # "cpu" | "gpu"
    model: str
    source: str
    load_s: float
    at_s: float  # when it ended (the caller's clock)


@dataclass
class ColdStartTable:
    """Measured loads per (node, model, source) and measured transfers (the comment above)."""

    window: int = WINDOW
    _loads: dict[tuple[str, str, str], deque[float]] = field(default_factory=dict)  # (node, model, source)
    _latest: dict[tuple[str, str], LoadRecord] = field(default_factory=dict)  # (node, model) -> latest load
    _transfers: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # bytes/s
    records: deque[LoadRecord] = field(default_factory=lambda: deque(maxlen=RECORDS_KEPT))  # the latest loads, in order

    def record(self, rec: LoadRecord) -> None:
        if not rec.load_s >= 0:
            raise ValueError(f"a load takes >= 0 s, got {rec.load_s}")
        self._loads.setdefault((rec.node_id, rec.model, rec.source), deque(maxlen=self.window)).append(rec.load_s)
        if rec.source != PARKED:
            self._latest[(rec.node_id, rec.model)] = rec
        self.records.append(rec)

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        """A model's weights reached a node that held no copy: `nbytes` in `seconds`."""
        if nbytes > 0 and seconds > 0:
            self._transfers.append(nbytes / seconds)

    def node_load_s(self, node_id: str, model: str) -> float | None:
        """The node's next load of `model`: the median of its recent loads from the source
        of its latest load (parked ones aside); None if it never loaded the model."""
        latest = self._latest.get((node_id, model))
        if latest is None:
            return None
        return statistics.median(self._loads[(node_id, model, latest.source)])

    def expected_load_s(self, node_id: str, model: str, peers: Iterable[str] = (),
                        parked: bool = False) -> float | None:
        """The node's own measure, else the median over `peers` (nodes of its kind) that
        loaded the model; from the parked tier first if the node has the model `parked`
        (`PARKED_PRIOR_S` before any parked load was measured); None: never loaded on any of
        them (the caller's prior)."""
        if parked:  # a parked worker waits there (parked ahead: mesh.node.park_ahead); its build is done
            measured = self._median(self._parked_s, node_id, model, peers)
            return PARKED_PRIOR_S if measured is None else measured
        return self._median(self.node_load_s, node_id, model, peers)

    @staticmethod
    def _median(measure: Callable[[str, str], float | None], node_id: str, model: str,
                peers: Iterable[str]) -> float | None:
        """`measure` of the node, else the median of its peers' that have one."""
        own = measure(node_id, model)
        if own is not None:
            return own
        theirs = [s for s in (measure(p, model) for p in peers if p != node_id) if s is not None]
        return statistics.median(theirs) if theirs else None

    def _parked_s(self, node_id: str, model: str) -> float | None:
        """The median of the node's recent loads of `model` that adopted a parked worker."""
        loads = self._loads.get((node_id, model, PARKED))
        return statistics.median(loads) if loads else None

    def transfer_bytes_per_s(self) -> float | None:
        """The median of the recent transfers' throughput; None before the first."""
        return statistics.median(self._transfers) if self._transfers else None

    def forget_model(self, model: str) -> None:
        """A deleted model's loads leave the table."""
        for key in [k for k in self._loads if k[1] == model]:
            del self._loads[key]
        for key in [k for k in self._latest if k[1] == model]:
            del self._latest[key]
        kept = [r for r in self.records if r.model != model]
        self.records.clear()
        self.records.extend(kept)

    def forget_node(self, node_id: str) -> None:
        """A departed node's loads leave the per-node medians (`records`, the recent loads
        summed per kind, keeps them until they age out)."""
        for key in [k for k in self._loads if k[0] == node_id]:
            del self._loads[key]
        for key in [k for k in self._latest if k[0] == node_id]:
            del self._latest[key]

    # -- export and replays ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """{format, loads: [per (node, model, source): kind, n, median_s, last_s], transfer_bytes_per_s}."""
        by_key: dict[tuple[str, str, str], LoadRecord] = {}
        for rec in self.records:
            by_key[(rec.node_id, rec.model, rec.source)] = rec
        loads = [{"node": n, "kind": r.kind, "model": m, "source": s, "n": len(self._loads[(n, m, s)]),
                  "median_s": statistics.median(self._loads[(n, m, s)]), "last_s": r.load_s}
                 for (n, m, s), r in sorted(by_key.items()) if (n, m, s) in self._loads]
        return {"format": FORMAT, "loads": loads, "transfer_bytes_per_s": self.transfer_bytes_per_s()}


def cold_start_times(table: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """A replay's cold starts from an exported table (`ColdStartTable.to_dict`): per (model,
    node kind) the median of its nodes' medians, and per kind under `ANY_MODEL` the median
    over all its models (for a replay whose models the service never loaded). Loads from the
    parked tier are left out: a replay's nodes park nothing (mesh.engines.parking)."""
    if table.get("format") != FORMAT:
        raise ValueError(f"not a cold-start table: format {table.get('format')!r}, expected {FORMAT!r}")
    by: dict[tuple[str, str], list[float]] = {}
    for row in table.get("loads") or ():
        if row.get("source") == PARKED:
            continue
        try:
            key, value = (str(row["model"]), str(row["kind"])), float(row["median_s"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad cold-start row {row!r}: {exc}") from None
        if not value >= 0:
            raise ValueError(f"bad cold-start row {row!r}: a load takes >= 0 s")
        by.setdefault(key, []).append(value)
    out = {key: statistics.median(v) for key, v in by.items()}
    for kind in {k for _, k in out}:
        named = [v for (m, k), v in out.items() if k == kind and m != ANY_MODEL]
        if named and (ANY_MODEL, kind) not in out:  # a table's own '*' row stands
            out[(ANY_MODEL, kind)] = statistics.median(named)
    return out


# --- multicast times (BlitzScale 5.1) ---------------------------------------------------------
#
# A transfer of `nbytes` from i to j takes latency + nbytes / min(BW_i, BW_j) (BlitzScale 5.1
# models a link between two nodes of a leaf as min(BW_i, BW_j)). `schedule` runs a plan
# (mesh.policy.multicast) self-timed, as the transport does: a transfer starts as soon as the
# sender holds the block, its previous send is done and the receiver's previous receive is
# done. With equal bandwidths and no latency this is exactly rounds x block time.

@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-node link bandwidth (bytes/s) and per-transfer latency. A link between i and j
    runs at min(BW_i, BW_j) (BlitzScale 5.1). `node_bandwidth` overrides `bandwidth` per node."""

    block_bytes: int
    bandwidth: float
    latency_s: float = 0.0
    node_bandwidth: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_bytes <= 0 or not self.bandwidth > 0 or self.latency_s < 0:
            raise ValueError(f"cost model needs block_bytes > 0, bandwidth > 0, latency >= 0: {self}")
        if any(not v > 0 for v in self.node_bandwidth.values()):
            raise ValueError("every node bandwidth must be > 0")

    def link(self, sender: str, receiver: str) -> float:
        return min(self.node_bandwidth.get(sender, self.bandwidth), self.node_bandwidth.get(receiver, self.bandwidth))

    def transfer_s(self, sender: str, receiver: str, nbytes: int | None = None) -> float:
        return self.latency_s + (self.block_bytes if nbytes is None else nbytes) / self.link(sender, receiver)

    @property
    def block_s(self) -> float:
        """One block over a default link."""
        return self.latency_s + self.block_bytes / self.bandwidth


#: Unit costs: times come out in block times.
BLOCK_TIME = CostModel(block_bytes=1, bandwidth=1.0)


@dataclass(frozen=True, slots=True)
class TimedTransfer:
    transfer: Transfer
    start_s: float
    finish_s: float


@dataclass(frozen=True)
class Schedule:
    transfers: tuple[TimedTransfer, ...]
    completion_s: Mapping[str, float]  # per target: when it holds every block

    @property
    def total_s(self) -> float:
        return max(self.completion_s.values(), default=0.0)


def schedule(plan: Plan, cost: CostModel = BLOCK_TIME, block_sizes: Sequence[int] | None = None) -> Schedule:
    """Self-timed execution of `plan` (as the transport runs it): each transfer starts when
    its sender holds the block and has finished its previous send, and its receiver has
    finished its previous receive. `block_sizes` (bytes per block) defaults to
    cost.block_bytes each."""
    if block_sizes is not None and len(block_sizes) != plan.blocks:
        raise ValueError(f"{len(block_sizes)} block sizes for a plan of {plan.blocks} blocks")
    send_free: dict[str, float] = defaultdict(float)
    recv_free: dict[str, float] = defaultdict(float)
    held: dict[tuple[str, int], float] = {(n, b): 0.0 for n, h in plan.holdings.items() for b in h}
    timed = []
    done: dict[str, float] = {t: 0.0 for t in plan.targets}
    for t in sorted(plan.transfers):
        ready = held.get((t.sender, t.block))
        if ready is None:
            raise InvalidPlan(f"plan {plan.name!r}: {t.sender} sends block {t.block} it never receives")
        start = max(ready, send_free[t.sender], recv_free[t.receiver])
        finish = start + cost.transfer_s(t.sender, t.receiver, None if block_sizes is None else block_sizes[t.block])
        send_free[t.sender] = recv_free[t.receiver] = finish
        held[(t.receiver, t.block)] = min(finish, held.get((t.receiver, t.block), math.inf))
        if t.receiver in done:
            done[t.receiver] = max(done[t.receiver], finish)
        timed.append(TimedTransfer(t, start, finish))
    return Schedule(tuple(timed), done)


def block_sizes(model_bytes: int, block_bytes: int) -> list[int]:
    """A model of `model_bytes` cut into blocks of `block_bytes`, the last one the rest."""
    nblocks = -(-model_bytes // block_bytes)
    return [block_bytes] * (nblocks - 1) + [model_bytes - block_bytes * (nblocks - 1)]


def estimate(name: str, model_bytes: int, targets: int, cost: CostModel, sources: int = 1) -> Schedule:
    """Predicted multicast of a model of `model_bytes` to `targets` new nodes from `sources`
    holders, in blocks of cost.block_bytes (for replays: cold starts by network)."""
    if model_bytes <= 0 or targets < 0 or sources < 1:
        raise ValueError("need model_bytes > 0, targets >= 0, sources >= 1")
    if targets == 0:
        return Schedule((), {})
    sizes = block_sizes(model_bytes, cost.block_bytes)
    plan = make_plan(name, [f"s{i}" for i in range(sources)], [f"t{i}" for i in range(targets)], len(sizes))
    return schedule(plan, cost, sizes)
