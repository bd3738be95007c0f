"""Multicast plans for model weights (BlitzScale 5.1, lambdaScale 4.2).

A model is cut into `b` blocks. A plan is a list of block transfers, each in a round:
`Transfer(round, sender, receiver, block)`. Plans are pure data, built by pure functions:

- `naive`: each source sends the whole model to its targets one after the other (N*b rounds
  with one source): the baseline.
- `chain`: serial forwarding chains S -> T1 -> T2 -> ... (BlitzScale 5.1, Figure 11 on a
  flat network: one leaf, no NVLink groups). Targets are ordered by decreasing link
  bandwidth; with s sources the targets are dealt into s chains, the fastest source taking
  the fastest target. A forwarder passes block i on in the round after it receives it, so a
  chain of L targets takes b + L - 1 rounds.
- `binomial`: the binomial pipeline (lambdaScale 4.2, after Ganesan and Seshadri): nodes on
  a hypercube, in round t each node exchanges with its neighbour across dimension t mod d,
  the root injecting block t in round t and every other node sending the newest block its
  neighbour lacks. With k sources the receivers split into k sub-groups, one per source,
  each sending the blocks in its own k-way circularly shifted order (Algorithm 1), so the
  sub-groups together hold the whole model after about b/k rounds (execution pipelines, 4.3).
- `repair`: a greedy plan from arbitrary holdings, rarest block first; the transport uses it
  to re-plan around a failed node.

Round counts (the paper's N counts nodes *including* the source: "1 -> N ... takes
b + ceil(log N) - 1 steps" for N - 1 destinations). With R receivers and one source we
have n = R + 1 nodes, and b + ceil(log2 n) - 1 is also the lower bound for one-port
broadcast (the source sends one block a round, so the last block leaves it in round b - 1
at the earliest; its holders then at most double each round). The binomial plan reaches it exactly when n is a power of
two (the hypercube) and when n = 2^d + 1 (a relay feeding a hypercube of 2^d); for other n the hypercube has holes
that a greedy fill covers, a few rounds above the bound (measured in the tests).

Port model: full-duplex one-port. In one round a node sends at most one block and receives
at most one block (it may do both, as the pairs of the binomial pipeline do). `validate`
checks this, that a node only sends blocks it holds at the start of the round, that nobody
receives a block twice, and that every target ends with every block.

How long a plan takes (the cost model, BlitzScale 5.1, and `schedule`, the plan run
self-timed as the transport runs it) is mesh.perf.load_times'.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence


class InvalidPlan(ValueError):
    """A plan breaks a rule (holding, one-port, completeness), or cannot be built."""


@dataclass(frozen=True, slots=True, order=True)
class Transfer:
    """`sender` sends `block` to `receiver` in `round` (0-based)."""

    round: int
    sender: str
    receiver: str
    block: int


@dataclass(frozen=True)
class Plan:
    """Block transfers from the nodes in `holdings` to `targets`.

    `holdings` is what each node holds before round 0: sources hold every block, targets
    usually none (a repair plan starts from partial holdings)."""

    name: str
    blocks: int
    holdings: Mapping[str, frozenset[int]]
    targets: tuple[str, ...]
    transfers: tuple[Transfer, ...]

    @property
    def sources(self) -> tuple[str, ...]:
        """Nodes that hold the whole model before round 0."""
        return tuple(n for n, h in self.holdings.items() if len(h) == self.blocks and n not in self.targets)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*self.holdings, *self.targets]))

    @property
    def rounds(self) -> int:
        return max((t.round for t in self.transfers), default=-1) + 1

    def by_round(self) -> list[list[Transfer]]:
        out: list[list[Transfer]] = [[] for _ in range(self.rounds)]
        for t in self.transfers:
            out[t.round].append(t)
        return out

    def sends(self, node: str) -> list[Transfer]:
        """The node's sends, in the order it performs them."""
        return sorted((t for t in self.transfers if t.sender == node), key=lambda t: (t.round, t.receiver))

    def receives(self, node: str) -> list[Transfer]:
        return sorted((t for t in self.transfers if t.receiver == node), key=lambda t: (t.round, t.sender))

    def completion_rounds(self) -> dict[str, int]:
        """Per target: the number of rounds after which it holds every block."""
        last: dict[str, int] = {t: 0 for t in self.targets}
        for t in self.transfers:
            if t.receiver in last:
                last[t.receiver] = max(last[t.receiver], t.round + 1)
        return last

    def to_dict(self) -> dict:
        """JSON-ready form (the transport sends plans to node agents)."""
        return {
            "name": self.name,
            "blocks": self.blocks,
            "holdings": {n: sorted(h) for n, h in self.holdings.items()},
            "targets": list(self.targets),
            "transfers": [[t.round, t.sender, t.receiver, t.block] for t in self.transfers],
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "Plan":
        return cls(
            name=str(d["name"]),
            blocks=int(d["blocks"]),
            holdings={str(n): frozenset(int(b) for b in h) for n, h in d["holdings"].items()},
            targets=tuple(str(t) for t in d["targets"]),
            transfers=tuple(Transfer(int(r), str(s), str(t), int(b)) for r, s, t, b in d["transfers"]),
        )


def validate(plan: Plan) -> None:
    """Raise InvalidPlan, naming the first broken rule, unless the plan is valid under the
    full-duplex one-port model."""
    if plan.blocks < 1:
        raise InvalidPlan(f"plan {plan.name!r}: needs at least one block, got {plan.blocks}")
    nodes = set(plan.nodes)
    have = {n: set(plan.holdings.get(n, ())) for n in nodes}
    for n, h in have.items():
        bad = [b for b in h if not 0 <= b < plan.blocks]
        if bad:
            raise InvalidPlan(f"plan {plan.name!r}: node {n!r} holds unknown block {bad[0]}")
    for r, transfers in enumerate(plan.by_round()):
        senders: set[str] = set()
        receivers: set[str] = set()
        arriving: list[Transfer] = []
        for t in transfers:
            where = f"plan {plan.name!r}, round {r}: {t.sender} -> {t.receiver} block {t.block}"
            if t.sender not in nodes or t.receiver not in nodes:
                raise InvalidPlan(f"{where}: unknown node")
            if t.sender == t.receiver:
                raise InvalidPlan(f"{where}: a node sends to itself")
            if not 0 <= t.block < plan.blocks:
                raise InvalidPlan(f"{where}: no such block (the model has {plan.blocks})")
            if t.block not in have[t.sender]:
                raise InvalidPlan(f"{where}: the sender does not hold the block yet")
            if t.block in have[t.receiver]:
                raise InvalidPlan(f"{where}: the receiver already holds the block")
            if t.sender in senders:
                raise InvalidPlan(f"{where}: the sender sends twice in one round (one-port)")
            if t.receiver in receivers:
                raise InvalidPlan(f"{where}: the receiver receives twice in one round (one-port)")
            senders.add(t.sender)
            receivers.add(t.receiver)
            arriving.append(t)
        for t in arriving:  # blocks received in round r can be sent from round r + 1
            have[t.receiver].add(t.block)
    for target in plan.targets:
        missing = set(range(plan.blocks)) - have[target]
        if missing:
            raise InvalidPlan(f"plan {plan.name!r}: target {target!r} ends without block {min(missing)} "
                              f"({len(missing)} missing)")


# --- plans ---------------------------------------------------------------------------------

def _check_nodes(sources: Sequence[str], targets: Sequence[str], blocks: int) -> None:
    if blocks < 1:
        raise InvalidPlan(f"need at least one block, got {blocks}")
    if not sources:
        raise InvalidPlan("need at least one source")
    if len(set(sources)) != len(sources) or len(set(targets)) != len(targets):
        raise InvalidPlan("sources and targets must be distinct names")
    both = set(sources) & set(targets)
    if both:
        raise InvalidPlan(f"node {sorted(both)[0]!r} is both a source and a target")


def _bw(bandwidth: Mapping[str, float] | None, node: str) -> float:
    if bandwidth is None:
        return 1.0
    if node not in bandwidth:
        raise InvalidPlan(f"no bandwidth given for node {node!r}")
    if not bandwidth[node] > 0:
        raise InvalidPlan(f"bandwidth of node {node!r} must be > 0, got {bandwidth[node]}")
    return float(bandwidth[node])


def _by_bandwidth(nodes: Sequence[str], bandwidth: Mapping[str, float] | None) -> list[str]:
    """Decreasing bandwidth; ties keep the given order (deterministic)."""
    return sorted(nodes, key=lambda n: -_bw(bandwidth, n))


def _full(sources: Sequence[str], targets: Sequence[str], blocks: int) -> dict[str, frozenset[int]]:
    every = frozenset(range(blocks))
    return {**{s: every for s in sources}, **{t: frozenset() for t in targets}}


def _split(items: Sequence[str], k: int) -> list[list[str]]:
    """Deal `items` into k groups of sizes differing by at most one, keeping order inside each."""
    return [list(items[i::k]) for i in range(k)]


def naive(sources: Sequence[str], targets: Sequence[str], blocks: int,
          bandwidth: Mapping[str, float] | None = None) -> Plan:
    """The baseline: each source sends every block to one target, then the next. Targets are
    dealt round-robin to the sources; ceil(N/s) * b rounds."""
    _check_nodes(sources, targets, blocks)
    transfers = []
    for src, group in zip(sources, _split(list(targets), len(sources))):
        for i, tgt in enumerate(group):
            transfers += [Transfer(i * blocks + k, src, tgt, k) for k in range(blocks)]
    return Plan("naive", blocks, _full(sources, targets, blocks), tuple(targets), tuple(sorted(transfers)))


def chains(sources: Sequence[str], targets: Sequence[str],
           bandwidth: Mapping[str, float] | None = None) -> list[list[str]]:
    """The serial chains of BlitzScale 5.1 (Figure 11, one leaf): [source, T1, T2, ...] per
    source that gets targets. Targets in decreasing bandwidth (the fastest serves first,
    Figure 13b), dealt over the sources in decreasing bandwidth."""
    srcs = _by_bandwidth(sources, bandwidth)
    tgts = _by_bandwidth(targets, bandwidth)
    k = min(len(srcs), len(tgts))
    return [[srcs[i], *group] for i, group in enumerate(_split(tgts, k))] if k else []


def chain(sources: Sequence[str], targets: Sequence[str], blocks: int,
          bandwidth: Mapping[str, float] | None = None) -> Plan:
    """Serial forwarding chains: target p of a chain (1-based) receives block i in round
    i + p - 1 and forwards it in the next. b + ceil(N/s) - 1 rounds."""
    _check_nodes(sources, targets, blocks)
    transfers = []
    for ch in chains(sources, targets, bandwidth):
        for p in range(1, len(ch)):
            transfers += [Transfer(i + p - 1, ch[p - 1], ch[p], i) for i in range(blocks)]
    return Plan("chain", blocks, _full(sources, targets, blocks), tuple(targets), tuple(sorted(transfers)))


def k_way_orders(blocks: int, k: int) -> list[list[int]]:
    """lambdaScale Algorithm 1: cut the blocks into k chunks of ceil(b/k) and give sub-group
    i the chunks circularly shifted by i."""
    if k < 1:
        raise InvalidPlan(f"k must be >= 1, got {k}")
    size = -(-blocks // k)
    chunks = [list(range(size * i, min(size * (i + 1), blocks))) for i in range(k)]
    return [[b for j in range(k) for b in chunks[(i + j) % k]] for i in range(k)]


def _cube(m: int, order: Sequence[int], root_from: int) -> list[tuple[int, int, int, int]]:
    """Binomial pipeline among m nodes (index 0 the root) on a hypercube of dimension
    ceil(log2 m), positions of `order` as bits. The root holds position p from round
    p * root_from (root_from 0: all from the start; 1: fed one a round by a relay). Returns
    (round, sender index, receiver index, position). Missing hypercube corners leave nodes
    without a partner in some rounds; a greedy fill matches those (newest block first)."""
    b = len(order)
    if m < 2:
        return []
    dims = max(1, math.ceil(math.log2(m)))
    every = (1 << b) - 1
    have = [0] * m
    have[0] = every if not root_from else 0
    out = []
    t = 0
    while any(h != every for h in have[1:]):
        if root_from and t < b:
            have[0] |= 1 << t  # the position the relay delivered in the previous round
        j = t % dims
        moves: list[tuple[int, int, int]] = []
        sent, got = set(), set()
        for u in range(m):
            w = u ^ (1 << j)
            if w >= m or w == 0:
                continue
            cand = have[u] & ~have[w]
            if not cand:
                continue
            p = t if u == 0 and t < b and cand >> t & 1 else cand.bit_length() - 1
            moves.append((u, w, p))
            sent.add(u)
            got.add(w)
        # greedy fill: idle senders to idle receivers with the fewest blocks, newest block
        for u in range(m):
            if u in sent or not have[u]:
                continue
            best = None
            for w in range(1, m):
                if w in got or w == u:
                    continue
                cand = have[u] & ~have[w]
                if cand and (best is None or have[w].bit_count() < best[0]):
                    best = (have[w].bit_count(), w, cand.bit_length() - 1)
            if best:
                moves.append((u, best[1], best[2]))
                sent.add(u)
                got.add(best[1])
        for u, w, p in moves:
            have[w] |= 1 << p
            out.append((t, u, w, p))
        t += 1
    return out


def _binomial_group(source: str, receivers: Sequence[str], order: Sequence[int]) -> list[Transfer]:
    """1 -> n binomial pipeline for one sub-group. Tries a chain of c relays (c = 0, 1, ...
    < ceil(log2 n)) in front of a hypercube of the others and keeps the fewest rounds: c = 0
    is the paper's hypercube (exact for n = 2^d); c = 1 is exact for n = 2^d + 1."""
    if not receivers:
        return []
    n = len(receivers) + 1
    best: list[Transfer] | None = None
    for c in range(min(len(receivers), max(1, math.ceil(math.log2(n))))):
        relays = [source, *receivers[:c]]
        transfers = [Transfer(i + p - 1, relays[p - 1], relays[p], order[i])
                     for p in range(1, c + 1) for i in range(len(order))]
        members = [relays[-1], *receivers[c:]]
        for r, u, w, p in _cube(len(members), order, 1 if c else 0):
            transfers.append(Transfer(r + c, members[u], members[w], order[p]))
        rounds = max(t.round for t in transfers) + 1
        if best is None or rounds < max(t.round for t in best) + 1:
            best = transfers
    assert best is not None  # the loop runs at least once: n >= 2
    return best


def sub_groups(sources: Sequence[str], targets: Sequence[str],
               bandwidth: Mapping[str, float] | None = None) -> list[list[str]]:
    """The receivers' k sub-groups of the binomial plan (lambdaScale 4.2): targets in
    decreasing bandwidth dealt over k = min(sources, targets) groups; group i is fed by the
    i-th fastest source in the i-th k-way order."""
    k = min(len(sources), max(1, len(targets)))
    return _split(_by_bandwidth(targets, bandwidth), k)


def binomial(sources: Sequence[str], targets: Sequence[str], blocks: int,
             bandwidth: Mapping[str, float] | None = None) -> Plan:
    """The binomial pipeline with the k-way transmission order (lambdaScale 4.2): k sources,
    k sub-groups of receivers (dealt in decreasing bandwidth), sub-group i sends the blocks
    in the i-th circular shift of the k chunks."""
    _check_nodes(sources, targets, blocks)
    srcs = _by_bandwidth(sources, bandwidth)
    groups = sub_groups(sources, targets, bandwidth)
    orders = k_way_orders(blocks, len(groups))
    transfers = []
    for src, group, order in zip(srcs, groups, orders):
        transfers += _binomial_group(src, group, order)
    return Plan("binomial", blocks, _full(sources, targets, blocks), tuple(targets), tuple(sorted(transfers)))


def repair(holdings: Mapping[str, Iterable[int]], targets: Sequence[str], blocks: int,
           name: str = "repair") -> Plan:
    """A plan that completes `targets` from what every live node holds now (after a node
    failed). Greedy per round: targets with the fewest blocks first, each takes from an idle
    holder the rarest block it lacks. Raises InvalidPlan if a block has no holder."""
    if blocks < 1:
        raise InvalidPlan(f"need at least one block, got {blocks}")
    start = {n: frozenset(h) for n, h in holdings.items()}
    for t in targets:
        start.setdefault(t, frozenset())
    every = (1 << blocks) - 1
    have = {n: sum(1 << b for b in h) for n, h in start.items()}
    union = 0
    for h in have.values():
        union |= h
    needed = 0
    for t in targets:
        needed |= every & ~have[t]
    orphan = needed & ~union
    if orphan:
        raise InvalidPlan(f"block {(orphan & -orphan).bit_length() - 1} is held by no live node")
    order = list(have)  # deterministic: insertion order of holdings, then targets
    transfers: list[Transfer] = []
    r = 0
    while any(have[t] != every for t in targets):
        count = [sum(h >> b & 1 for h in have.values()) for b in range(blocks)]
        busy: set[str] = set()
        moves = []
        for t in sorted((t for t in targets if have[t] != every), key=lambda t: (have[t].bit_count(), order.index(t))):
            best = None
            for s in order:
                if s in busy or s == t:
                    continue
                cand = have[s] & ~have[t]
                while cand:
                    b = (cand & -cand).bit_length() - 1
                    cand &= cand - 1
                    key = (count[b], -b)
                    if best is None or key < best[0]:
                        best = (key, s, b)
            if best:
                busy.add(best[1])
                moves.append(Transfer(r, best[1], t, best[2]))
        for m in moves:
            have[m.receiver] |= 1 << m.block
        transfers += moves
        r += 1
    return Plan(name, blocks, start, tuple(targets), tuple(transfers))


PLANS: dict[str, Callable[..., Plan]] = {"naive": naive, "chain": chain, "binomial": binomial}


def make_plan(name: str, sources: Sequence[str], targets: Sequence[str], blocks: int,
              bandwidth: Mapping[str, float] | None = None) -> Plan:
    """Build the plan called `name` (one of PLANS)."""
    if name not in PLANS:
        raise InvalidPlan(f"unknown plan {name!r}; known: {', '.join(PLANS)}")
    return PLANS[name](sources, targets, blocks, bandwidth)


def lower_bound_rounds(nodes: int, blocks: int) -> int:
    """One-port broadcast of b blocks from one source to nodes - 1 others: b + ceil(log2 n) - 1."""
    if nodes < 2:
        return 0
    return blocks + math.ceil(math.log2(nodes)) - 1
