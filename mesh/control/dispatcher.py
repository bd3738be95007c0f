"""The cluster dispatcher (LLM-Mesh 4): every request is placed, waits, or is turned away,
and is always accounted for.

For each arriving request the policy (mesh.control.schedulers) tries to place it. If it
cannot, the request waits in the bounded queue (mesh.policy.queueing) and is retried, in
order, whenever capacity frees (a request ends, an instance is recycled). It is rejected,
with the reason, when the queue is full, after the queue timeout (30 s, the same for every
policy), or, under Mesh, as soon as it can no longer meet its SLO (no validation can pass
then; the baselines cannot tell and keep it waiting, LLM-Mesh 8.2). That last rule is the
model's admission choice (mesh.policy.dispatch_rules.ADMISSIONS): `reject` as above,
`queue` keeps it waiting up to the queue timeout and `late` without a time bound, each placed
once validation shows everyone else on time, its own deadlines running from then (served late).
Requests handed back by a node
(evicted when its KV cache outgrew the estimate, 6.4) are rescheduled the same way with
their progress kept, and so are the requests of a node that is lost (its agent killed,
frozen, removed, its network gone: `on_evict` with `req.lost` set, mesh.control.agent_node),
their deadlines restarting from the loss. Either way the client's stream has started: the
request waits for a node up to the queue timeout whatever its model's admission choice, and
on while an instance of its model loads or a node is down (dispatch_rules.lost_wait_until),
placed late once it cannot be on time; the stats count lost ones resumed and failed by cause.

Invariant: every submitted request ends exactly once, completed, rejected or failed; the
dispatcher counts each (`accounting()`), and `all_done` is set when nothing is in flight.
It holds a request only while it is in flight: an ended one leaves it and is kept as counts
(`Accounting`), so a service that runs for months holds nothing per past request (a replay
keeps its own records for its figures, mesh.replay.driver).
The same rule applies to every policy, so comparisons are fair.

Work triggered from inside a node's loop (a request completes) is deferred with the event
loop, never done re-entrantly inside the node.

The nodes are `ClusterNode`s (mesh.control.cluster_node): simulated in-process nodes in a
replay, node agents in the service; the dispatcher and the policies are the same for both.
A placement is a coroutine (a node agent answers over its connection); decisions for one
model are taken one at a time (`_decide`), so each sees the effects of the one before. In a
replay the nodes answer without suspending, so every decision is atomic in virtual time.
Live, a decision waits for node round trips (an agent answers between two iterations), so
decisions for different models run side by side rather than queue behind each other; the
agents' own checks (validation and admission in one step, the memory budget at a start)
keep two concurrent decisions from over-committing a node. `DispatchStats.decision_s`
says how long decisions took.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from mesh.control.cluster_node import ENGINE_HUNG, ClusterNode
from mesh.control.fleet import Fleet, unable_nodes
from mesh.control.latency import LogHistogram
from mesh.policy.dispatch_rules import (
    ADMIT_QUEUE,
    ADMIT_REJECT,
    LOST_WAIT_LIMIT,
    lost_wait_until,
    queue_expiry_s,
    wait_expiry_s,
)
from mesh.policy.queueing import DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_TIMEOUT_S, QueueEntry, WaitingQueue
from mesh.policy.slo import DeadlineRule
from mesh.wire.served_request import Outcome, ServedRequest

if TYPE_CHECKING:
    from mesh.control.schedulers import Scheduler

log = logging.getLogger(__name__)

DEFAULT_RETRY_INTERVAL_S = 0.05  # waiting requests are retried at most this often

# Reasons a request is turned away.
SLO_UNREACHABLE = "cannot meet its SLO"
QUEUE_TIMEOUT = "queue timeout"
QUEUE_FULL = "queue full"
REPLAY_ENDED = "replay ended"


def eq1_slo_met(req: ServedRequest) -> bool:
    """Completed within the SLO as Eq. 1 reads it (LLM-Mesh 5.1): the first token by
    ST + TTFT_SLO, and the last (the n-th) by ST + TTFT_SLO + TPOT_SLO * (n - 1). A request
    whose first token came early may use that slack later, as the `eq1` deadline rule
    does. `ServedRequest.slo_met` is the stricter reading (mean TPOT measured from the first
    token, i.e. the last token by its `pace` deadline, mesh.policy.slo); replays report both."""
    if req.outcome is not Outcome.COMPLETED or req.first_token_s is None or req.finish_s is None:
        return False
    ttft_deadline = req.arrival_s + req.slo.ttft_s(req.prompt_len)
    if req.first_token_s > ttft_deadline + 1e-9:
        return False
    return req.finish_s <= ttft_deadline + req.slo.tpot_s * max(0, req.tokens_out - 1) + 1e-9


@dataclass
class Accounting:
    """Counts of ended requests by outcome and both SLO readings: what `accounting` reports,
    kept as each request ends (the dispatcher keeps no ended request)."""

    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)  # Outcome value (or "none": not ended) -> count
    slo_compliant: int = 0
    slo_compliant_strict: int = 0

    def add(self, req: ServedRequest) -> None:
        self.requests += 1
        self.outcomes[req.outcome.value if req.outcome is not None else "none"] += 1
        self.slo_compliant += eq1_slo_met(req)
        self.slo_compliant_strict += req.slo_met

    def counts(self, not_ended: int = 0) -> dict[str, int]:
        """The counts; raises AssertionError if a request has not ended (`not_ended` more
        are still in flight)."""
        completed = self.outcomes[Outcome.COMPLETED.value]
        out = {
            "requests": self.requests + not_ended,
            "completed": completed,
            "slo_compliant": self.slo_compliant,
            "slo_violating": completed - self.slo_compliant,
            "rejected": self.outcomes[Outcome.REJECTED.value],
            "failed": self.outcomes[Outcome.FAILED.value],
            "slo_compliant_strict": self.slo_compliant_strict,
        }
        never = self.outcomes["none"] + not_ended
        assert never == 0, f"{never} requests never ended"
        assert out["requests"] == out["slo_compliant"] + out["slo_violating"] + out["rejected"] + out["failed"], out
        return out


def accounting(requests: Sequence[ServedRequest]) -> dict[str, int]:
    """Counts by outcome, both SLO readings; raises AssertionError if a request has not ended.
    Every request is in `requests`: rejected and failed ones count against the SLO rate."""
    acc = Accounting()
    for r in requests:
        acc.add(r)
    return acc.counts()


@dataclass
class DispatchStats:
    placed_at_arrival: int = 0
    queued: int = 0  # requests that waited at least once
    placed_from_queue: int = 0
    rescheduled: int = 0  # handed back by a node (eviction) and placed again
    # requests a node lost (ServedRequest.lost, by cause): placed again with their progress
    # (each placement after a loss counts once), and turned away because no node took them in time
    lost: Counter = field(default_factory=Counter)  # handed back by a node that was lost
    resumed: Counter = field(default_factory=Counter)
    lost_failed: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    failed: Counter = field(default_factory=Counter)
    decisions: int = 0  # placement decisions taken (a request placed, or found unplaceable for now)
    decision_s: float = 0.0  # their summed duration: 0 in a replay, node round trips live
    decision_max_s: float = 0.0
    decision_wait_s: float = 0.0  # summed time requests waited for their turn to be decided
    decision_times: LogHistogram = field(default_factory=LogHistogram)  # each decision's duration (p50/p99)


class Dispatcher:
    def __init__(
        self,
        cluster: Fleet,
        scheduler: Callable[[Callable[[ServedRequest], None]], Scheduler],
        *,
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        queue_timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S,
    ) -> None:
        """`scheduler(reschedule)`: the scheduler that places requests, made with the
        dispatcher's `reschedule` (for the requests it takes back, 6.4)."""
        self.cluster = cluster
        self.queue = WaitingQueue(queue_capacity)
        self.retry_interval_s = retry_interval_s
        self.queue_timeout_s = queue_timeout_s
        self._slo_expiry: dict[str, float] = {}  # waiting request -> when it can no longer meet its SLO
        self._why: dict[str, str] = {}  # waiting request -> what its expiry is ("slo", "timeout")
        self._recovering: dict[str, float] = {}  # waiting lost request -> when a recovery for it was last seen
        self._avoid: dict[str, frozenset[str]] = {}  # evicted request -> nodes that evicted it
        self.stats = DispatchStats()
        self.requests: dict[str, ServedRequest] = {}  # in flight: each leaves when it ends
        self.ended = Accounting()  # the ended ones, as counts
        self._waiting: dict[str, ServedRequest] = {}
        self._in_flight = 0
        self._closed = False  # no more submissions
        self.all_done = asyncio.Event()
        self._drain_handle: asyncio.Handle | None = None
        self._last_drain = -1e18
        self._expiry_handle: asyncio.TimerHandle | None = None
        self._expiry_at: float | None = None
        self._draining = False  # a drain pass is running
        self._decisions: dict[str, asyncio.Lock] = {}  # per model: one placement decision at a time
        self._skipped: set[str] = set()  # models a drain skipped while their decision was in flight
        self._tasks: set[asyncio.Task] = set()
        self.error: BaseException | None = None  # a policy that raised (a bug); replays re-raise it
        cluster.on_capacity = self.capacity_freed
        cluster.on_evict = self.on_evict
        self.policy: Scheduler = scheduler(self.reschedule)

    @classmethod
    def for_policy(cls, cluster: Fleet, policy: str, *, queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
                   retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
                   queue_timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S) -> "Dispatcher":
        """The dispatcher of `cluster` under the named policy (mesh.control.schedulers): how
        `mesh replay` and `mesh serve` both build theirs, so a replay evaluates exactly what
        serves tenants."""
        from mesh.control.schedulers import make_scheduler

        return cls(cluster, lambda reschedule: make_scheduler(policy, cluster, reschedule),
                   queue_capacity=queue_capacity, retry_interval_s=retry_interval_s, queue_timeout_s=queue_timeout_s)

    @staticmethod
    def now() -> float:
        """The dispatcher's clock: the one time its decisions are taken at (the policy's too)."""
        return asyncio.get_running_loop().time()

    # -- requests in ---------------------------------------------------------------
    def submit(self, req: ServedRequest) -> None:
        """A request arrives (its arrival_s is now)."""
        if self._closed:
            raise RuntimeError("the dispatcher is closed; no more requests")
        self.requests[req.request_id] = req
        self._in_flight += 1
        user_done = req.on_done
        req.on_done = lambda r, cb=user_done: self._ended(r, cb)
        self.all_done.clear()
        if (self.queue.has_model(req.model) or self._deciding(req.model)) and not self._expired(req):
            # FIFO per model: wait behind earlier ones, and in the bounded queue (its
            # capacity, its fair share, the autoscaler's view) while a decision for the
            # model is under way (live, one can take seconds: a scale-out multicasts weights).
            # One the queue would turn away at once (it arrived past its SLO: live, a cold
            # model's tokenizer was built first) gets its model's next decision instead,
            # which may serve it late (dispatch_rules.SERVE_LATE), as it would with no decision
            # under way.
            self._enqueue(req)
            self._schedule_drain()
        else:
            self._spawn(self._arrive(req))

    def _deciding(self, model: str) -> bool:
        """A placement decision for `model` is under way (never at an arrival in a replay,
        whose decisions do not suspend)."""
        lock = self._decisions.get(model)
        return lock is not None and lock.locked()

    async def _arrive(self, req: ServedRequest) -> None:
        if await self._decide(req):
            self.stats.placed_at_arrival += 1
        elif req.outcome is None:
            self._enqueue(req)

    async def _decide(self, req: ServedRequest, avoid: frozenset[str] = frozenset()) -> bool:
        """One placement decision by the policy; a policy that raises (a bug) fails the
        request instead of losing it, and the error is kept for the replay to raise."""
        if req.outcome is not None:
            return False
        asked = self.now()
        async with self._decisions.setdefault(req.model, asyncio.Lock()):
            start = self.now()
            if req.outcome is not None:  # ended (aborted, expired) while it waited for its turn
                return False
            try:
                return await self.policy.place(req, start, avoid | unable_nodes(self.cluster.nodes, [req]))
            except Exception as exc:  # noqa: BLE001 - every request must still end
                log.exception("placing %s failed", req.request_id)
                self.error = self.error or exc
                self.stats.failed["placement error"] += 1
                req.end(Outcome.FAILED, self.now(), f"failed: the placement raised {type(exc).__name__}: {exc}")
                return False
            finally:
                took = self.now() - start
                log.debug("decided %s of %s in %.3f s: %.3f s after its arrival, %.3f s waiting for its model's turn",
                          req.request_id, req.model, took, start - req.arrival_s, start - asked)
                st = self.stats
                st.decisions += 1
                st.decision_s += took
                st.decision_max_s = max(st.decision_max_s, took)
                st.decision_times.add(took)
                st.decision_wait_s += start - asked
                if req.model in self._skipped:  # a drain skipped its model's waiting ones meanwhile
                    self._skipped.discard(req.model)
                    self._schedule_drain()

    def forget_model(self, model: str) -> bool:
        """A deleted model's decision lock goes, once no request of it is in flight and no
        decision for it runs; False until then."""
        if self._deciding(model) or any(r.model == model for r in self.requests.values()):
            return False
        self._decisions.pop(model, None)
        return True

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """No more submissions; all_done is set once the last request ends."""
        self._closed = True
        if self._in_flight == 0:
            self.all_done.set()

    def reschedule(self, req: ServedRequest) -> None:
        """Place again a request taken off a node (evicted, lost, preempted), or let it wait."""
        req.handed_back_s = self.now()
        if req.outcome is None:
            self._spawn(self._reschedule(req))

    async def _reschedule(self, req: ServedRequest) -> None:
        if await self._decide(req, self._avoid.get(req.request_id, frozenset())):
            self.stats.rescheduled += 1
            self._placed_again(req)
        elif req.outcome is None:
            self._enqueue(req)

    def _placed_again(self, req: ServedRequest) -> None:
        """A request placed from the queue or handed back: one a node had lost is resumed."""
        if req.lost and req.outcome is None:
            self.stats.resumed[req.lost] += 1

    def on_evict(self, req: ServedRequest, node: ClusterNode) -> None:
        """A node evicted a request (6.4), or lost it (the node failed: `req.fault`, its cause
        in `req.lost`), its progress kept; called inside the node's loop, so deferred. An
        evicted request avoids that node; a lost one may go back to it (a restarted agent,
        the node of a single-node service)."""
        if not (req.lost and req.fault) or req.lost == ENGINE_HUNG:
            self._avoid[req.request_id] = self._avoid.get(req.request_id, frozenset()) | {node.node_id}
        if req.fault and req.lost:
            self.stats.lost[req.lost] += 1
        if req.fault:  # the node failed: the stall is not the request's, its deadlines restart
            req.fault = False
            rule = self.cluster.config.deadlines
            _, resume_s = req.resumed(req.tokens_out, rule)
            stall = max(0.0, self.now() - resume_s)
            req.late_s += stall  # Eq. 1: deadlines run from arrival + late_s
            if rule is DeadlineRule.PACE and req.first_token_s is not None:
                req.first_token_s += stall  # pace: from the first token
        loop = asyncio.get_running_loop()
        loop.call_soon(self.reschedule, req)
        loop.call_soon(self.cluster.note_idle, node)

    def capacity_freed(self) -> None:
        self._schedule_drain()

    # -- the queue -------------------------------------------------------------------
    def _deadline(self, req: ServedRequest) -> tuple[float, int]:
        """(next-token deadline, prompt to prefill) of a request with its progress, under
        the cluster's deadline rule (mesh.policy.slo)."""
        prompt, start = req.resumed(req.tokens_out, self.cluster.config.deadlines)
        return start + req.slo.ttft_s(prompt), prompt

    def admission(self, req: ServedRequest) -> str:
        """The admission choice that applies to `req` (mesh.policy.dispatch_rules.ADMISSIONS): its
        model's (or its tenant's) for a fresh request; ADMIT_QUEUE for one a node handed back,
        lost or evicted (its stream had started: it waits for a node up to the queue timeout, a
        restarted agent, an instance loading elsewhere), whatever it had done."""
        if req.handed_back_s is not None:
            return ADMIT_QUEUE
        return self.cluster.admission(req.model, req.tenant)

    def _expiry(self, req: ServedRequest, now: float) -> tuple[float, str, float]:
        """(when the queue turns the request away, why: "slo" or "timeout", when it can no
        longer meet its SLO), for a request that starts waiting now."""
        deadline, prompt = self._deadline(req)
        slo_expiry = queue_expiry_s(deadline, self.cluster.fastest_prefill_s(req.model, prompt, self.policy.kinds))
        return *wait_expiry_s(now, slo_expiry, self.queue_timeout_s, self.policy.validates,
                              self.admission(req)), slo_expiry

    def _expired(self, req: ServedRequest) -> bool:
        now = self.now()
        return now >= self._expiry(req, now)[0]

    def _enqueue(self, req: ServedRequest) -> None:
        now = self.now()
        expiry, why, slo_expiry = self._expiry(req, now)
        if now >= expiry:
            if why == "slo":
                self._turn_away(req, SLO_UNREACHABLE, "no instance could take it in time")
            else:
                self._turn_away(req, QUEUE_TIMEOUT, f"queue timeout of {self.queue_timeout_s:g} s")
            return
        if req.request_id in self._waiting:
            return
        tenant = req.tenant or req.model
        displaced = self.queue.make_room(tenant)
        if displaced is not None:  # fair share of a full queue (mesh.policy.queueing)
            other = self._forget_waiting(displaced.request_id)
            self._turn_away(other, QUEUE_FULL, f"{self.queue.capacity} requests were waiting and its tenant held "
                                               "the largest share; another tenant's request took its place")
        if not self.queue.push(req.request_id, req.model, now, expiry, tenant):
            self._turn_away(req, QUEUE_FULL, f"{self.queue.capacity} requests were waiting, "
                                             f"{self.queue.held(tenant)} of them its tenant's")
            return
        if req.tokens_out == 0 and not req.waited:
            self.stats.queued += 1
            req.waited = True
            req.attempts.append(f"waited from {now:.3f}")
        self._waiting[req.request_id] = req
        self._slo_expiry[req.request_id] = slo_expiry
        self._why[req.request_id] = why
        self._arm_expiry()
        if req.handed_back_s is not None and now < slo_expiry < expiry:
            # a handed-back request is tried again once it can no longer meet its SLO, when it may be
            # served late (`_drain`), even if nothing else happens meanwhile (a single node restarting)
            asyncio.get_running_loop().call_at(slo_expiry, self._schedule_drain)

    def _turn_away(self, req: ServedRequest, reason: str, detail: str) -> None:
        """Reject a request never served; fail one that had started (it lost its place)."""
        (log.warning if req.lost else log.debug)("%s of %s turned away: %s: %s (attempts %s)", req.request_id,
                                                 req.model, reason, detail, req.attempts)
        if req.first_token_s is None and req.tokens_out == 0 and not req.lost:
            self.stats.rejected[reason] += 1
            req.end(Outcome.REJECTED, self.now(), f"rejected: {reason}: {detail}")
        else:
            self.stats.failed[reason] += 1
            lost = f"its node was lost ({req.lost}), then " if req.lost else ""
            req.end(Outcome.FAILED, self.now(), f"failed after {req.tokens_out} tokens: {lost}{reason}: {detail}")
        if req.lost:
            self.stats.lost_failed[req.lost] += 1

    def _arm_expiry(self) -> None:
        t = self.queue.next_expiry()
        if t is None or (self._expiry_at is not None and self._expiry_at <= t):
            return
        if self._expiry_handle is not None:
            self._expiry_handle.cancel()
        self._expiry_at = t
        self._expiry_handle = asyncio.get_running_loop().call_at(t, self._expire)

    def _forget_waiting(self, request_id: str) -> ServedRequest:
        """A request that left the queue: its bookkeeping goes; returns it."""
        self._slo_expiry.pop(request_id, None)
        self._why.pop(request_id, None)
        self._recovering.pop(request_id, None)
        return self._waiting.pop(request_id)

    def _waits_on(self, entry: QueueEntry) -> float | None:
        """Until when a handed-back request past its timeout waits on (dispatch_rules.lost_wait_until)."""
        req = self._waiting[entry.request_id]
        if req.handed_back_s is None:  # (a handed-back request's expiry is always its timeout: ADMIT_QUEUE)
            return None
        now = self.now()
        left = self.cluster.cold_start_left_s(req.model)
        if left is None and not all(node.up for node in self.cluster.nodes):
            left = 0.0  # a lost node's agent is not back yet (a supervisor restarts it)
        if left is not None:
            self._recovering[entry.request_id] = now
        return lost_wait_until(now, req.handed_back_s, self.queue_timeout_s, left,
                               self._recovering.get(entry.request_id, req.handed_back_s))

    def _expire(self) -> None:
        self._expiry_handle = self._expiry_at = None
        for entry in self.queue.pop_expired(self.now(), self._waits_on):
            why = self._why.get(entry.request_id)
            req = self._forget_waiting(entry.request_id)
            if why == "slo":
                self._turn_away(req, SLO_UNREACHABLE, "waited until it could no longer meet its SLO")
            elif req.handed_back_s is not None:
                gone = "was lost" if req.lost else "handed it back"
                self._turn_away(req, QUEUE_TIMEOUT, f"waited {self.now() - req.handed_back_s:.0f} s since its "
                                                    f"node {gone} (the queue's bound, {self.queue_timeout_s:g} s, and "
                                                    f"on while a node or an instance of its model recovered, up to "
                                                    f"{LOST_WAIT_LIMIT:g} times that)")
            else:
                self._turn_away(req, QUEUE_TIMEOUT, f"waited {self.queue_timeout_s:g} s, the bound of the queue")
        self._arm_expiry()

    def _schedule_drain(self) -> None:
        if self._drain_handle is not None or not self._waiting:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last_drain + self.retry_interval_s - loop.time())
        self._drain_handle = loop.call_later(delay, self._start_drain)

    def _start_drain(self) -> None:
        if self._draining:  # a pass is running: the next one follows it
            self._drain_handle = asyncio.get_running_loop().call_later(self.retry_interval_s, self._start_drain)
            return
        self._drain_handle = None
        self._draining = True
        self._spawn(self._drain())

    async def _drain(self) -> None:
        """Retry waiting requests in order; a model whose head cannot be placed is skipped
        for the rest of this pass (FIFO per model), and so is one whose placement decision is
        in flight (live, a round trip or more: the drain does not wait for it)."""
        try:
            self._last_drain = self.now()
            blocked: set[str] = set()
            for entry in list(self.queue.in_order()):
                if entry.model in blocked or entry.request_id not in self.queue:
                    continue
                if self._deciding(entry.model):  # its model's decision is in flight (live): the others go on;
                    blocked.add(entry.model)  # a pass follows that decision (`_decide`)
                    self._skipped.add(entry.model)
                    continue
                req = self._waiting[entry.request_id]
                now = self.now()
                if now >= self._slo_expiry[entry.request_id]:
                    if self.admission(req) != ADMIT_REJECT:  # queue, late: served late, deadlines from now,
                        req.late_s = req.deadlines.from_at_least(now).late_s  # as soon as it can be
                        req.best_effort = True
                    elif self.policy.validates:
                        continue  # validation can only fail now; it waits out its timeout
                if await self._decide(req, self._avoid.get(entry.request_id, frozenset())):
                    if entry.request_id in self.queue:
                        self.queue.remove(entry.request_id)
                        self._forget_waiting(entry.request_id)
                    self.stats.placed_from_queue += 1
                    self._placed_again(req)
                else:
                    blocked.add(entry.model)
        finally:
            self._draining = False

    # -- requests out ----------------------------------------------------------------
    def _ended(self, req: ServedRequest, user_done) -> None:
        self._in_flight -= 1
        self.requests.pop(req.request_id, None)
        self.ended.add(req)
        self._avoid.pop(req.request_id, None)
        if req.request_id in self._waiting:  # ended while waiting (aborted)
            self.queue.remove(req.request_id)
            self._forget_waiting(req.request_id)
        if req.node_id is not None and req.node_id in self.cluster.node_seq:  # (not a node that left)
            node = self.cluster.node(req.node_id)
            loop = asyncio.get_running_loop()
            loop.call_soon(self.cluster.note_idle, node)
            self._schedule_drain()
        if user_done is not None:
            user_done(req)
        if self._closed and self._in_flight == 0:
            self.all_done.set()

    def abort_all(self, why: str) -> None:
        """End every request still in flight (the replay's time limit)."""
        now = self.now()
        for req in list(self._waiting.values()):
            self._turn_away(req, REPLAY_ENDED, why)
        for ref in self.cluster.all_instances():
            for rid in list(ref.requests):
                ref.node.abort(rid, why)
        for req in list(self.requests.values()):
            if req.outcome is None:
                req.end(Outcome.FAILED, now, why)

    def waiting_requests(self) -> list[ServedRequest]:
        """The requests in the waiting queue, oldest first."""
        return [self._waiting[e.request_id] for e in self.queue.in_order() if e.request_id in self._waiting]

    def check(self) -> None:
        """Raise the error a policy raised, if one did (a bug: replays stop on it)."""
        if self.error is not None:
            raise RuntimeError(f"the {self.policy.name} policy raised: {self.error!r}") from self.error

    def accounting(self) -> dict[str, int]:
        """Counts by outcome of every request submitted (`accounting`); raises AssertionError
        while some are in flight."""
        return self.ended.counts(len(self.requests))
