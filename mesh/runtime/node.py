"""The node runtime: one node's compute and memory subsystems driving its engine instances.

An asyncio task runs the token-level loop (LLM-Mesh 5.1): ask the compute subsystem which
instance is most urgent, run one iteration of its engine, apply what it produced, repeat.
Memory operations (6.3) run as their own tasks when the reservation station starts them,
and report back when they finish. Time comes only from the event loop, so the same code
runs live and, on mesh.runtime.virtual_loop, in virtual time.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Callable

from engines.protocol import Engine, EngineError, IterationKind, StepResult
from mesh.policy.compute import ComputeSubsystem, IterationTimes
from mesh.policy.kv_demand import DEFAULT_WATERMARK, RunningMean
from mesh.policy.memory import InstanceMemory, MemoryPlan, MemorySubsystem
from mesh.policy.reservation import Issued, MemoryOp, OpKind
from mesh.policy.shadow import DEFAULT_MARGIN, Verdict, shadow_validate
from mesh.policy.slo import SLO
from mesh.runtime.request import Outcome, ServedRequest


@dataclass(frozen=True, slots=True)
class NodeSpec:
    node_id: str
    kind: str  # "cpu" or "gpu"
    memory_bytes: int


@dataclass(eq=False)
class NodeInstance:
    instance_id: str
    model: str
    engine: Engine
    slo: SLO
    memory: InstanceMemory
    requests: dict[str, ServedRequest] = field(default_factory=dict)
    loaded: bool = False
    idle_since: float = 0.0  # when it last became empty (keep-alive, LLM-Mesh 4)

    @property
    def batch_size(self) -> int:
        return len(self.requests)


@dataclass(frozen=True, slots=True)
class Admission:
    """Both subsystems' answer to "may this request join this instance?" (LLM-Mesh 4)."""

    ok: bool
    compute: Verdict | None = None
    memory: MemoryPlan | None = None
    refusal: str = ""

    def reason(self) -> str:
        if self.ok:
            return "ok"
        if self.refusal:
            return self.refusal
        if self.memory is not None and not self.memory.ok:
            return self.memory.reason()
        return self.compute.reason() if self.compute is not None else "refused"


@dataclass(frozen=True, slots=True)
class IterationRecord:
    instance_id: str
    kind: IterationKind
    batch_size: int
    start_s: float
    duration_s: float
    predicted_s: float


