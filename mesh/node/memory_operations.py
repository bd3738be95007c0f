"""A node's instances and their memory operations (LLM-Mesh 6.3), the memory part of the
node runtime (mesh.node.runtime.NodeRuntime holds one).

A load, an unload or a KV cache resize runs as its own task once the reservation station
starts it, and reports back when it ends: a finished load makes its instance schedulable
(`loaded`), a failed operation fails the instance (`failed`); the runtime, which owns the
requests, acts on both. After a decode, a KV cache that outgrew its estimate grows again,
else `fit_kv` names the request to evict (6.4).
"""
from __future__ import annotations

import asyncio
from typing import Callable, Iterable

from mesh.engines.engine_api import Engine
from mesh.node.node_instance import NodeInstance
from mesh.policy.batching import IterationTimes
from mesh.policy.compute import ComputeSubsystem
from mesh.policy.kv_demand import RunningMean
from mesh.policy.memory import InstanceMemory, MemorySubsystem
from mesh.policy.reservation import Issued, MemoryOp, OpKind
from mesh.policy.slo import SLO


class MemoryOperations:
    """Starts and stops a node's instances through its memory subsystem and runs the memory
    operations the reservation station starts."""

    def __init__(
        self,
        node_id: str,
        compute: ComputeSubsystem,
        memory: MemorySubsystem,
        instances: dict[str, NodeInstance],
        clock: Callable[[], float],
        *,
        loaded: Callable[[NodeInstance], None],
        failed: Callable[[NodeInstance, str], None],
    ) -> None:
        """`instances`: the node's, shared with the runtime (added and removed here).
        `clock`: the event loop's time. `loaded(instance)`: its load finished (it is
        schedulable now); `failed(instance, why)`: an operation on it failed, its requests
        fail."""
        self.node_id = node_id
        self.compute = compute
        self.memory = memory
        self.instances = instances
        self._clock = clock
        self._loaded = loaded
        self._failed = failed
        self.unloading: dict[str, NodeInstance] = {}  # stopped instances whose unload is under way
        self.tasks: set[asyncio.Task] = set()  # the operations running

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
        now = self._clock()
        self.instances[instance_id] = NodeInstance(instance_id, model, engine, slo, mem, idle_since=now)
        self.compute.add_instance(
            instance_id, times, slo, engine.prefill_token_budget, ready_at=now + expected_load_s, loaded=False
        )
        self.launch(issued.started)
        return issued

    def stop_instance(self, instance_id: str) -> None:
        """Recycle an idle instance: unload its weights and KV cache."""
        inst = self.instances[instance_id]
        if inst.requests:
            raise ValueError(f"instance {instance_id!r} still serves {len(inst.requests)} requests")
        self.compute.remove_instance(instance_id)
        del self.instances[instance_id]
        self.unloading[instance_id] = inst
        self.launch(self.memory.unload(instance_id).started)

    def launch(self, ops: Iterable[MemoryOp]) -> None:
        """Run the operations the reservation station started, each as its own task."""
        loop = asyncio.get_running_loop()
        for op in ops:
            task = loop.create_task(self._execute(op))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _execute(self, op: MemoryOp) -> None:
        inst = self.instances.get(op.holder) or self.unloading[op.holder]
        kind = op.kind
        try:
            if kind is OpKind.LOAD:
                await inst.engine.load()
            if kind is OpKind.UNLOAD:
                await inst.engine.unload()
            else:
                await inst.engine.resize_kv(op.new_bytes - inst.memory.weight_bytes)
        except Exception as exc:  # an engine failed a memory operation: its requests fail
            self._failed(inst, f"{kind.value} failed on node {self.node_id}: {exc}")
        finally:
            started = self.memory.station.complete(op.op_id)
        if kind is OpKind.LOAD and op.holder in self.instances:
            inst.loaded = True
            self.compute.set_loaded(op.holder, self._clock(), getattr(inst.engine, "layer_arrivals",
                                                                      None))  # live: layers still coming
            self._loaded(inst)
        if kind is OpKind.UNLOAD:
            self.unloading.pop(op.holder, None)
        self.launch(started)

    def fit_kv(self, inst: NodeInstance) -> str | None:
        """After a decode: if an estimate fell short (6.4), scale the KV cache up again; if
        node memory cannot, the request with the longest headroom, to evict (the
        dispatcher places it again). None: the cache holds, or grows."""
        state = self.compute.instances[inst.instance_id]
        need = state.context_sum + len(state.running) + sum(r.prompt_len + 1 for r in state.pending.values())
        if need <= self.memory.kv_capacity_tokens(inst.instance_id):
            return None
        issued = self.memory.grow_for(inst.instance_id, need)
        if issued is not None and issued.accepted:
            self.launch(issued.started)
            return None
        now = self._clock()
        return max(inst.requests, key=lambda rid: self.compute.headroom(rid, now))
