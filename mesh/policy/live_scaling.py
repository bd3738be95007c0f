"""Live scaling: a model that is still loading already serves (BlitzScale 5.2, lambdaScale 4.3-4.4).

Pure rules, no I/O and no clock: every function takes times and state and returns a decision.

- Layers held (docs/multicast.md, "Weights by network"): blocks travel in layer order, so a
  receiver can run the layers of the longest prefix of blocks it holds; a block that arrives
  out of order counts only once the ones before it are in (`prefix_layers`, `LayerArrivals`).
- ZigZag scheduling, the ILP-free version (BlitzScale 5.2, Figure 16): the new (target)
  instance keeps a priority queue of requests, FCFS with the requests whose next layer is
  loaded first (`zigzag_order`); it forwards one layer of the front request (`target_next`);
  the overloaded full (source) instance pulls the earliest request with its activation and
  runs all its remaining layers, only when it has no pending work of its own (`source_pull`).
  A request's pipeline split is (T, S): T layers on the target, S = L - T on the source.
- Partial-instance times (BlitzScale 5.2, LLM-Mesh 5.3 for the prediction): a live instance
  holding a fraction f of the layers runs its share of an iteration in f x the full time, the
  partner (1 - f) x, plus an activation transfer of hidden x tokens x dtype bytes per hop.
  `solo_finish` is the iteration run by the target alone as its layers arrive (what shadow
  validation predicts: the partner's help is never promised).
- Execution pipelines (lambdaScale 4.3, Algorithm 2) from the k-way sub-groups
  (mesh.policy.multicast.sub_groups, Algorithm 1), the contiguous layer range each stage runs
  given the blocks it holds (`stage_ranges`), and the mode switch (4.4): a pipeline's
  incomplete requests are spread evenly over its nodes, each recomputing its KV cache from
  the prompt and the tokens so far, as a prefill of that length (`switch_assignment`).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Sequence

from mesh.policy.layer_prefix import contiguous_blocks

DTYPE_BYTES = 2  # 16-bit activations


# --- layers held ---------------------------------------------------------------------------

def block_layer_ends(block_bytes: Sequence[int], layers: int) -> tuple[int, ...]:
    """The layer each block ends on (exclusive), for blocks cut from a model of `layers`
    equal layers by bytes: a block holds the layers that end inside the bytes up to its end
    (the last block ends on the last layer)."""
    if layers < 1 or not block_bytes or any(b <= 0 for b in block_bytes):
        raise ValueError("need layers >= 1 and blocks of > 0 bytes")
    total = sum(block_bytes)
    ends, cum = [], 0
    for b in block_bytes:
        cum += b
        ends.append(layers * cum // total)
    ends[-1] = layers
    return tuple(ends)


def prefix_layers(held: Collection[int], layer_ends: Sequence[int]) -> int:
    """Layers a receiver can run, for blocks that end on the layers `layer_ends`: those of
    its gap-free prefix of blocks (mesh.policy.layer_prefix.contiguous_blocks, the one rule
    for real files and replays alike)."""
    n = contiguous_blocks(held, len(layer_ends))
    return layer_ends[n - 1] if n else 0


def held_runs(held: Collection[int], layer_ends: Sequence[int]) -> list[tuple[int, int]]:
    """The layer ranges [start, end) of each maximal run of consecutive held blocks."""
    runs: list[tuple[int, int]] = []
    b = 0
    while b < len(layer_ends):
        if b in held:
            first = b
            while b in held and b < len(layer_ends):
                b += 1
            start = layer_ends[first - 1] if first else 0
            if layer_ends[b - 1] > start:
                runs.append((start, layer_ends[b - 1]))
        else:
            b += 1
    return runs


@dataclass(frozen=True)
class LayerArrivals:
    """A receiver's usable prefix over time: from `steps[i][0]` on it runs `steps[i][1]`
    layers (both increasing) of a model of `layers`."""

    layers: int
    steps: tuple[tuple[float, int], ...]

    @classmethod
    def from_blocks(cls, arrivals: Sequence[tuple[float, int]], layer_ends: Sequence[int]) -> "LayerArrivals":
        """From (time, block) arrivals: the prefix grows when the next block in order is in."""
        held: set[int] = set()
        steps: list[tuple[float, int]] = []
        for t, block in sorted(arrivals):
            held.add(block)
            n = prefix_layers(held, layer_ends)
            if n > (steps[-1][1] if steps else 0):
                if steps and steps[-1][0] == t:
                    steps[-1] = (t, n)
                else:
                    steps.append((t, n))
        return cls(layer_ends[-1], tuple(steps))

    def held_at(self, t: float) -> int:
        """Layers usable at time `t`."""
        i = bisect.bisect_right([s[0] for s in self.steps], t)
        return self.steps[i - 1][1] if i else 0

    def layer_at(self, layer: int) -> float:
        """When 0-based `layer` becomes usable (inf: never)."""
        for t, n in self.steps:
            if n > layer:
                return t
        return math.inf

    @property
    def first_s(self) -> float:
        """When the first layer is usable."""
        return self.layer_at(0)

    @property
    def full_s(self) -> float:
        """When every layer is usable."""
        return self.layer_at(self.layers - 1)


def solo_finish(start: float, work_s: float, arrivals: LayerArrivals, from_layer: int = 0) -> float:
    """When an iteration of full-instance time `work_s`, started at `start` with its layers
    before `from_layer` done, ends on the target alone: each layer takes work_s / L and runs
    once it is usable (ZigZag without the source's help)."""
    per = work_s / arrivals.layers
    t = start
    for layer in range(from_layer, arrivals.layers):
        t = max(t, arrivals.layer_at(layer)) + per
    return t


def late_for_layers(waited: bool, completed: bool, slo_met: bool, served_late: bool) -> bool:
    """A request served late because of missing layers, what shadow validation must never
    admit: completed past its SLO, though placed to be on time (not served late on
    purpose), with an iteration that waited for layers on a live instance."""
    return waited and completed and not slo_met and not served_late


# --- partial-instance times ------------------------------------------------------------------

def activation_bytes(hidden_size: int, tokens: int, dtype_bytes: int = DTYPE_BYTES) -> int:
    """The hidden states one hop carries: hidden x tokens x dtype bytes."""
    return hidden_size * tokens * dtype_bytes


def activation_s(hidden_size: int, tokens: int, bytes_per_s: float, dtype_bytes: int = DTYPE_BYTES) -> float:
    """One hop's activation transfer over a link of `bytes_per_s`."""
    return activation_bytes(hidden_size, tokens, dtype_bytes) / bytes_per_s


def layer_range_s(work_s: float, start: int, end: int, layers: int) -> float:
    """An iteration over layers [start, end) of `layers`: the full time x the fraction."""
    if not 0 <= start <= end <= layers:
        raise ValueError(f"bad layer range [{start}, {end}) of {layers}")
    return work_s * (end - start) / layers


def pipeline_split(target_layers: int, layers: int) -> tuple[int, int]:
    """(T, S): T layers on the target, S = L - T on the source (BlitzScale 5.2, C1)."""
    if not 0 <= target_layers <= layers:
        raise ValueError(f"T = {target_layers} outside [0, {layers}]")
    return target_layers, layers - target_layers


def best_effort_layers(loaded: int, layers: int) -> int:
    """BlitzScale 5.2's baseline: as many layers on the target as are loaded, at most half."""
    return min(loaded, layers // 2)


# --- ZigZag, ILP-free (BlitzScale 5.2, Figure 16) ---------------------------------------------

@dataclass(frozen=True)
class ZigZagRequest:
    request_id: str
    arrival: int  # FCFS order
    next_layer: int = 0  # layers [0, next_layer) ran on the target


@dataclass(frozen=True)
class ZigZagState:
    layers: int  # L
    loaded: int  # the target's usable prefix
    queue: tuple[ZigZagRequest, ...]  # requests not yet pulled by the source nor finished
    target_running: str | None = None  # the request whose layer the target runs now
    source_idle: bool = False  # the source has no pending work of its own


@dataclass(frozen=True)
class TargetLayer:
    request_id: str
    layer: int  # 0-based layer the target forwards next


@dataclass(frozen=True)
class SourcePull:
    request_id: str
    from_layer: int  # the source runs [from_layer, L) with the request's activation

    def split(self, layers: int) -> tuple[int, int]:
        return pipeline_split(self.from_layer, layers)


def runnable(req: ZigZagRequest, loaded: int) -> bool:
    """The request's next layer is loaded on the target."""
    return req.next_layer < loaded


def zigzag_order(queue: Sequence[ZigZagRequest], loaded: int) -> list[ZigZagRequest]:
    """The target's priority queue: requests with their next layer loaded first, FCFS inside."""
    return sorted(queue, key=lambda r: (not runnable(r, loaded), r.arrival))


def target_next(state: ZigZagState) -> TargetLayer | None:
    """The layer the target forwards next: one layer of the front request, if it can
    advance (Figure 16, lines 2-3); None while nothing it holds is left to run."""
    if state.target_running is not None:
        return None
    for r in zigzag_order(state.queue, state.loaded):
        if runnable(r, state.loaded) and r.next_layer < state.layers:
            return TargetLayer(r.request_id, r.next_layer)
        break
    return None


def source_pull(state: ZigZagState) -> SourcePull | None:
    """The request the source pulls (Figure 16, lines 5-7): the earliest one the target is
    not running, only when the source has no pending work of its own."""
    if not state.source_idle:
        return None
    for r in sorted(state.queue, key=lambda r: r.arrival):
        if r.request_id != state.target_running:
            return SourcePull(r.request_id, r.next_layer)
    return None


def left_to_target(req: ZigZagRequest, loaded: int) -> bool:
    """A request no layer of which ran yet, whose first layer the target holds, is the
    target's to start: the source pulling it would run the whole model while the new
    instance's layers stood idle. Mesh's rule beside Figure 16 (the paper's source pulls the
    earliest request; with a source that is idle only between its own streams, that left
    the new instance nothing to run)."""
    return req.next_layer == 0 and loaded > 0


def pulled_finish(now: float, work_s: float, from_layer: int, layers: int, source_free_s: float,
                  transfer_s: float) -> float:
    """When a pulled request's remaining layers end on the source: once the source is free,
    its activation crosses (none if from_layer is 0) and the source runs [from_layer, L)."""
    hop = transfer_s if from_layer > 0 else 0.0
    return max(now, source_free_s) + hop + layer_range_s(work_s, from_layer, layers, layers)


def pull_helps(now: float, work_s: float, from_layer: int, arrivals: LayerArrivals, source_free_s: float,
               transfer_s: float) -> bool:
    """Mesh's guard on a pull: it must end no later than the target alone would (so a
    prediction of the target alone, `solo_finish`, bounds what the pair serves)."""
    return lend_helps(now, work_s, from_layer, arrivals.layers, source_free_s, transfer_s,
                      solo_finish(now, work_s, arrivals, from_layer))


def lend_helps(now: float, work_s: float, from_layer: int, layers: int, source_free_s: float, transfer_s: float,
               alone_end_s: float) -> bool:
    """`pull_helps` where the source decides (its agent knows when it is free, the target
    when it would end alone, `alone_end_s`): the pull ends no later than that."""
    return pulled_finish(now, work_s, from_layer, layers, source_free_s, transfer_s) <= alone_end_s


# --- execution pipelines (lambdaScale 4.3-4.4) --------------------------------------------------

def execution_pipelines(groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """lambdaScale Algorithm 2: while several sub-groups have unassigned nodes, take the next
    node of each into a pipeline (as many pipelines as the smallest has nodes); the nodes
    of a last single sub-group form one pipeline."""
    left = [list(g) for g in groups if g]
    out: list[list[str]] = []
    while left:
        if len(left) == 1:
            out.append(left[0])
            break
        a = min(len(g) for g in left)
        for t in range(a):
            out.append([g[t] for g in left])
        left = [g[a:] for g in left if len(g) > a]
    return out


@dataclass(frozen=True)
class Stage:
    node: str
    start: int  # first layer
    end: int  # one past the last layer


def stage_ranges(nodes: Sequence[str], holdings: Mapping[str, Collection[int]],
                 layer_ends: Sequence[int]) -> list[Stage] | None:
    """The stages of a pipeline over `nodes`: contiguous layer ranges covering [0, L), each
    run by a node that holds the blocks of its range, fewest stages (greedy: from each layer,
    the node whose held run reaches furthest; ties to the earlier node). None: the nodes
    together lack a layer."""
    layers = layer_ends[-1]
    runs = {n: held_runs(holdings.get(n, ()), layer_ends) for n in nodes}
    stages: list[Stage] = []
    at = 0
    while at < layers:
        best: tuple[int, str] | None = None
        for n in nodes:
            for s, e in runs[n]:
                if s <= at < e and (best is None or e > best[0]):
                    best = (e, n)
        if best is None:
            return None
        stages.append(Stage(best[1], at, best[0]))
        at = best[0]
    return stages


def pipeline_iteration_s(work_s: float, stages: Sequence[Stage], transfer_s: float, batches: int) -> float:
    """One iteration of full-instance time `work_s` through a pipeline (2D pipelining,
    lambdaScale 4.3, Fig. 6a): its stages in turn with one activation hop between each, and
    no faster than the slowest stage allows with `batches` batches in flight."""
    layers = stages[-1].end
    latency = work_s + (len(stages) - 1) * transfer_s
    slowest = max(layer_range_s(work_s, s.start, s.end, layers) for s in stages)
    return max(latency, batches * slowest)


def switch_assignment(requests: Sequence[tuple[str, str]], nodes: Sequence[str]) -> dict[str, list[str]]:
    """lambdaScale 4.4: a pipeline's incomplete requests ((request, node it was admitted
    on), in order) spread evenly over its `nodes` (counts differ by at most one); a request
    stays on its node while that node is under its share."""
    n = len(nodes)
    if not n:
        raise ValueError("a pipeline has at least one node")
    share = {node: len(requests) // n + (1 if i < len(requests) % n else 0) for i, node in enumerate(nodes)}
    out: dict[str, list[str]] = {node: [] for node in nodes}
    moved: list[str] = []
    for rid, home in requests:
        if home in out and len(out[home]) < share[home]:
            out[home].append(rid)
        else:
            moved.append(rid)
    for rid in moved:
        node = next(nd for nd in nodes if len(out[nd]) < share[nd])
        out[node].append(rid)
    return out


def recompute_tokens(prompt_len: int, generated: int) -> int:
    """The prefill a request's KV recomputation at the switch costs: prompt + tokens so far."""
    return prompt_len + generated


def recompute_s(prefill_s: Callable[[int], float], token_counts: Sequence[int], budget: int) -> float:
    """The KV recomputation of requests of `token_counts` tokens (`recompute_tokens`), as
    prefills of at most `budget` tokens each, each taking `prefill_s(tokens)` (lambdaScale 4.4)."""
    total, left = 0.0, sum(token_counts)
    while left > 0:
        chunk = min(left, budget)
        total += prefill_s(chunk)
        left -= chunk
    return total