class NodeRuntime:
    def __init__(
        self,
        spec: NodeSpec,
        *,
        margin: float = DEFAULT_MARGIN,
        watermark: float = DEFAULT_WATERMARK,
        on_evict: Callable[[ServedRequest], None] | None = None,
        record_iterations: bool = False,
    ) -> None:
        self.spec = spec
        self.margin = margin
        self.compute = ComputeSubsystem()
        self.memory = MemorySubsystem(spec.memory_bytes, watermark)
        self.instances: dict[str, NodeInstance] = {}
        self.on_evict = on_evict
        self.iterations: list[IterationRecord] | None = [] if record_iterations else None
        self.iteration_count = 0
        self.busy_s = 0.0
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._unloading: dict[str, NodeInstance] = {}

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name=f"node {self.node_id}")

    async def stop(self) -> None:
        tasks = [t for t in [self._loop_task, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # -- instances -----------------------------------------------------------------
    def instance_memory(self, instance_id: str, engine: Engine, mean_output: RunningMean) -> InstanceMemory:
        return InstanceMemory(instance_id, engine.kv_bytes_per_token, engine.weight_bytes, engine.context_window, mean_output)

    def can_start(self, instance_id: str, engine: Engine, mean_output: RunningMean) -> bool:
        return self.memory.can_load(self.instance_memory(instance_id, engine, mean_output))

    def start_instance(
        self,
        instance_id: str,
        model: str,
        engine: Engine,
        times: IterationTimes,
        slo: SLO,
        mean_output: RunningMean,
        expected_load_s: float,
    ) -> Issued:
        """Issue the model load; the instance is scheduled once the load completes.
        `expected_load_s` is what shadow validation assumes until then."""
        mem = self.instance_memory(instance_id, engine, mean_output)
        issued = self.memory.load(mem)
        if not issued.accepted:
            return issued
        now = self._now()
        self.instances[instance_id] = NodeInstance(instance_id, model, engine, slo, mem, idle_since=now)
        self.compute.add_instance(
            instance_id, times, slo, engine.prefill_token_budget, ready_at=now + expected_load_s, loaded=False
        )
        self._launch(issued.started)
        return issued

    def stop_instance(self, instance_id: str) -> None:
        """Recycle an idle instance: unload its weights and KV cache."""
        inst = self.instances[instance_id]
        if inst.requests:
            raise ValueError(f"instance {instance_id!r} still serves {len(inst.requests)} requests")
        self.compute.remove_instance(instance_id)
        del self.instances[instance_id]
        self._unloading[instance_id] = inst
        self._launch(self.memory.unload(instance_id).started)

    def _launch(self, ops: tuple[MemoryOp, ...] | list[MemoryOp]) -> None:
        loop = asyncio.get_running_loop()
        for op in ops:
            task = loop.create_task(self._execute(op))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _execute(self, op: MemoryOp) -> None:
        inst = self.instances.get(op.holder) or self._unloading[op.holder]
        kind = op.kind
        try:
            if kind is OpKind.LOAD:
                await inst.engine.load()
            if kind is OpKind.UNLOAD:
                await inst.engine.unload()
            else:
                await inst.engine.resize_kv(op.new_bytes - inst.memory.weight_bytes)
        except Exception as exc:  # an engine failed a memory operation: its requests fail
            self._fail_instance(inst, f"{kind.value} failed on node {self.node_id}: {exc}")
        finally:
            started = self.memory.station.complete(op.op_id)
        if kind is OpKind.LOAD and op.holder in self.instances:
            inst.loaded = True
            self.compute.set_loaded(op.holder, self._now())
            self._wake.set()
        if kind is OpKind.UNLOAD:
            self._unloading.pop(op.holder, None)
        self._launch(started)

    # -- admission -----------------------------------------------------------------
    def demand(self, instance_id: str) -> list[tuple[int, int]]:
        """(I_r, O_r) of every request on the instance (Eq. 2)."""
        return [(r.prompt_len, self.compute.tokens_out(rid)) for rid, r in self.instances[instance_id].requests.items()]

    def validate(self, instance_id: str, req: ServedRequest) -> Admission:
        """Shadow validation on both subsystems (5.3, 6.4); changes nothing."""
        inst = self.instances[instance_id]
        if req.prompt_len + 1 > inst.engine.context_window:
            return Admission(False, refusal=f"prompt of {req.prompt_len} tokens exceeds the context window of {inst.engine.context_window}")
        if inst.batch_size >= inst.engine.max_batch:
            return Admission(False, refusal=f"instance {instance_id} holds its maximum batch of {inst.engine.max_batch}")
        plan = self.memory.plan_admission(instance_id, [*self.demand(instance_id), (req.prompt_len, 0)])
        if not plan.ok:
            return Admission(False, memory=plan)
        verdict = shadow_validate(self.compute, instance_id, req.request_id, req.prompt_len, req.arrival_s, self._now(), self.margin)
        return Admission(verdict.ok, verdict, plan)

    def admit(self, instance_id: str, req: ServedRequest, admission: Admission) -> None:
        """Add a validated request to the instance (engine, compute and memory state)."""
        inst = self.instances[instance_id]
        inst.engine.add_request(req.engine_request)  # raises EngineError before any state changes
        if admission.memory is not None and admission.memory.kv_bytes is not None:
            issued = self.memory.resize_kv(instance_id, admission.memory.kv_bytes)
            self._launch(issued.started)
        self.compute.add_request(instance_id, req.request_id, req.prompt_len, req.arrival_s)
        inst.requests[req.request_id] = req
        req.node_id, req.instance_id = self.node_id, instance_id
        self._wake.set()

    def try_admit(self, instance_id: str, req: ServedRequest) -> Admission:
        admission = self.validate(instance_id, req)
        if admission.ok:
            self.admit(instance_id, req, admission)
        return admission

    def abort(self, request_id: str, outcome: Outcome, detail: str) -> ServedRequest | None:
        """Take a request off this node (client gone, eviction, failure)."""
        req = self._detach(request_id)
        if req is not None:
            req.end(outcome, self._now(), detail)
        return req

    def _detach(self, request_id: str) -> ServedRequest | None:
        r = self.compute.requests.get(request_id)
        if r is None:
            return None
        inst = self.instances[r.instance_id]
        inst.engine.abort(request_id)
        self.compute.remove_request(request_id)
        req = inst.requests.pop(request_id)
        if not inst.requests:
            inst.idle_since = self._now()
        return req

    def evict(self, request_id: str, why: str) -> None:
        """Evict and reschedule (6.4); without a dispatcher to take it, the request fails."""
        req = self._detach(request_id)
        if req is None:
            return
        req.evictions += 1
        req.attempts.append(f"evicted from {self.node_id}/{req.instance_id}: {why}")
        req.node_id = req.instance_id = req.first_token_s = None
        if self.on_evict is not None:
            self.on_evict(req)
        else:
            req.end(Outcome.FAILED, self._now(), why)

    def _fail_instance(self, inst: NodeInstance, why: str) -> None:
        for rid in list(inst.requests):
            self.abort(rid, Outcome.FAILED, why)

    # -- the token-level loop ------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        compute = self.compute
        while True:
            it = compute.next_iteration(loop.time())
            if it is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            inst = self.instances[it.instance_id]
            start = loop.time()
            compute.busy_until = start + it.predicted_s
            try:
                result = await inst.engine.step()
            except EngineError as exc:
                self._fail_instance(inst, f"engine step failed on node {self.node_id}: {exc}")
                continue
            now = loop.time()
            self.busy_s += now - start
            self.iteration_count += 1
            if self.iterations is not None:
                self.iterations.append(IterationRecord(it.instance_id, result.kind, len(result.request_ids), start, now - start, it.predicted_s))
            self._apply(inst, result, now)

    def _apply(self, inst: NodeInstance, result: StepResult, now: float) -> None:
        requests = inst.requests
        if result.kind is IterationKind.PREFILL:
            for rid in result.request_ids:
                req = requests.get(rid)
                if req is not None and req.first_token_s is None:
                    req.first_token_s = now
        if result.token_ids is not None or result.texts is not None:
            self._stream(requests, result)
        done = []
        for rid, reason in result.finished.items():
            req = requests.pop(rid, None)
            if req is not None:
                req.tokens_out = self.compute.tokens_out(rid) + 1
                done.append((req, reason))
        self.compute.complete_iteration(inst.instance_id, result.kind, result.request_ids, result.finished)
        if done:
            for req, reason in done:
                inst.memory.mean_output.add(req.tokens_out)
                req.end(Outcome.COMPLETED, now, reason=reason)
            if requests:
                scale_down = self.memory.lazy_scale_down(inst.instance_id, self.demand(inst.instance_id))
                if scale_down is not None:
                    self._launch(scale_down.started)
            else:
                inst.idle_since = now
        if result.kind is IterationKind.DECODE and requests:
            self._check_kv(inst)

    def _stream(self, requests: dict[str, ServedRequest], result: StepResult) -> None:
        for i, rid in enumerate(result.request_ids):
            req = requests.get(rid)
            if req is not None and req.on_output is not None:
                tokens = None if result.token_ids is None else result.token_ids[i : i + 1]
                texts = None if result.texts is None else result.texts[i : i + 1]
                req.on_output(req, tokens, texts)

    def _check_kv(self, inst: NodeInstance) -> None:
        """An estimate fell short (6.4): scale up again, else evict the request with the
        longest headroom and let the dispatcher reschedule it."""
        state = self.compute.instances[inst.instance_id]
        need = state.context_sum + len(state.running) + sum(r.prompt_len + 1 for r in state.pending.values())
        if need <= self.memory.kv_capacity_tokens(inst.instance_id):
            return
        issued = self.memory.grow_for(inst.instance_id, need)
        if issued is not None and issued.accepted:
            self._launch(issued.started)
            return
        now = self._now()
        victim = max(inst.requests, key=lambda rid: self.compute.headroom(rid, now))
        self.evict(victim, f"KV cache of {inst.instance_id} outgrew its estimate and node memory is short")

    # -- views ---------------------------------------------------------------------
    def kv_bytes_in_use(self) -> int:
        return sum(i.engine.kv_bytes_in_use() for i in self.instances.values())

    def queue_length(self) -> int:
        return sum(len(s.pending) for s in self.compute.instances.values())

    def headroom_min(self, now: float) -> float:
        return min((self.compute.headroom(rid, now) for rid in self.compute.requests), default=math.inf)
