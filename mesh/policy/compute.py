"""Compute subsystem of one node (LLM-Mesh 5): headroom and token-level scheduling.

A node runs one iteration of one instance at a time (5.1). Every running request has a
headroom (Eq. 1):

    headroom = ST + TTFT_SLO + TPOT_SLO * O - CT

i.e. the time left before its next token is late. Each cycle picks the instance whose most
urgent request has the smallest headroom. Since CT is common to all requests, ordering by
headroom is ordering by the absolute deadline ST + TTFT_SLO + TPOT_SLO * O.

That deadline is Eq. 1's; under the `pace` rule (mesh.policy.slo.DeadlineRule, chosen per
node) a request's tokens after the first are due at FT + TPOT_SLO * O instead, FT the time
its first token came. Either way the deadline is anchor + TPOT_SLO * O once the first token
is out; the rule only picks the anchor (DeadlineRule.anchor_s), when the prefill completes.

Bookkeeping trick: a decode iteration gives every running request of the instance one
token, so all their deadlines move by the same TPOT_SLO. We keep, per instance, a count of
decode rounds k and store for each running request the constant key
anchor - TPOT_SLO * k_join; its deadline is key + TPOT_SLO * k. The order inside an
instance then never changes on decode, and a scheduling decision costs O(log n).

Iterations follow the engines' batching rule (mesh.policy.batching): requests waiting for
prefill are prefilled first, in arrival order, as many as fit the prefill token budget;
otherwise one decode iteration for all running requests. Prefill and decode never mix.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from sortedcontainers import SortedKeyList, SortedList

from mesh.policy.batching import IterationKind, IterationTimes, extra_s, prefill_take
from mesh.policy.live_scaling import LayerArrivals
from mesh.policy.slo import SLO, DeadlineRule


@dataclass(slots=True)
class RequestState:
    request_id: str
    instance_id: str
    prompt_len: int
    start_s: float  # ST: when the request arrived
    ttft_deadline_s: float  # ST + TTFT_SLO(prompt_len)
    running: bool = False  # prefilled and decoding
    key: float = 0.0  # running only: deadline = key + tpot * decode_rounds
    join_round: int = 0  # running only: decode_rounds when its first token came, minus 1
    resumed: bool = False  # produced tokens before it joined this node: its prefill is not its first token

    def tokens_out(self, decode_rounds: int) -> int:
        """O: tokens produced so far (0 while waiting for prefill)."""
        return decode_rounds - self.join_round if self.running else 0


@dataclass(eq=False, slots=True)
class InstanceState:
    instance_id: str
    times: IterationTimes
    slo: SLO
    prefill_token_budget: int
    ready_at: float = 0.0  # when it can run: predicted while loading (cold start, LLM-Mesh 4)
    loaded: bool = True  # weights in place; only loaded instances are scheduled
    pending: dict[str, RequestState] = field(default_factory=dict)  # arrival order
    pending_by_deadline: SortedKeyList = field(
        default_factory=lambda: SortedKeyList(key=lambda r: (r.ttft_deadline_s, r.request_id))
    )
    running: SortedKeyList = field(
        default_factory=lambda: SortedKeyList(key=lambda r: (r.key, r.request_id))
    )
    decode_rounds: int = 0
    context_sum: int = 0  # sum over running requests of prompt_len + O
    order_entry: tuple | None = None  # this instance's entry in the node's order, if any
    last: tuple[IterationKind, int] | None = None  # its previous iteration (kind, batch size), for extra_s
    shapes: set[int] = field(default_factory=set)  # prompt-token totals it has prefilled, for extra_s
    layers: LayerArrivals | None = None  # a live instance: its usable layers over time (None: all held)

    @property
    def tpot(self) -> float:
        return self.slo.tpot_s

    def next_deadline(self) -> float:
        """Deadline of the instance's most urgent request (inf if it has none)."""
        best = math.inf
        if self.pending_by_deadline:
            best = self.pending_by_deadline[0].ttft_deadline_s
        if self.running:
            best = min(best, self.running[0].key + self.tpot * self.decode_rounds)
        return best

    def running_deadline(self, r: RequestState) -> float:
        return r.key + self.tpot * self.decode_rounds

    def prefill_batch(self) -> list[RequestState]:
        """The requests the next prefill iteration takes (arrival order, within the budget;
        the node's admission keeps an instance within its engine's max_batch)."""
        take = prefill_take((r.prompt_len for r in self.pending.values()), self.prefill_token_budget, math.inf)
        return list(itertools.islice(self.pending.values(), take))

    def n_requests(self) -> int:
        return len(self.pending) + len(self.running)


