"""`LocalNode`: a NodeRuntime in this process, the simulated nodes of the replays
(mesh.control.cluster_node says what a ClusterNode is). Its calls complete without
suspending, so on the virtual-time loop a replay's decisions are atomic.

Given a parking lot (the live replay's twin of the service's OpenVINO nodes), a node keeps the memory tier of
ServerlessLLM's loading hierarchy (4.1) as those nodes do, by their rules and with their lot
(mesh.engines.parking.ParkingLot): a loaded instance that stops is parked; the models whose first host copy the node
holds are built ahead, one at a time and only while the node loads no instance and serves no request, and parked where
the lot has room without ending a parked one (mesh.node.park_ahead); a load adopts a parked worker (the
cold start's parked tier, ColdStart.parked_s), or the build ahead under way (its rest, then
the parked tier), and a load that comes before its model's build starts drops that build.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Sequence

from mesh.control.cluster_node import ClusterNode, HostedInstance, NodeListener
from mesh.engines.engine_api import Engine
from mesh.engines.parking import Parked, ParkingLot
from mesh.node.park_ahead import POLL_S
from mesh.node.runtime import NodeRuntime
from mesh.perf.load_times import PARKED
from mesh.policy.admission import Admission, InstancePlan
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import Deadlines
from mesh.tasks import cancel_all
from mesh.wire.served_request import Outcome, ServedRequest

# (plan, node kind, adopted_s) -> an engine to load; adopted_s: None, or the load adopts a
# parked worker whose build ends in that many seconds (0: parked already)
EngineMaker = Callable[[InstancePlan, str, "float | None"], Engine]


class SimulatedWorker:
    """What a parked simulated instance leaves in the lot: nothing to end (the stand-in for
    an OpenVINO worker process, mesh.engines.worker_process.WorkerConnection)."""

    dead: BaseException | None = None

    async def shutdown(self, timeout_s: float) -> None:
        return None


@dataclass
class _Build:
    """A model built ahead here: `left_s` of its build to go, `nbytes` parked once built."""

    model: str
    left_s: float
    nbytes: int
    started: bool = False


class LocalNode(ClusterNode):
    """A NodeRuntime in this process: the simulated nodes of the replays."""

    def __init__(self, runtime: NodeRuntime, make_engine: EngineMaker, parking: ParkingLot | None = None,
                 listener: NodeListener | None = None) -> None:
        """`parking`: the node parks (module docstring); None: it parks nothing. `listener`:
        whom it reports to (the fleet it is in); None: an evicted request fails."""
        self.runtime = runtime
        self.listener = listener
        self._down_until = -math.inf  # lost, and taking nothing until then (`lose`)
        self.margin = runtime.admission.margin
        self._make_engine = make_engine
        self.parking = parking
        self.copies: set[str] = set()  # the models whose weights it holds (ClusterConfig.host_copies)
        self._ahead: list[_Build] = []  # in the order described
        self._builder: asyncio.Task[None] | None = None
        runtime.on_evict = self._evicted
        runtime.on_loaded = self._loaded

    @property
    def spec(self) -> NodeSpec:
        return self.runtime.spec

    def build_ahead(self, model: str, build_s: float, nbytes: int) -> None:
        """Build `model` ahead here in `build_s` of idle time and park it (its first host copy
        is here: the agent describes it at registration, mesh.node.model_fronts)."""
        if self.parking is not None:
            self._ahead.append(_Build(model, build_s, nbytes))

    async def _build_ahead(self) -> None:
        """mesh.node.park_ahead's rules, in the replay's time: one build at a time, each
        advancing only while the node is idle (NodeRuntime.idle, checked every POLL_S), parked
        without ending a parked worker; a load may take a build over (start_instance)."""
        assert self.parking is not None
        while self._ahead:
            build = self._ahead[0]
            while build.left_s > 0 and self._ahead and self._ahead[0] is build:
                if not self.runtime.idle():
                    await asyncio.sleep(POLL_S)
                    continue
                step = min(POLL_S, build.left_s)
                build.started = True
                await asyncio.sleep(step)
                build.left_s -= step
            if self._ahead and self._ahead[0] is build:
                self._ahead.pop(0)
                self.parking.park(build.model, Parked(build.model, SimulatedWorker(), build.nbytes), evict=False)

    # -- loss (the twin of a node agent that died: mesh.control.agent_node AgentNode.lose) -----------
    def lose(self, why: str, cause: str, down_s: float, on_back: Callable[[], None] | None = None) -> int:
        """The node is lost now: its requests go back to the dispatcher with their progress
        (`hand_back_lost`), its instances and its parked workers are gone, and it takes
        nothing for `down_s` seconds (its agent restarting); then `on_back()` (the dispatcher
        retries what waits). Returns how many requests went back."""
        loop = asyncio.get_running_loop()
        self._down_until = loop.time() + down_s
        if self.parking is not None:
            for model in list(self.parking.models()):  # the workers died with the agent
                self.parking.take(model)
        gone = list(self.runtime.instances)
        taken = self.runtime.lose_all(why)
        for instance_id in gone:  # the cluster forgets them, as it does a lost agent's
            if self.listener is not None:
                self.listener.instance_gone(self, instance_id)
        if on_back is not None:
            loop.call_at(self._down_until, on_back)
        return self.hand_back_lost(taken, why, cause)

    @property
    def up(self) -> bool:
        return self._down_until == -math.inf or asyncio.get_running_loop().time() >= self._down_until

    def _down(self) -> Admission | None:
        """A refusal while the node is down (lost, not back yet), else None."""
        return None if self.up else Admission(False, refusal=f"node {self.node_id} is down")

    def parked(self, model: str) -> bool:
        return self.parking is not None and model in self.parking.models()

    def _evicted(self, req: ServedRequest) -> None:
        if self.listener is not None:
            self.listener.request_evicted(self, req)
        else:
            req.end(Outcome.FAILED, self.runtime._now(), req.attempts[-1] if req.attempts else "evicted")

    def _loaded(self, instance_id: str) -> None:
        if self.listener is not None:
            self.listener.instance_loaded(self, instance_id)

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
        return self._down() or self.runtime.admission.validate(instance_id, req, exclude=exclude)

    async def validate_group(self, instance_id: str, reqs: Sequence[ServedRequest], done: Sequence[int]) -> Admission:
        return self._down() or self.runtime.admission.validate_group(instance_id, reqs, done)

    async def validate_new(self, plan: InstancePlan, reqs: Sequence[ServedRequest], done: Sequence[int], *,
                           deadlines: Sequence[Deadlines] | None = None) -> Admission:
        return self._down() or self.runtime.admission.validate_new(plan, reqs, done, deadlines=deadlines)

    async def try_admit(self, instance_id: str, req: ServedRequest, *, compute: bool = True,
                        deadlines: Deadlines | None = None) -> Admission:
        return self._down() or self.runtime.try_admit(instance_id, req, compute=compute, deadlines=deadlines)

    async def take_back(self, request_id: str, why: str) -> ServedRequest | None:
        return self.runtime.take_back(request_id, why)

    async def start_instance(self, plan: InstancePlan) -> bool:
        if not self.up:
            return False
        self.copies.add(plan.model)  # the weights came with the load (Fleet.transfer_s) and stay
        adopted_s = self._adopt(plan.model)
        engine = self._make_engine(plan, self.kind, adopted_s)
        if adopted_s is not None and hasattr(engine, "loaded_from"):
            engine.loaded_from = PARKED  # the cold-start table's tier (Fleet records its loads by it)
        issued = self.runtime.memory_ops.start_instance(plan.instance_id, plan.model, engine, plan.times, plan.slo,
                                             plan.mean_output, plan.expected_load_s)
        return issued.accepted

    def _adopt(self, model: str) -> float | None:
        """A load of `model` takes its parked worker (0 s of build left), or its build ahead
        if under way (what is left of it); a build not started yet is dropped (None)."""
        if self.parking is None:
            return None
        if self.parking.take(model) is not None:
            return 0.0
        for build in self._ahead:
            if build.model == model:
                self._ahead.remove(build)
                return build.left_s if build.started else None
        return None

    async def stop_instance(self, instance_id: str) -> None:
        inst = self.runtime.instances.get(instance_id)
        self.runtime.memory_ops.stop_instance(instance_id)
        if self.parking is not None and inst is not None and inst.loaded:
            engine = inst.engine
            nbytes = engine.weight_bytes + getattr(engine, "kv_capacity_bytes", 0)
            self.parking.park(inst.model, Parked(inst.model, SimulatedWorker(), nbytes))

    def abort(self, request_id: str, why: str) -> None:
        self.runtime.abort(request_id, Outcome.FAILED, why)

    async def start(self) -> None:
        self.runtime.start()
        if self.parking is not None and self._ahead:
            self._builder = asyncio.get_running_loop().create_task(self._build_ahead())

    async def stop(self) -> None:
        await cancel_all([self._builder])
        if self.parking is not None:
            await self.parking.close()
        await self.runtime.stop()
