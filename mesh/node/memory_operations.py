"""A node's instances and their memory operations (LLM-Mesh 6.3), the memory side of the node
runtime (mesh.node.runtime.NodeRuntime).

A load, an unload or a KV cache resize runs as its own task once the reservation station
starts it, and reports back when it ends: a load makes its instance schedulable and hands it
the requests admitted meanwhile; a failed operation fails the instance's requests. After a
decode, a KV cache that outgrew its estimate grows again, else a request is evicted (6.4).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from mesh.engines.engine_api import Engine, EngineError, EngineRequest
from mesh.policy.batching import IterationTimes
from mesh.policy.compute import ComputeSubsystem
from mesh.policy.kv_demand import RunningMean
from mesh.policy.memory import InstanceMemory, MemorySubsystem
from mesh.policy.reservation import Issued, MemoryOp, OpKind
from mesh.policy.slo import SLO
from mesh.wire.served_request import Outcome, ServedRequest


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
    # Requests admitted while the instance loads (validated with its cold start, LLM-Mesh 4):
    # a real engine takes requests only once loaded, so they reach it when the load ends.
    deferred: dict[str, EngineRequest] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.requests)


class MemoryOperations:
    """The instances of a node and their memory operations: NodeRuntime's memory side. It
    uses the runtime's subsystems and its request moves (`abort`, `evict`)."""

    compute: ComputeSubsystem
    memory: MemorySubsystem
    instances: dict[str, NodeInstance]
    on_loaded: Callable[[str], None] | None
    _wake: asyncio.Event
    _tasks: set[asyncio.Task]
    _unloading: dict[str, NodeInstance]

    if TYPE_CHECKING:
        node_id: str

        def _now(self) -> float: ...
        def abort(self, request_id: str, outcome: Outcome, detail: str) -> ServedRequest | None: ...
        def evict(self, request_id: str, why: str, fault: bool = False) -> None: ...

    def instance_memory(self, instance_id: str, engine: Engine, mean_output: RunningMean) -> InstanceMemory:
        return InstanceMemory(instance_id, engine.kv_bytes_per_token, engine.weight_bytes, engine.context_window,
                              mean_output)

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
            now = self._now()
            self.compute.set_loaded(op.holder, now, getattr(inst.engine, "layer_arrivals",
                                                            None))  # live: layers still coming
            self._add_deferred(inst)
            if not inst.requests:
                inst.idle_since = now  # keep-alive counts from when it can serve (LLM-Mesh 4)
            if self.on_loaded is not None:
                self.on_loaded(op.holder)
            self._wake.set()
        if kind is OpKind.UNLOAD:
            self._unloading.pop(op.holder, None)
        self._launch(started)

    def _add_deferred(self, inst: NodeInstance) -> None:
        """The load ended: the requests admitted meanwhile go to the engine, in order."""
        deferred, inst.deferred = inst.deferred, {}
        for rid, er in deferred.items():
            try:
                inst.engine.add_request(er)
            except EngineError as exc:  # its prompt, checked by the engine only now
                self.abort(rid, Outcome.FAILED, f"{exc}")

    def _fail_instance(self, inst: NodeInstance, why: str) -> None:
        for rid in list(inst.requests):
            self.abort(rid, Outcome.FAILED, why)

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
