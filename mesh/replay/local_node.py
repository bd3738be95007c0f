"""`LocalNode`: a NodeRuntime in this process, the simulated nodes of the replays
(mesh.control.cluster_node says what a ClusterNode is). Its calls complete without
suspending, so on the virtual-time loop a replay's decisions are atomic."""
from __future__ import annotations

from typing import Callable, Collection, Mapping, Sequence

from mesh.control.cluster_node import ClusterNode, HostedInstance
from mesh.engines.engine_api import Engine
from mesh.node.request import Outcome, ServedRequest
from mesh.node.runtime import InstancePlan, NodeRuntime
from mesh.node.shadow_admission import Admission


EngineMaker = Callable[[InstancePlan, str], Engine]  # (plan, node kind) -> an engine to load


class LocalNode(ClusterNode):
    """A NodeRuntime in this process: the simulated nodes of the replays."""

    def __init__(self, runtime: NodeRuntime, make_engine: EngineMaker) -> None:
        self.runtime = runtime
        self.spec = runtime.spec
        self.margin = runtime.margin
        self._make_engine = make_engine
        runtime.on_evict = self._evicted
        runtime.on_loaded = self._loaded

    def _evicted(self, req: ServedRequest) -> None:
        if self.on_evict is not None:
            self.on_evict(req)
        else:
            req.end(Outcome.FAILED, self.runtime._now(), req.attempts[-1] if req.attempts else "evicted")

    def _loaded(self, instance_id: str) -> None:
        if self.on_loaded is not None:
            self.on_loaded(instance_id)

    @property
    def instances(self) -> Mapping[str, HostedInstance]:
        return self.runtime.instances

    @property
    def stepping(self) -> str | None:
        return self.runtime.stepping

    def progress(self, request_id: str) -> int:
        return self.runtime.progress(request_id)

    def used_bytes(self) -> int:
        return self.runtime.memory.station.budget

    def can_fit(self, instance_bytes: int) -> bool:
        return self.runtime.memory.station.can_resize("", instance_bytes)

    def failure(self) -> BaseException | None:
        return self.runtime.failure()

    def loaded_from(self, instance_id: str) -> str | None:
        inst = self.runtime.instances.get(instance_id)
        return getattr(inst.engine, "loaded_from", None) if inst is not None else None

    async def validate(self, instance_id: str, req: ServedRequest, *, exclude: Collection[str] = ()) -> Admission:
        return self.runtime.validate(instance_id, req, exclude=exclude)

    async def validate_group(self, instance_id: str, reqs: Sequence[ServedRequest], done: Sequence[int]) -> Admission:
        return self.runtime.validate_group(instance_id, reqs, done)

    async def validate_new(self, plan: InstancePlan, reqs: Sequence[ServedRequest], done: Sequence[int]) -> Admission:
        return self.runtime.validate_new(plan, reqs, done)

    async def try_admit(self, instance_id: str, req: ServedRequest, *, compute: bool = True) -> Admission:
        return self.runtime.try_admit(instance_id, req, compute=compute)

    async def take_back(self, request_id: str, why: str) -> ServedRequest | None:
        return self.runtime.take_back(request_id, why)

    async def start_instance(self, plan: InstancePlan) -> bool:
        engine = self._make_engine(plan, self.kind)
        issued = self.runtime.start_instance(plan.instance_id, plan.model, engine, plan.times, plan.slo,
                                             plan.mean_output, plan.expected_load_s)
        return issued.accepted

    async def stop_instance(self, instance_id: str) -> None:
        self.runtime.stop_instance(instance_id)

    def abort(self, request_id: str, why: str) -> None:
        self.runtime.abort(request_id, Outcome.FAILED, why)

    async def start(self) -> None:
        self.runtime.start()

    async def stop(self) -> None:
        await self.runtime.stop()
