"""The node runtime's parts on their own (mesh.node.memory_operations, mesh.node.shadow_admission):
each is built from what it is given, so it runs without a NodeRuntime around it."""
import asyncio

from doubles import LinearTimes
from mesh.engines.engine_api import EngineError, EngineRequest, Sampling
from mesh.engines.simulated import SimulatedEngine
from mesh.node.memory_operations import MemoryOperations
from mesh.node.node_instance import NodeInstance
from mesh.node.shadow_admission import ShadowAdmission
from mesh.policy.compute import ComputeSubsystem
from mesh.policy.kv_demand import RunningMean
from mesh.policy.memory import InstanceMemory, MemorySubsystem
from mesh.policy.slo import SLO
from mesh.replay.virtual_loop import run_virtual
from mesh.tasks import cancel_all
from mesh.wire.served_request import ServedRequest

KV_PER_TOKEN = 1000
WEIGHTS = 10**6


class FailingLoad(SimulatedEngine):
    async def load(self) -> None:
        raise EngineError("no weights here")


def engine(name: str, cls: type[SimulatedEngine] = SimulatedEngine) -> SimulatedEngine:
    return cls(name, LinearTimes(), kv_bytes_per_token=KV_PER_TOKEN, weight_bytes=WEIGHTS, context_window=1024,
               load_s=0.5)


def test_the_memory_part_reports_a_finished_load_and_a_failed_one():
    """MemoryOperations, given a node's subsystems, its instances and two callables: a load
    that finishes makes its instance loaded (schedulable) and calls `loaded` with it; an
    engine that fails its load calls `failed` with the instance and why."""
    async def main() -> tuple[list, list, dict]:
        compute, memory = ComputeSubsystem(), MemorySubsystem(10**9)
        instances: dict[str, NodeInstance] = {}
        loaded: list[str] = []
        failed: list[tuple[str, str]] = []
        ops = MemoryOperations("n", compute, memory, instances, asyncio.get_running_loop().time,
                               loaded=lambda inst: loaded.append(inst.instance_id),
                               failed=lambda inst, why: failed.append((inst.instance_id, why)))
        for name, cls in (("good", SimulatedEngine), ("bad", FailingLoad)):
            assert ops.start_instance(name, name, engine(name, cls), LinearTimes(), SLO(), RunningMean(8), 0.5).accepted
        assert not compute.instances["good"].loaded and not instances["good"].loaded
        await asyncio.sleep(1.0)
        await cancel_all(list(ops.tasks))
        return loaded, failed, instances

    loaded, failed, instances = run_virtual(main())
    assert "good" in loaded and instances["good"].loaded
    assert failed == [("bad", "load failed on node n: no weights here")]


def test_the_admission_part_reads_the_tokens_carried_from_the_runtime_s_own_mapping():
    """ShadowAdmission's demand (Eq. 2) counts, in a resumed request's input, the tokens it
    produced before it came to the node, read from the mapping it was given: the runtime's,
    which changes as requests come and go."""
    async def main() -> tuple[list, list]:
        compute, memory = ComputeSubsystem(), MemorySubsystem(10**9)
        eng = engine("m")
        mem = InstanceMemory("i", eng.kv_bytes_per_token, eng.weight_bytes, eng.context_window, RunningMean(8))
        inst = NodeInstance("i", "m", eng, SLO(), mem)
        req = ServedRequest(EngineRequest("r", 100, Sampling(max_tokens=50)), "m", 0.0, SLO())
        inst.requests["r"] = req
        compute.add_instance("i", LinearTimes(), SLO(), eng.prefill_token_budget)
        compute.add_request("i", "r", 100, 0.0, resumed=True)
        carried = {"r": 7}
        admission = ShadowAdmission(compute, memory, {"i": inst}, carried, asyncio.get_running_loop().time, 0.1)
        before = admission.demand("i")
        carried["r"] = 9
        return before, admission.demand("i")

    before, after = run_virtual(main())
    assert before == [(107, 0)] and after == [(109, 0)]