@dataclass(frozen=True, slots=True)
class Iteration:
    """A scheduling decision: run one iteration of one instance."""

    instance_id: str
    kind: IterationKind
    batch_size: int
    tokens: int  # prompt tokens (prefill) or average context (decode)
    predicted_s: float


class ComputeSubsystem:
    """Per-node compute state: instances, their requests, and the token-level order."""

    def __init__(self, deadlines: DeadlineRule = DeadlineRule.EQ1) -> None:
        self.deadlines = deadlines  # when tokens after the first are due (mesh.policy.slo)
        self.instances: dict[str, InstanceState] = {}
        self.requests: dict[str, RequestState] = {}
        # (next deadline, instance id) for instances that have work; smallest first.
        self._order: SortedList = SortedList()
        self.busy_until: float = -math.inf  # end of the iteration in flight, as predicted
        self.in_flight: Iteration | None = None  # the iteration running now, if any
        self.last_instance: str | None = None  # the instance of the node's previous iteration

    # -- instances -------------------------------------------------------------------
    def add_instance(
        self,
        instance_id: str,
        times: IterationTimes,
        slo: SLO,
        prefill_token_budget: int,
        ready_at: float = 0.0,
        loaded: bool = True,
    ) -> InstanceState:
        if instance_id in self.instances:
            raise ValueError(f"instance {instance_id!r} already on this node")
        inst = InstanceState(instance_id, times, slo, prefill_token_budget, ready_at, loaded)
        self.instances[instance_id] = inst
        return inst

    def set_loaded(self, instance_id: str, now: float, layers: LayerArrivals | None = None) -> None:
        """The instance can run from `now`; `layers`: a live instance's layers still arriving."""
        inst = self.instances[instance_id]
        inst.loaded, inst.ready_at, inst.layers = True, now, layers

    def remove_instance(self, instance_id: str) -> None:
        inst = self.instances[instance_id]
        if inst.n_requests():
            raise ValueError(f"instance {instance_id!r} still has {inst.n_requests()} requests")
        self._unorder(inst)
        del self.instances[instance_id]

    # -- requests --------------------------------------------------------------------
    def add_request(
        self, instance_id: str, request_id: str, prompt_len: int, start_s: float, resumed: bool = False
    ) -> RequestState:
        """A request waiting for prefill. A resumed one (`resumed`, its first token came on
        another instance) has its progress folded into `prompt_len` and `start_s` so that
        its next token is due at start_s + TTFT_SLO(prompt_len) (NodeRuntime.effective)."""
        inst = self.instances[instance_id]
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already on this node")
        r = RequestState(request_id, instance_id, prompt_len, start_s, start_s + inst.slo.ttft_s(prompt_len),
                         resumed=resumed)
        self.requests[request_id] = r
        self._unorder(inst)
        inst.pending[request_id] = r
        inst.pending_by_deadline.add(r)
        self._reorder(inst)
        return r

    def remove_request(self, request_id: str) -> RequestState:
        """Forget a request (finished, aborted or evicted)."""
        r = self.requests.pop(request_id)
        inst = self.instances[r.instance_id]
        self._unorder(inst)
        self._drop(inst, r)
        self._reorder(inst)
        return r

    def headroom(self, request_id: str, now: float) -> float:
        """Eq. 1 for one request (its deadline under the node's rule, minus now)."""
        r = self.requests[request_id]
        inst = self.instances[r.instance_id]
        deadline = inst.running_deadline(r) if r.running else r.ttft_deadline_s
        return deadline - now

    def tokens_out(self, request_id: str) -> int:
        r = self.requests[request_id]
        return r.tokens_out(self.instances[r.instance_id].decode_rounds)

    # -- token-level scheduling (5.1) --------------------------------------------------
    def next_iteration(self, now: float) -> Iteration | None:
        """The instance with the most urgent request, and what its next iteration is.

        Instances still loading are skipped.
        """
        for _, instance_id in self._order:
            inst = self.instances[instance_id]
            if inst.loaded:
                return predict_iteration(inst, self.last_instance)
        return None

    def complete_iteration(
        self,
        instance_id: str,
        kind: IterationKind,
        served: Sequence[str],
        finished: Iterable[str] = (),
        now: float | None = None,
    ) -> None:
        """Apply what an iteration did: `served` got one token each; `finished` ended.
        `now`: when the iteration ended (the first tokens' time; needed after a prefill
        under the pace rule)."""
        inst = self.instances[instance_id]
        inst.last = (kind, len(served))
        self.last_instance = instance_id
        if kind is IterationKind.PREFILL and now is None and self.deadlines is DeadlineRule.PACE:
            raise ValueError("complete_iteration after a prefill needs `now` under the pace deadline rule")
        self._unorder(inst)
        if kind is IterationKind.PREFILL:
            inst.shapes.add(sum(inst.pending[rid].prompt_len for rid in served if rid in inst.pending))
            for rid in served:
                r = inst.pending.pop(rid)
                inst.pending_by_deadline.remove(r)
                # Token O = 1 produced: the next is due at anchor + tpot (mesh.policy.slo).
                r.join_round = inst.decode_rounds - 1
                anchor = self.deadlines.anchor_s(r.ttft_deadline_s, None if r.resumed else now)
                r.key = anchor - inst.tpot * r.join_round
                r.running = True
                inst.running.add(r)
                inst.context_sum += r.prompt_len + 1
        else:
            inst.decode_rounds += 1
            inst.context_sum += len(served)
            if len(served) != len(inst.running):
                # Some running requests got no token (an engine preempted them): their
                # deadline stays, so their key moves back by one TPOT.
                got = set(served)
                for r in [r for r in inst.running if r.request_id not in got]:
                    inst.running.remove(r)
                    r.key -= inst.tpot
                    r.join_round += 1
                    inst.running.add(r)
        for rid in finished:
            ended = self.requests.pop(rid, None)
            if ended is not None:
                self._drop(inst, ended)
        self._reorder(inst)

    # -- internals -------------------------------------------------------------------
    def _drop(self, inst: InstanceState, r: RequestState) -> None:
        if r.request_id in inst.pending:
            del inst.pending[r.request_id]
            inst.pending_by_deadline.remove(r)
        else:
            inst.running.remove(r)
            inst.context_sum -= r.prompt_len + r.tokens_out(inst.decode_rounds)

    def _unorder(self, inst: InstanceState) -> None:
        if inst.order_entry is not None:
            self._order.remove(inst.order_entry)
            inst.order_entry = None

    def _reorder(self, inst: InstanceState) -> None:
        self._unorder(inst)
        if inst.pending or inst.running:
            inst.order_entry = (inst.next_deadline(), inst.instance_id)
            self._order.add(inst.order_entry)


def predict_iteration(inst: InstanceState, last_instance: str | None = None) -> Iteration:
    """The next iteration of `inst` under the engines' batching rule, with its predicted time
    (grid time plus extra_s; `last_instance`: the node's previous iteration's instance)."""
    switched = last_instance is not None and last_instance != inst.instance_id
    if inst.pending:
        batch = inst.prefill_batch()
        tokens = sum(r.prompt_len for r in batch)
        extra = extra_s(inst.times, IterationKind.PREFILL, len(batch), inst.last, switched, tokens not in inst.shapes)
        return Iteration(inst.instance_id, IterationKind.PREFILL, len(batch), tokens,
                         inst.times.prefill_s(tokens) + extra)
    n = len(inst.running)
    avg = inst.context_sum / n
    extra = extra_s(inst.times, IterationKind.DECODE, n, inst.last, switched)
    return Iteration(inst.instance_id, IterationKind.DECODE, n, round(avg), inst.times.decode_s(n, avg) + extra)
