"""Shadow validation (LLM-Mesh 5.3): may a candidate request join an instance on this node?

We copy the node's compute state, add the candidate, and simulate token-level scheduling
forward with every iteration overestimated by a margin (10% in the paper, for runtime
fluctuation and growing contexts). The candidate is rejected if

1. its own prefill ends after its TTFT deadline (OWN_PREFILL_LATE),
2. a request already on the node, on time without the candidate, turns late with it, or
   one late anyway is pushed later still and over one TPOT late (EXISTING_REQUEST_LATE;
   the second clause is not applied to a handed-back candidate, `shadow_validate`), or
3. one round of decode iterations across the node's instances, with the candidate in its
   instance, takes longer than the TPOT SLO (DECODE_ROUND_OVER_TPOT).

The simulation runs until the candidate's prefill is done, every request waiting for
prefill when it starts (on any instance of the node) has been prefilled, and every instance
that was decoding then has decoded once more: a candidate that jumps ahead of requests
waiting on a neighbour instance must not push their prefill past their TTFT deadline.
Output lengths are unknown to the scheduler, so no request is assumed to finish inside the
horizon (conservative). The horizon is also a budget of iterations; those simulated before
the candidate's instance is ready (it is loading: a request served late, dispatch_rules
SERVE_LATE) are outside it, up to FREE_ITERATIONS: the other instances decode meanwhile, and
with the budget alone a load 10-20 s away (at 50 ms decode steps) would never be reached, so
every request served late on it would be refused as "late by inf".

The margin over a run of iterations (`Padding`): the paper's 10% holds for every
iteration. A learnt margin above it (mesh.perf.times.AdaptiveTimes: the 95th percentile of
actual/predicted, which a shared 2-core machine puts at 30-40%) is the tail of one
iteration; applied to each of the dozens of iterations before a burst's last first token it
would predict every one at its tail at once, and refuse requests that a policy admitting
them serves well within SLO. The part above 10% counts as
independent fluctuation: a run of iterations of predicted d_1..d_k is padded by 10% of
their sum plus (margin - 10%) * sqrt(sum d_i^2). One iteration gets exactly its margin; a
long run tends to the paper's 10%.

Deadlines follow the node's rule (ComputeSubsystem.deadlines, mesh.policy.slo): under
`pace` a request prefilled inside the simulation has its later tokens due from its simulated
first token, and a request already decoding from its actual one, so case 2 rejects a
candidate whose prefill would stall a started request beyond TPOT_SLO per token from its
first token, even when Eq. 1 would still call it on time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Collection

from mesh.policy.batching import IterationKind, IterationTimes, prefill_take
from mesh.policy.compute import ComputeSubsystem
from mesh.policy.live_scaling import LayerArrivals, solo_finish
from mesh.policy.slo import DeadlineRule

DEFAULT_MARGIN = 0.10
_LATER_EPS_S = 1e-6  # "later with the candidate" beyond float noise
FREE_ITERATIONS = 20_000  # simulated iterations before the candidate's instance is ready, at most (a few ms)


class FailureCase(str, Enum):
    OWN_PREFILL_LATE = "own_prefill_late"
    EXISTING_REQUEST_LATE = "existing_request_late"
    DECODE_ROUND_OVER_TPOT = "decode_round_over_tpot"


@dataclass(frozen=True, slots=True)
class Failure:
    case: FailureCase
    by_s: float  # how late, or how far over the TPOT SLO
    request_id: str | None = None  # the late request (cases 1 and 2)
    instance_id: str | None = None

    def __str__(self) -> str:
        who = f" request {self.request_id}" if self.request_id else ""
        where = f" on instance {self.instance_id}" if self.instance_id else ""
        return f"{self.case.value}:{who}{where} by {self.by_s * 1000:.1f} ms"


@dataclass(frozen=True, slots=True)
class Verdict:
    failures: tuple[Failure, ...] = ()
    candidate_first_token_s: float = math.nan  # predicted, with the margin
    decode_round_s: float = 0.0  # predicted, with the margin

    @property
    def ok(self) -> bool:
        return not self.failures

    def failed(self, case: FailureCase) -> Failure | None:
        return next((f for f in self.failures if f.case is case), None)

    def reason(self) -> str:
        return "ok" if self.ok else "; ".join(str(f) for f in self.failures)


@dataclass(slots=True)
class _Sim:
    """One instance, reduced to what the simulation needs."""

    instance_id: str
    times: IterationTimes
    tpot: float
    budget: int
    ready_at: float
    pending: list[tuple[str, int, float, bool]]  # (request id, prompt len, TTFT deadline, resumed), arrival order
    n: int  # running requests
    ctx: int  # their summed context
    rounds: int
    min_key: float  # most urgent running request: deadline = min_key + tpot * rounds
    min_rid: str | None
    rule: DeadlineRule
    head: int = 0  # pending[head:] still wait for prefill
    margin: float = DEFAULT_MARGIN  # for this instance's iterations (instance_margin)
    layers: LayerArrivals | None = None  # a live instance's usable layers over time

    def end_s(self, t: float, padded_s: float) -> float:
        """When an iteration of `padded_s` at full speed, started at `t`, ends: a live
        instance runs the layers it holds and waits for the others (live_iteration_end)."""
        return live_iteration_end(self.layers, t, padded_s)

    def next_deadline(self) -> float:
        best = self.min_key + self.tpot * self.rounds if self.n else math.inf
        for _, _, deadline, _ in self.pending[self.head :]:
            best = min(best, deadline)
        return best

    def start_decoding(self, rid: str, prompt_len: int, deadline: float, resumed: bool, t: float) -> None:
        """A prefill that ended at `t` gave `rid` its token O = 1 (ComputeSubsystem.complete_iteration)."""
        key = self.rule.anchor_s(deadline, None if resumed else t) - self.tpot * (self.rounds - 1)
        if key < self.min_key:
            self.min_key, self.min_rid = key, rid
        self.n += 1
        self.ctx += prompt_len + 1


@dataclass(slots=True)
class _Outcome:
    late: dict[str, tuple[float, str]] = field(default_factory=dict)  # request -> (by_s, instance)
    candidate_first_token_s: float = math.nan
    candidate_late_s: float = -math.inf  # first token time minus TTFT deadline
    end_s: float = 0.0


def live_iteration_end(layers: LayerArrivals | None, t: float, padded_s: float) -> float:
    """A live instance's iteration, predicted from the layers it holds (LLM-Mesh 5.3 with
    BlitzScale 5.2): the instance alone runs each layer once it is in (the partner's help,
    which it gives only when idle, is never counted on); a full instance: `t + padded_s`."""
    if layers is None or t >= layers.full_s:
        return t + padded_s
    return solo_finish(t, padded_s, layers)


def instance_margin(times: IterationTimes, margin: float) -> float:
    """The margin shadow validation applies to one instance: the one its iteration times
    learnt from live iterations (`times.margin`, e.g. mesh.perf.times.AdaptiveTimes: a
    quantile of actual/predicted, bounded), else the node's `margin` (LLM-Mesh's 10%, what
    replays use)."""
    learnt = getattr(times, "margin", None)
    return margin if learnt is None else learnt


@dataclass(slots=True)
class Padding:
    """The margin over a run of iterations on one node (module docstring): each iteration's
    share of DEFAULT_MARGIN adds up, the fluctuation above it adds in quadrature."""

    spread_sq: float = 0.0  # sum of ((margin - DEFAULT_MARGIN) * d)^2 so far

    def add(self, predicted_s: float, margin: float) -> float:
        """Seconds the next iteration (`predicted_s`, its instance's `margin`) adds to the run."""
        bias = min(margin, DEFAULT_MARGIN)
        before = math.sqrt(self.spread_sq)
        self.spread_sq += ((margin - bias) * predicted_s) ** 2
        return predicted_s * (1.0 + bias) + math.sqrt(self.spread_sq) - before


def _snapshot(
    compute: ComputeSubsystem, candidate: tuple[str, str, int, float, bool] | None, exclude: Collection[str] = (),
    margin: float = DEFAULT_MARGIN,
) -> list[_Sim]:
    sims = []
    flight = compute.in_flight
    for inst in compute.instances.values():
        if inst.instance_id in exclude:
            continue
        pending = [(r.request_id, r.prompt_len, r.ttft_deadline_s, r.resumed) for r in inst.pending.values()]
        if candidate is not None and candidate[0] == inst.instance_id:
            pending.append(candidate[1:])
        first = inst.running[0] if inst.running else None
        sim = _Sim(
            inst.instance_id, inst.times, inst.tpot, inst.prefill_token_budget, inst.ready_at,
            pending, len(inst.running), inst.context_sum, inst.decode_rounds,
            first.key if first else math.inf, first.request_id if first else None, compute.deadlines,
            margin=instance_margin(inst.times, margin), layers=inst.layers,
        )
        if flight is not None and flight.instance_id == inst.instance_id:
            _finish_in_flight(sim, flight.kind, flight.batch_size, compute.busy_until)
        sims.append(sim)
    return sims


def _finish_in_flight(s: _Sim, kind: IterationKind, batch_size: int, ends_s: float) -> None:
    """The iteration in flight (ending at busy_until, where the simulation starts) counts as
    done: its prefilled requests are decoding, or its decode round has happened. Without
    this the simulation would run it a second time and see requests late that are not."""
    if kind is IterationKind.PREFILL:
        for entry in s.pending[s.head : s.head + batch_size]:
            s.start_decoding(*entry, ends_s)
        s.head += batch_size
    elif s.n:
        s.rounds += 1
        s.ctx += s.n


def _simulate(
    sims: list[_Sim], t: float, candidate_id: str | None, until_s: float, max_iterations: int,
    free_until: float = -math.inf,
) -> _Outcome:
    """Token-level scheduling forward from `t`. Stops at the horizon described above, or,
    without a candidate, once simulated time reaches `until_s`. Iterations that start before
    `free_until` (the candidate's instance ready) do not count against `max_iterations`, up
    to FREE_ITERATIONS."""
    out = _Outcome()
    pad = Padding()
    waiting_decode: set[str] | None = None  # instances owed one decode after the last prefill
    prefills_left = sum(len(x.pending) - x.head for x in sims)  # the candidate's included
    deadlines = [x.next_deadline() for x in sims]  # inf: no work
    counted = free = 0
    while counted < max_iterations:
        if t < free_until and free < FREE_ITERATIONS:
            free += 1
        else:
            counted += 1
        pick, best, next_ready = -1, math.inf, math.inf
        for k, x in enumerate(sims):
            d = deadlines[k]
            if d == math.inf:
                continue
            if x.ready_at > t:
                next_ready = min(next_ready, x.ready_at)
            elif d < best:
                pick, best = k, d
        if pick < 0:
            if next_ready == math.inf:
                break
            t = next_ready
            continue
        s = sims[pick]
        if s.head < len(s.pending):  # prefill iteration
            take = prefill_take((e[1] for e in s.pending[s.head :]), s.budget, math.inf)
            batch = s.pending[s.head : s.head + take]
            tokens = sum(e[1] for e in batch)
            t = s.end_s(t, pad.add(s.times.prefill_s(tokens), s.margin))
            s.head += len(batch)
            for rid, prompt_len, deadline, resumed in batch:
                if rid == candidate_id:
                    out.candidate_late_s = t - deadline
                elif t > deadline:
                    out.late[rid] = (t - deadline, s.instance_id)
                s.start_decoding(rid, prompt_len, deadline, resumed, t)
                if rid == candidate_id:
                    out.candidate_first_token_s = t
            prefills_left -= len(batch)
            if candidate_id is not None and prefills_left <= 0 and waiting_decode is None:
                waiting_decode = {x.instance_id for x in sims if x.n}
        else:  # decode iteration: every running request gets a token
            t = s.end_s(t, pad.add(s.times.decode_s(s.n, s.ctx / s.n), s.margin))
            deadline = s.min_key + s.tpot * s.rounds
            if t > deadline and s.min_rid is not None and s.min_rid != candidate_id:
                late = out.late.get(s.min_rid, (0.0, ""))[0]
                out.late[s.min_rid] = (max(late, t - deadline), s.instance_id)
            s.rounds += 1
            s.ctx += s.n
            if waiting_decode is not None:
                waiting_decode.discard(s.instance_id)
        deadlines[pick] = s.next_deadline()
        if waiting_decode is not None and not waiting_decode:
            break
        if candidate_id is None and t >= until_s:
            break
    out.end_s = t
    return out


def decode_round_s(
    compute: ComputeSubsystem, instance_id: str, prompt_len: int, margin: float, exclude: Collection[str] = ()
) -> tuple[float, float]:
    """Case 3: (one decode iteration of every instance, the tightest TPOT SLO), with the
    candidate in `instance_id` and every waiting request counted as decoding. Instances in
    `exclude` are left out (as if preempted, LLM-Mesh 7.1)."""
    total, tpot, pad = 0.0, math.inf, Padding()
    for inst in compute.instances.values():
        if inst.instance_id in exclude:
            continue
        n = len(inst.running) + len(inst.pending)
        ctx = inst.context_sum + sum(r.prompt_len + 1 for r in inst.pending.values())
        if inst.instance_id == instance_id:
            n += 1
            ctx += prompt_len + 1
        if n:
            total += pad.add(inst.times.decode_s(n, ctx / n), instance_margin(inst.times, margin))
            tpot = min(tpot, inst.tpot)
    return total, tpot


def quick_reject(
    compute: ComputeSubsystem,
    instance_id: str,
    prompt_len: int,
    start_s: float,
    now: float,
    margin: float = DEFAULT_MARGIN,
    exclude: Collection[str] = (),
    own_late_ok: bool = False,
) -> Failure | None:
    """Cheap checks that fail exactly when shadow_validate would also fail, without the
    simulation: case 3 (the same computation), and case 1 against a lower bound (the
    candidate's prefill alone, started as early as the node and its instance allow; not with
    `own_late_ok`). The dispatcher calls it first; None means "run the full validation"."""
    inst = compute.instances[instance_id]
    deadline = start_s + inst.slo.ttft_s(prompt_len)
    earliest = (max(now, compute.busy_until, inst.ready_at)
                + Padding().add(inst.times.prefill_s(prompt_len), instance_margin(inst.times, margin)))
    if earliest > deadline and not own_late_ok:
        return Failure(FailureCase.OWN_PREFILL_LATE, earliest - deadline, None, instance_id)
    round_s, tpot = decode_round_s(compute, instance_id, prompt_len, margin, exclude)
    if round_s > tpot:
        return Failure(FailureCase.DECODE_ROUND_OVER_TPOT, round_s - tpot, None, instance_id)
    return None


def shadow_validate(
    compute: ComputeSubsystem,
    instance_id: str,
    request_id: str,
    prompt_len: int,
    start_s: float,
    now: float,
    margin: float = DEFAULT_MARGIN,
    exclude: Collection[str] = (),
    resumed: bool = False,
    own_late_ok: bool = False,
    handed_back: bool = False,
) -> Verdict:
    """Would adding this request to `instance_id` keep every SLO on the node? (5.3)

    `exclude`: instances simulated as gone, i.e. preempted first (proactive
    defragmentation, 7.1); their requests count neither for nor against the candidate.
    `resumed`: the candidate produced tokens elsewhere (ComputeSubsystem.add_request).
    `own_late_ok`: the candidate is served late, best effort (ServedRequest.best_effort): its
    own first token may be late (case 1 is not checked); everyone else's deadlines hold.
    `handed_back`: the candidate is load the cluster took on and then lost (its node died or
    gave it back: ServedRequest.handed_back_s), not new load. A request late anyway does not
    refuse it: case 2's guard against cascades keeps new load off a node that is behind,
    and refusing a handed-back request only fails it. One on time without it still does."""
    inst = compute.instances[instance_id]
    if instance_id in exclude:
        raise ValueError(f"instance {instance_id!r} cannot both take the request and be excluded")
    deadline = start_s + inst.slo.ttft_s(prompt_len)
    t0 = max(now, compute.busy_until)
    n_pending = sum(len(i.pending) for i in compute.instances.values())
    max_iterations = 256 + 8 * len(compute.instances) + 4 * n_pending
    sims = _snapshot(compute, (instance_id, request_id, prompt_len, deadline, resumed), exclude, margin)
    with_cand = _simulate(sims, t0, request_id, math.inf, max_iterations, inst.ready_at)

    failures: list[Failure] = []
    if own_late_ok:  # best effort: only the others' deadlines count
        pass
    elif with_cand.candidate_late_s > 0:
        failures.append(Failure(FailureCase.OWN_PREFILL_LATE, with_cand.candidate_late_s, request_id, instance_id))
    elif math.isnan(with_cand.candidate_first_token_s):
        # The horizon ran out before the candidate's prefill: it cannot be served in time.
        failures.append(Failure(FailureCase.OWN_PREFILL_LATE, math.inf, request_id, instance_id))
    if with_cand.late:
        # A request on time without the candidate and late with it counts against it. One
        # late anyway counts too if the candidate makes it later still and more than one
        # TPOT late: a node already behind must not take load that pushes it further
        # behind, or lateness cascades (each new request is "not newly late" for the
        # requests already late, and their delays grow without bound).
        base = _simulate(_snapshot(compute, None, exclude, margin), t0, None, with_cand.end_s, max_iterations,
                         inst.ready_at)
        newly_late = {
            rid: v for rid, v in with_cand.late.items()
            if rid not in base.late
            or (not handed_back and v[0] > base.late[rid][0] + _LATER_EPS_S
                and v[0] > compute.instances[v[1]].tpot)
        }
        if newly_late:
            rid, (by_s, where) = max(newly_late.items(), key=lambda kv: kv[1][0])
            failures.append(Failure(FailureCase.EXISTING_REQUEST_LATE, by_s, rid, where))
    round_s, tpot = decode_round_s(compute, instance_id, prompt_len, margin, exclude)
    if round_s > tpot:
        failures.append(Failure(FailureCase.DECODE_ROUND_OVER_TPOT, round_s - tpot, None, instance_id))
    return Verdict(tuple(failures), with_cand.candidate_first_token_s, round_s)
