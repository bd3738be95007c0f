"""Shadow validation's vocabulary (LLM-Mesh 4, 5.3): an instance planned on a node, and a
node's answer to "may these requests join?".

A node runtime (mesh.node.shadow_admission) gives the answers; the control side asks for
them and reads them (mesh.control), in process or through the agent protocol."""
from __future__ import annotations

from dataclasses import dataclass

from mesh.policy.batching import IterationTimes
from mesh.policy.kv_demand import RunningMean
from mesh.policy.memory import MemoryPlan
from mesh.policy.shadow import Verdict
from mesh.policy.slo import SLO


@dataclass(frozen=True, slots=True)
class InstancePlan:
    """An instance that is not started yet, for validating requests on it (LLM-Mesh 4: a
    new instance is created on a node that validates). `expected_load_s` is the predicted
    cold start (weights in place plus the initial KV cache), `load_wait_s` of which waits for
    the loads already under way on the node (Fleet.load_wait_s)."""

    instance_id: str
    model: str
    times: IterationTimes
    slo: SLO
    kv_bytes_per_token: int
    weight_bytes: int
    context_window: int
    prefill_token_budget: int
    max_batch: int
    mean_output: RunningMean
    expected_load_s: float
    load_wait_s: float = 0.0


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
