"""Placement policies behind one interface, chosen by name.

- `mesh`: LLM-Mesh (4, 7): candidate instances CPU first and highest batch first (7.2),
  validated on both subsystems (5.3, 6.4); if all fail, proactive defragmentation (7.1);
  then a new instance on a node that validates, with its cold start; failing that, if the
  cold start alone stands in the way, a warm-up instance for the requests to come
  (dispatch_rules.warm_up_allowed), while the request itself waits or is turned away by the
  queue's rule. Instances share nodes.
- `mesh-no-share`, `mesh-no-cpu`, `mesh-no-defrag`: the ablations of 8.3 (one instance per
  node; GPU nodes only; no preemption and spread instead of bin-packing).
- `sllm`, `sllm+cpu`: ServerlessLLM as the paper ran it (8.1): a whole node per instance,
  first-fit, scale out when an instance's in-flight requests reach its concurrency target;
  requests are not validated, they wait. `sllm` uses GPU nodes only.

Keep-alive recycling and the bounded waiting queue are common (mesh.control.dispatcher,
mesh.control.fleet).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence, TypeVar

from mesh.control.cluster_node import ClusterNode
from mesh.control.fleet import Fleet, InstanceRef, unable_nodes
from mesh.control.plans import (
    Admit,
    ExistingHome,
    FitsGroup,
    FitsInstance,
    FitsNew,
    Home,
    Move,
    NewHome,
    Placement,
    Plan,
    Planning,
    Preemption,
    ScaleOut,
)
from mesh.policy.dispatch_rules import (
    CONCURRENCY_TARGETS,
    CPU,
    GPU,
    MAX_WARMING_PER_MODEL,
    SERVE_LATE,
    candidate_order,
    concurrency_target,
    new_instance_order,
    queue_expiry_s,
    sllm_pick,
    tailored_concurrency_target,
    victim_order,
    warm_up_allowed,
    warm_up_node_allowed,
)
from mesh.policy.shadow import Padding
from mesh.wire.served_request import ServedRequest

log = logging.getLogger(__name__)
T = TypeVar("T")


class UnknownScheduler(ValueError):
    pass


@dataclass(frozen=True)
class SchedulerSpec:
    name: str
    family: str  # "mesh" | "sllm"
    kinds: tuple[str, ...]  # node kinds it uses, in preference order
    share: bool = True  # several instances per node
    defrag: bool = True  # proactive (7.1) and reactive (7.2) defragmentation
    description: str = ""


POLICIES: dict[str, SchedulerSpec] = {
    p.name: p
    for p in (
        SchedulerSpec("mesh", "mesh", (CPU, GPU),
                      description="LLM-Mesh: shared CPU and GPU nodes, shadow validation, defragmentation"),
        SchedulerSpec("sllm", "sllm", (GPU,), share=False, defrag=False,
                   description="ServerlessLLM: GPU nodes only, a whole node per instance, "
                               "concurrency-target scale-out"),
        SchedulerSpec("sllm+cpu", "sllm", (CPU, GPU), share=False, defrag=False,
                   description="ServerlessLLM also using CPU nodes"),
        SchedulerSpec("mesh-no-share", "mesh", (CPU, GPU), share=False, description="Mesh with one instance per node"),
        SchedulerSpec("mesh-no-cpu", "mesh", (GPU,), description="Mesh on GPU nodes only"),
        SchedulerSpec("mesh-no-defrag", "mesh", (CPU, GPU), defrag=False,
                   description="Mesh without preemption, spreading requests over a model's instances"),
    )
}


def scheduler_spec(name: str) -> SchedulerSpec:
    if name not in POLICIES:
        raise UnknownScheduler(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}")
    return POLICIES[name]


@dataclass
class SchedulerStats:
    new_instances: int = 0
    preemptions: int = 0  # instances preempted (7.1)
    preempted_requests: int = 0  # requests moved by preemption
    validations: int = 0  # candidate checks made
    warm_ups: int = 0  # instances started for a request their cold start could not serve in time
    served_late: int = 0  # requests admitted late on a loading instance (dispatch_rules.SERVE_LATE)


@dataclass
class Scheduler:
    """One placement policy over a cluster: `place` a request or report that it cannot."""

    spec: SchedulerSpec
    cluster: Fleet
    reschedule: Callable[[ServedRequest], None]
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    validates = True  # checks requests by shadow validation (else they queue, as sllm)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.spec.kinds

    async def place(self, req: ServedRequest, now: float, avoid: frozenset[str] = frozenset()) -> bool:
        """Place `req` now (the dispatcher's clock), never on nodes in `avoid`; False if it cannot."""
        raise NotImplementedError

    async def prestart(self, model: str) -> InstanceRef | None:
        """Start an instance of `model` holding no request (a warm start, e.g. the service's
        demo model) on the first node a new instance of it would go to
        (dispatch_rules.new_instance_order) that can host it; None if no node can now."""
        views = self.cluster.node_views()
        for nv in new_instance_order(views, self.kinds, exclusive=not self.spec.share,
                                     exclude=self.cluster.hosts(model), holding=self.cluster.holding(model)):
            node = self.cluster.node(nv.node_id)
            if self.cluster.can_host(model, node):
                ref = await self.cluster.start_instance(self.cluster.plan(model, node), node)
                if ref is not None:
                    return ref
        return None


@dataclass
class MeshScheduler(Scheduler):
    """LLM-Mesh and its ablations (4, 7, 8.3). Each step plans (mesh.control.plans: reading the
    books and asking the nodes' checks, changing nothing), then commits its plan."""

    async def place(self, req: ServedRequest, now: float, avoid: frozenset[str] = frozenset()) -> bool:
        """Candidates, then preemption, then a new instance (4); never on nodes in `avoid`
        (one that just evicted the request for lack of memory, 6.4)."""
        refs = [r for r in self.cluster.instances_of(req.model) if r.node.node_id not in avoid]
        by_id = {r.instance_id: r for r in refs}
        views = [r.view() for r in refs]
        candidates = [Admit(by_id[v.instance_id]) for v in candidate_order(views, defrag=self.spec.defrag)]
        if candidates and await self.commit(Placement(req, tuple(candidates))):
            return True
        if self.spec.defrag and self.spec.share and views:
            preemption = await self._answer(self.plan_preemption(req, refs))
            # a preemption that did not place it after all: a new instance anywhere, then as below
            if preemption is not None and (await self.commit(preemption) or await self._scale_out(req, now)):
                return True
        return await self._scale_out(req, now, avoid)

    async def _answer(self, planning: Planning[T]) -> T:
        """Run a planning step, each check it yields answered by its node."""
        try:
            check = next(planning)
            while True:
                self.stats.validations += 1
                check = planning.send((await check.ask()).ok)
        except StopIteration as end:
            return end.value

    # -- a new instance (4) -------------------------------------------------------------
    async def _scale_out(self, req: ServedRequest, now: float, avoid: frozenset[str] = frozenset()) -> bool:
        """A new instance that serves `req` in time; else a warm-up for the requests to come,
        and `req` served late if its model's choice says so."""
        exclude = self.cluster.hosts(req.model) | avoid
        home = await self._answer(self.plan_new_home(req.model, (req,), (req.tokens_out,), exclude))
        if home is not None:
            return await self.commit(ScaleOut(home, (req,)))
        await self._warm_up(req, exclude, now)
        late = self.plan_serve_late(req, avoid, now)
        return late is not None and await self.commit(late)

    def plan_serve_late(self, req: ServedRequest, avoid: frozenset[str], now: float) -> Placement | None:
        """Its model cold (an instance of it loading, none that could make its TTFT) and its
        choice SERVE_LATE (dispatch_rules): admit a fresh request on the loading instance ready
        first, its deadlines moved to that instance's predicted ready time (now, if the load
        runs over its prediction), if the node's shadow validation shows everyone else there
        still on time (5.3 cases 2 and 3) and its own prefill on time from then (case 1). A
        fresh request that reached the dispatcher already past its TTFT (late on arrival: the
        live service tokenizes before placing, and a cold model's tokenizer is built first) is
        admitted the same way on an instance of its model that is loaded, its deadlines running
        from now. A request whose node was lost counts as fresh here, its progress kept: an
        instance loads for it too."""
        started = (req.tokens_out or req.first_token_s is not None) and not req.lost
        if self.cluster.cold_start_choice(req.model) != SERVE_LATE or started:
            return None
        refs = [r for r in self.cluster.instances_of(req.model) if r.node.node_id not in avoid]
        # a load running over its prediction ends no sooner than now: deadlines from then
        tries = [Admit(ref, req.deadlines.from_at_least(max(ref.ready_at, now)))
                 for ref in sorted((r for r in refs if not r.inst.loaded), key=lambda r: r.ready_at)]
        if self._late_on_arrival(req, now):
            by_id = {r.instance_id: r for r in refs}
            from_now = req.deadlines.from_at_least(now)
            tries += [Admit(by_id[v.instance_id], from_now)
                      for v in candidate_order([r.view() for r in refs if r.inst.loaded], defrag=self.spec.defrag)]
        return Placement(req, tuple(tries), late=True) if tries else None

    def _late_on_arrival(self, req: ServedRequest, now: float) -> bool:
        """A fresh request placed for the first time (it never waited in the queue) that can no
        longer meet its TTFT: what the queue would turn away at once."""
        if req.tokens_out or req.first_token_s is not None or req.waited:
            return False
        prompt, start = req.resumed(0, self.cluster.config.deadlines)
        deadline = start + req.slo.ttft_s(prompt)
        return now >= queue_expiry_s(deadline, self.cluster.fastest_prefill_s(req.model, prompt, self.kinds))

    async def _warm_up(self, req: ServedRequest, exclude: set[str], now: float) -> None:
        """No new instance would serve `req` in time: start one anyway, holding no request
        (`plan_warm_up`), on the first node in `_warm_up_order` whose memory takes it."""
        nodes = self._warm_up_order(req.model, exclude)
        while nodes:
            plan = await self._answer(self.plan_warm_up(req, nodes, now))
            if plan is None or await self.commit(plan):
                return
            nodes = nodes[nodes.index(plan.home.node) + 1:]

    def _warm_up_order(self, model: str, exclude: set[str]) -> list[ClusterNode]:
        """The nodes a warm-up of `model` may go to, ready first: the fewest loads under way
        and no transfer (stable: bin-packing order among equals)."""
        order = [self.cluster.node(nv.node_id) for nv in new_instance_order(
            self.cluster.node_views(), self.kinds, exclusive=not self.spec.share, exclude=exclude,
            holding=self.cluster.holding(model))]
        return sorted(order, key=lambda n: self.cluster.load_wait_s(n) + self.cluster.transfer_s(model, n))

    def plan_warm_up(self, req: ServedRequest, nodes: list[ClusterNode], now: float) -> Planning[ScaleOut | None]:
        """A warm-up on the first of `nodes` where a new instance would serve `req` if it were
        already loaded, when dispatch_rules.warm_up_allowed says so (the cold start is longer than
        any request of this prompt length could wait, it is the only obstacle, and no other
        instance of the model is loading)."""
        instances = self.cluster.instances_of(req.model)
        warming = sum(1 for r in instances if not r.inst.loaded)
        if warming >= MAX_WARMING_PER_MODEL:
            return None
        prompt, _ = req.resumed(req.tokens_out, self.cluster.config.deadlines)
        # the model has no instance: validated as if it arrived now, since what a fresh request
        # waited before its placement (the service builds a cold model's tokenizer to tokenize
        # it, seconds) is cold start too, not a reason to leave the model cold
        fresh = req.tokens_out == 0 and req.first_token_s is None and not instances
        deadlines = (req.deadlines.from_at_least(now),) if fresh else None
        for node in nodes:
            if not self.cluster.can_host(req.model, node):
                log.debug("no warm-up of %s on %s for %s: it cannot host it", req.model, node.node_id, req.request_id)
                continue
            if not warm_up_node_allowed(node.kind, bool(node.instances), bool(instances)):
                log.debug("no warm-up of %s on %s for %s: its build would take the cores of the instances there",
                          req.model, node.node_id, req.request_id)
                continue
            cold = self.cluster.expected_load_s(req.model, node)
            times = self.cluster.catalog[self.cluster.models[req.model]].times[node.spec.kind]
            slack = req.slo.ttft_s(prompt) - Padding().add(times.prefill_s(prompt), node.margin)
            if not warm_up_allowed(cold, slack, True, warming):
                log.debug("no warm-up of %s on %s for %s: cold start %.2f s fits the slack %.2f s", req.model,
                          node.node_id, req.request_id, cold, slack)
                continue  # a fresh request would start an instance here the usual way
            plan = self.cluster.plan(req.model, node)
            ok = yield FitsNew(node, replace(plan, expected_load_s=0.0), (req,), (req.tokens_out,), deadlines)
            if not warm_up_allowed(cold, slack, ok, warming):
                log.debug("no warm-up of %s on %s for %s: cold start %.2f s, slack %.2f s, validates loaded %s",
                          req.model, node.node_id, req.request_id, cold, slack, ok)
                continue
            return ScaleOut(NewHome(node, plan))
        return None

    def plan_new_home(self, model: str, reqs: tuple[ServedRequest, ...], done: tuple[int, ...],
                       exclude: set[str]) -> Planning[NewHome | None]:
        """The first node (dispatch_rules.new_instance_order) where a new instance of `model`
        would serve all of `reqs` within SLO, counting its cold start."""
        views = self.cluster.node_views()
        for nv in new_instance_order(views, self.kinds, exclusive=not self.spec.share, exclude=exclude,
                                     holding=self.cluster.holding(model)):
            node = self.cluster.node(nv.node_id)
            if not self.cluster.can_host(model, node):
                continue
            plan = self.cluster.plan(model, node)
            if (yield FitsNew(node, plan, reqs, done)):
                return NewHome(node, plan)
        return None

    # -- proactive defragmentation (7.1) --------------------------------------------------
    def plan_preemption(self, req: ServedRequest, refs: list[InstanceRef]) -> Planning[Preemption | None]:
        """Fit `req` into one of its model's instances `refs` by preempting lower-batch
        neighbours (lowest first), only if the preempted requests validate where they would go."""
        by_id = {r.instance_id: r for r in refs}
        for x in candidate_order([r.view() for r in refs]):
            node = by_id[x.instance_id].node
            on_node = {r.instance_id: r for r in self.cluster.instances_on(node)}
            neighbours = [r.view() for r in on_node.values()]
            # An instance in the middle of an iteration is not preempted (it is stopped).
            victims = [v for v in victim_order(x, neighbours) if v.instance_id != node.stepping]
            if not victims:
                continue
            if not (yield FitsInstance(node, x.instance_id, req, tuple(v.instance_id for v in victims))):
                continue  # even preempting every candidate would not make room
            moves: list[Move] = []
            used = {node.node_id}
            for y in victims:
                yref = on_node[y.instance_id]
                group = tuple(yref.requests.values())
                done = tuple(node.progress(q.request_id) for q in group)
                home = yield from self.plan_home(y.model, group, done, used | unable_nodes(self.cluster.nodes, group))
                if home is None:
                    continue
                moves.append(Move(yref, group, done, home))
                used.add(home.node.node_id)
                if (yield FitsInstance(node, x.instance_id, req, tuple(m.instance.instance_id for m in moves))):
                    return Preemption(req, by_id[x.instance_id], tuple(moves))
        return None

    def plan_home(self, model: str, group: tuple[ServedRequest, ...], done: tuple[int, ...],
                   used: set[str]) -> Planning[Home | None]:
        """An instance of `model` on another node where all of `group` validate: an
        existing one (highest batch first), else a new one."""
        refs = {r.instance_id: r for r in self.cluster.instances_of(model) if r.node.node_id not in used}
        for v in candidate_order([r.view() for r in refs.values()]):
            ref = refs[v.instance_id]
            if (yield FitsGroup(ref.node, v.instance_id, group, done)):
                return ExistingHome(ref.node, ref)
        return (yield from self.plan_new_home(model, group, done, used | self.cluster.hosts(model)))

    # -- the commit step ------------------------------------------------------------------
    async def commit(self, plan: Plan) -> bool:
        """Carry out `plan` against the nodes; True if its request was placed (a warm-up: if
        its instance started)."""
        log.debug("plan: %s", plan)
        if isinstance(plan, Placement):
            return await self._admit_first(plan)
        if isinstance(plan, Preemption):
            return await self._preempt(plan)
        if not plan.requests:  # a warm-up
            if await self.cluster.start_instance(plan.home.plan, plan.home.node) is None:
                return False
            self.stats.new_instances += 1
            self.stats.warm_ups += 1  # if unused, recycled keep-alive after its load ends (Fleet.note_idle)
            return True
        return await self._start_and_admit(plan.home, plan.requests) == []

    async def _admit_first(self, plan: Placement) -> bool:
        req = plan.request
        for t in plan.tries:
            self.stats.validations += 1
            ref = t.instance
            if (await ref.node.try_admit(ref.instance_id, req, deadlines=t.deadlines)).ok:
                if plan.late:
                    self.stats.served_late += 1
                    log.debug("%s served late on %s (deadlines %.2f s later)", req.request_id, ref.instance_id,
                              req.late_s)
                return True
            if plan.late:
                log.debug("%s not served late on %s: refused", req.request_id, ref.instance_id)
        return False

    async def _start_and_admit(self, home: Home, reqs: Sequence[ServedRequest]) -> list[ServedRequest]:
        """Start the home's instance if new and admit `reqs`; returns those not admitted."""
        if isinstance(home, ExistingHome):
            ref = home.ref
        else:
            started = await self.cluster.start_instance(home.plan, home.node)
            if started is None:
                return list(reqs)
            self.stats.new_instances += 1
            ref = started
        left = [q for q in reqs if not (await home.node.try_admit(ref.instance_id, q)).ok]
        if isinstance(home, NewHome) and not ref.requests:
            await self.cluster.stop_instance(ref)  # started for nothing
        return left

    async def _preempt(self, plan: Preemption) -> bool:
        """Preempt the moves' instances, admit the request, and move their requests to their
        homes (rescheduled through the dispatcher if a home no longer validates)."""
        target = plan.target
        node = target.node
        moved: list[list[ServedRequest]] = []
        for move in plan.moves:
            taken = [q for q in [await node.take_back(q.request_id, f"preempted by {target.instance_id} (7.1)")
                                 for q in move.requests] if q is not None]
            moved.append(taken)
            if not move.instance.requests:
                await self.cluster.stop_instance(move.instance)
            self.stats.preemptions += 1
            self.stats.preempted_requests += len(taken)
        placed = (await node.try_admit(target.instance_id, plan.request)).ok
        for move, group in zip(plan.moves, moved):
            for q in await self._start_and_admit(move.home, group):
                self.reschedule(q)
        return placed


@dataclass
class SllmScheduler(Scheduler):
    """ServerlessLLM (8.1): whole node per instance, first-fit, concurrency targets."""

    def __post_init__(self) -> None:
        # base model -> (its spec, node kind -> target): models come and go, and a model's spec
        # is replaced when it gains a kind of node (the service's prepared formats)
        self._targets: dict[str, tuple[object, dict[str, int]]] = {}

    def _targets_of(self, base: str) -> dict[str, int]:
        spec = self.cluster.catalog[base]
        known = self._targets.get(base)
        if known is None or known[0] is not spec:
            known = self._targets[base] = (spec, {k: self._target(base, k) for k in self.spec.kinds
                                                  if k in spec.profiles})
        return known[1]

    def _target(self, base: str, kind: str) -> int:
        """The paper's target (8.1), else one tailored to the model's profile on that kind
        of node, at the profile's mid-window context."""
        if base in CONCURRENCY_TARGETS[kind]:
            return concurrency_target(base, kind)
        spec = self.cluster.catalog[base]
        context = spec.profiles[kind].max_context / 2
        return tailored_concurrency_target(lambda b: spec.times[kind].decode_s(b, context),
                                           self.cluster.config.slo.tpot_s)

    validates = False

    async def place(self, req: ServedRequest, now: float, avoid: frozenset[str] = frozenset()) -> bool:
        refs = [r for r in self.cluster.instances_of(req.model) if r.node.node_id not in avoid]
        targets = self._targets_of(self.cluster.models[req.model])
        by_id = {r.instance_id: r for r in refs}
        views = [r.view() for r in refs]
        while views:
            v = sllm_pick(views, targets)
            if v is None:
                break
            self.stats.validations += 1
            if (await by_id[v.instance_id].node.try_admit(v.instance_id, req, compute=False)).ok:
                return True
            views = [w for w in views if w.instance_id != v.instance_id]  # memory full: next
        # Scale out: the first free node (first-fit, CPU first) that can hold the model.
        for nv in new_instance_order(self.cluster.node_views(), self.kinds, exclusive=True, exclude=avoid,
                                     holding=self.cluster.holding(req.model)):
            node = self.cluster.node(nv.node_id)
            if not self.cluster.can_host(req.model, node):
                continue
            ref = await self.cluster.start_instance(self.cluster.plan(req.model, node), node)
            if ref is None:
                continue
            self.stats.new_instances += 1
            if (await node.try_admit(ref.instance_id, req, compute=False)).ok:
                return True
            await self.cluster.stop_instance(ref)
        return False


def make_scheduler(name: str, cluster: Fleet, reschedule: Callable[[ServedRequest], None]) -> Scheduler:
    spec = scheduler_spec(name)
    cls = MeshScheduler if spec.family == "mesh" else SllmScheduler
    return cls(spec, cluster, reschedule)
