"""Memory subsystem of one node (LLM-Mesh 6): KV demand per instance, watermark scaling,
the compromise to M_require, and every memory operation through the reservation station.

An instance is one holder in the station; its size is its weights plus its KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mesh.policy.kv_demand import DEFAULT_WATERMARK, RunningMean, kv_require_bytes, recommend_bytes, watermark_target
from mesh.policy.reservation import Issued, ReservationStation


@dataclass(slots=True)
class InstanceMemory:
    instance_id: str
    bytes_per_token: int  # C
    weight_bytes: int
    l_min: int  # the model's maximum sequence length (6.1)
    mean_output: RunningMean  # O_avg, shared by the instances of one model

    def require(self, demand: Sequence[tuple[int, int]]) -> int:
        return kv_require_bytes(self.bytes_per_token, demand, self.mean_output.value, self.l_min)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Memory side of admitting a request (6.2, 6.4)."""

    ok: bool
    kv_bytes: int | None = None  # new KV size to scale to; None if the current one suffices
    compromised: bool = False  # scaled to M_require only, M_recommend did not fit
    shortfall_bytes: int = 0  # when not ok: how much memory is missing

    def reason(self) -> str:
        if self.ok:
            return "ok"
        return f"node memory short by {self.shortfall_bytes / 2**20:.1f} MiB for the KV cache"


class MemorySubsystem:
    def __init__(self, capacity_bytes: int, watermark: float = DEFAULT_WATERMARK) -> None:
        self.station = ReservationStation(capacity_bytes)
        self.watermark = watermark
        self.instances: dict[str, InstanceMemory] = {}

    def kv_bytes(self, instance_id: str) -> int:
        """M_cur: the instance's KV size after all issued operations."""
        inst = self.instances[instance_id]
        return self.station.size(instance_id) - inst.weight_bytes

    def kv_capacity_tokens(self, instance_id: str) -> int:
        return self.kv_bytes(instance_id) // self.instances[instance_id].bytes_per_token

    def load_bytes(self, inst: InstanceMemory) -> int:
        """Weights plus the recommended KV size of an idle instance (Eq. 2 floor L_min)."""
        return inst.weight_bytes + recommend_bytes(inst.require(()), self.watermark)

    def can_load(self, inst: InstanceMemory) -> bool:
        return self.station.can_resize(inst.instance_id, self.load_bytes(inst))

    def load(self, inst: InstanceMemory) -> Issued:
        """Issue a model load: weights and an initial KV cache."""
        if inst.instance_id in self.instances:
            raise ValueError(f"instance {inst.instance_id!r} is already loaded")
        issued = self.station.issue(inst.instance_id, self.load_bytes(inst))
        if issued.accepted:
            self.instances[inst.instance_id] = inst
        return issued

    def unload(self, instance_id: str) -> Issued:
        del self.instances[instance_id]
        return self.station.issue(instance_id, 0)

    def plan_admission(self, instance_id: str, demand: Sequence[tuple[int, int]], freed_bytes: int = 0) -> MemoryPlan:
        """Can the instance hold `demand` (its requests plus the candidate)? Scale up to
        M_recommend if the budget allows, else compromise to M_require (6.4).
        `freed_bytes`: as if neighbours had first released that much (preemption, 7.1)."""
        inst = self.instances[instance_id]
        current = self.kv_bytes(instance_id)
        require = inst.require(demand)
        if current >= require:
            return MemoryPlan(True)
        recommend = recommend_bytes(require, self.watermark)
        if self.station.can_resize(instance_id, inst.weight_bytes + recommend, freed_bytes):
            return MemoryPlan(True, recommend)
        if self.station.can_resize(instance_id, inst.weight_bytes + require, freed_bytes):
            return MemoryPlan(True, require, compromised=True)
        free = self.station.free() + freed_bytes
        return MemoryPlan(False, shortfall_bytes=inst.weight_bytes + require - self.station.size(instance_id) - free)

    def resize_kv(self, instance_id: str, kv_bytes: int) -> Issued:
        return self.station.issue(instance_id, self.instances[instance_id].weight_bytes + kv_bytes)

    def lazy_scale_down(self, instance_id: str, demand: Sequence[tuple[int, int]]) -> Issued | None:
        """After a request leaves: scale down only past the watermark (6.2)."""
        inst = self.instances[instance_id]
        current = self.kv_bytes(instance_id)
        target = watermark_target(current, inst.require(demand), self.watermark)
        if target is None or target >= current:
            return None
        return self.resize_kv(instance_id, target)

    def grow_for(self, instance_id: str, tokens_needed: int) -> Issued | None:
        """An estimate fell short (6.4): the running requests need `tokens_needed` KV slots.
        Try to scale up to hold them (plus the watermark); None if no scale-up is needed."""
        inst = self.instances[instance_id]
        need = tokens_needed * inst.bytes_per_token
        if need <= self.kv_bytes(instance_id):
            return None
        issued = self.resize_kv(instance_id, recommend_bytes(need, self.watermark))
        return issued if issued.accepted else self.resize_kv(instance_id, need)
