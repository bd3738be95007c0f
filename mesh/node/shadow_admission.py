"""Shadow validation on a node (LLM-Mesh 5.3, 6.4, 7.1): may requests join an instance, a
new one included, without any request on the node missing its SLO, and does the memory hold
them? The admission part of the node runtime (mesh.node.runtime.NodeRuntime holds one); it
changes nothing: the runtime's `admit` acts on its answer.
"""
from __future__ import annotations

from typing import Callable, Collection, Mapping, Sequence

from mesh.node.node_instance import NodeInstance
from mesh.policy.admission import Admission, InstancePlan
from mesh.policy.compute import ComputeSubsystem
from mesh.policy.kv_demand import recommend_bytes
from mesh.policy.memory import InstanceMemory, MemoryPlan, MemorySubsystem
from mesh.policy.shadow import Verdict, quick_reject, shadow_validate
from mesh.policy.slo import Deadlines
from mesh.wire.served_request import ServedRequest


class ShadowAdmission:
    """Both subsystems' checks of requests on the node's instances."""

    def __init__(
        self,
        compute: ComputeSubsystem,
        memory: MemorySubsystem,
        instances: Mapping[str, NodeInstance],
        carried: Mapping[str, int],
        clock: Callable[[], float],
        margin: float,
    ) -> None:
        """`instances` and `carried` are the runtime's, read here: the node's instances, and
        the tokens each request produced before it came to this node. `clock`: the event
        loop's time. `margin`: how much each predicted iteration is overestimated (5.3)."""
        self.compute = compute
        self.memory = memory
        self.instances = instances
        self._carried = carried
        self._clock = clock
        self.margin = margin

    def demand(self, instance_id: str) -> list[tuple[int, int]]:
        """(I_r, O_r) of every request on the instance (Eq. 2); a resumed request's input
        includes the tokens it produced before it came here (they are prefilled again)."""
        carried = self._carried
        return [
            (r.prompt_len + carried.get(rid, 0), self.compute.tokens_out(rid))
            for rid, r in self.instances[instance_id].requests.items()
        ]

    def validate(
        self,
        instance_id: str,
        req: ServedRequest,
        *,
        compute: bool = True,
        exclude: Collection[str] = (),
        done: int | None = None,
        deadlines: Deadlines | None = None,
    ) -> Admission:
        """Shadow validation on both subsystems (5.3, 6.4); changes nothing.

        compute=False checks memory only (the baselines, which queue rather than validate).
        exclude: instances on this node validated as gone (preempted first, 7.1).
        done: tokens the request already produced (default: req.tokens_out).
        deadlines: where its deadlines run from, if not its own."""
        inst = self.instances[instance_id]
        done = req.tokens_out if done is None else done
        prompt, start = req.resumed(done, self.compute.deadlines, deadlines)
        if prompt + 1 > inst.engine.context_window:
            return Admission(False,
                             refusal=f"prompt of {prompt} tokens exceeds the context window of "
                                     f"{inst.engine.context_window}")
        if inst.batch_size >= inst.engine.max_batch:
            return Admission(False,
                             refusal=f"instance {instance_id} holds its maximum batch of {inst.engine.max_batch}")
        freed = sum(self.memory.station.size(i) for i in exclude)
        plan = self.memory.plan_admission(instance_id, [*self.demand(instance_id), (prompt, 0)], freed)
        if not plan.ok or not compute:
            return Admission(plan.ok, memory=plan)
        now = self._clock()
        quick = quick_reject(self.compute, instance_id, prompt, start, now, self.margin, exclude,
                             own_late_ok=req.best_effort)
        if quick is not None:
            return Admission(False, Verdict((quick,)), plan)
        verdict = shadow_validate(self.compute, instance_id, req.request_id, prompt, start, now, self.margin, exclude,
                                  resumed=done > 0, own_late_ok=req.best_effort,
                                  handed_back=req.handed_back_s is not None)
        return Admission(verdict.ok, verdict, plan)

    def validate_group(self, instance_id: str, reqs: Sequence[ServedRequest], done: Sequence[int]) -> Admission:
        """Would all of `reqs` (having produced `done` tokens each) fit this instance, added
        one after another? Used to check where preempted requests go (7.1). Changes nothing."""
        pairs = [r.resumed(d, self.compute.deadlines) for r, d in zip(reqs, done, strict=True)]
        inst = self.instances[instance_id]
        window = inst.engine.context_window
        if any(p + 1 > window for p, _ in pairs):
            return Admission(False, refusal=f"a prompt exceeds the context window of {window}")
        if inst.batch_size + len(reqs) > inst.engine.max_batch:
            return Admission(False, refusal=f"instance {instance_id} would exceed its maximum batch "
                                            f"of {inst.engine.max_batch}")
        plan = self.memory.plan_admission(instance_id, [*self.demand(instance_id), *((p, 0) for p, _ in pairs)])
        if not plan.ok:
            return Admission(False, memory=plan)
        verdict = self._validate_sequence(instance_id, reqs, pairs, done)
        return Admission(verdict.ok, verdict, plan)

    def validate_new(self, plan: InstancePlan, reqs: Sequence[ServedRequest],
                     done: Sequence[int] | None = None, *, deadlines: Sequence[Deadlines] | None = None) -> Admission:
        """Would a new instance started now (cold start `plan.expected_load_s`) serve all of
        `reqs` within SLO (with `deadlines` in place of their own, if given), and does the
        node have the memory for it? Changes nothing."""
        done = [r.tokens_out for r in reqs] if done is None else done
        moved = [None] * len(reqs) if deadlines is None else deadlines
        pairs = [r.resumed(d, self.compute.deadlines, m) for r, d, m in zip(reqs, done, moved, strict=True)]
        if any(p + 1 > plan.context_window for p, _ in pairs):
            return Admission(False, refusal=f"a prompt exceeds the context window of {plan.context_window}")
        if len(reqs) > plan.max_batch:
            return Admission(False, refusal=f"{len(reqs)} requests exceed the maximum batch of {plan.max_batch}")
        mem = InstanceMemory(plan.instance_id, plan.kv_bytes_per_token, plan.weight_bytes, plan.context_window,
                             plan.mean_output)
        need = plan.weight_bytes + max(
            recommend_bytes(mem.require(()), self.memory.watermark), mem.require([(p, 0) for p, _ in pairs])
        )
        station = self.memory.station
        if not station.can_resize(plan.instance_id, need):
            short = need - station.size(plan.instance_id) - station.free()
            return Admission(False, memory=MemoryPlan(False, shortfall_bytes=short))
        self.compute.add_instance(
            plan.instance_id, plan.times, plan.slo, plan.prefill_token_budget,
            ready_at=self._clock() + plan.expected_load_s, loaded=False,
        )
        try:
            verdict = self._validate_sequence(plan.instance_id, reqs, pairs, done)
        finally:
            self.compute.remove_instance(plan.instance_id)
        return Admission(verdict.ok, verdict, MemoryPlan(True))

    def _validate_sequence(
        self, instance_id: str, reqs: Sequence[ServedRequest], pairs: list[tuple[int, float]], done: Sequence[int]
    ) -> Verdict:
        """Shadow-validate each request with the ones before it tentatively added."""
        added: list[str] = []
        now = self._clock()
        try:
            verdict = Verdict()
            for req, (prompt, start), d in zip(reqs, pairs, done):
                quick = quick_reject(self.compute, instance_id, prompt, start, now, self.margin,
                                     own_late_ok=req.best_effort)
                if quick is not None:
                    verdict = Verdict((quick,))
                    break
                verdict = shadow_validate(self.compute, instance_id, req.request_id, prompt, start, now, self.margin,
                                          resumed=d > 0, own_late_ok=req.best_effort,
                                          handed_back=req.handed_back_s is not None)
                if not verdict.ok:
                    break
                self.compute.add_request(instance_id, req.request_id, prompt, start, resumed=d > 0)
                added.append(req.request_id)
        finally:
            for rid in added:
                self.compute.remove_request(rid)
        return verdict
