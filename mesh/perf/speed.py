"""A machine's speed relative to the machine the prior was fitted on.

`DefaultCpuTimes` (mesh.perf.times) was fitted to the demo model's iteration times on one
machine; machines of this kind differ 2-3x. A node agent measures `MachineSpeed` with a
short probe when it starts (mesh.node.speed_probe) and scales the prior by
`SpeedFactors.against(PRIOR_MACHINE)`: prefill, compute-bound, by the square GEMM's
throughput; decode, bound by reading the weights, by the skinny GEMM's (LLM-Mesh 5.2's
two models, one factor each). AdaptiveTimes then starts from these factors instead of 1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class MachineSpeed:
    """What the probe measured: square float32 GEMM throughput (GFLOP/s, compute-bound like a
    prefill) and a skinny GEMM's weight-streaming rate (GB/s of weights read, memory-bound
    like a decode step), both on the cores this process may use, with BLAS's threads."""

    gemm_gflops: float
    stream_gbps: float
    threads: int = 0  # cores the probe ran on (the process's affinity)
    cores: tuple[int, ...] = ()  # which ones: the node's core set (mesh serve --node-cores; empty: not recorded)
    seconds: float = 0.0  # how long the probe took

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Measured by `python -m mesh.node.speed_probe` on the machine DefaultCpuTimes was fitted on
# (2-core AMD EPYC, AVX-512, shared with other jobs, both cores): runs gave 17.7, 53.4 and
# 54.0 GFLOP/s and 20.0, 41.4 and 31.3 GB/s; the medians.
PRIOR_MACHINE = MachineSpeed(gemm_gflops=53.4, stream_gbps=31.3, threads=2)
PROBE_MIN, PROBE_MAX = 0.5, 4.0  # a probe is a snapshot on shared cores: it starts the factors, never decides them


@dataclass(frozen=True, slots=True)
class SpeedFactors:
    """Multipliers of the prior's times on this machine (> 1: slower than the prior's)."""

    prefill: float = 1.0
    decode: float = 1.0

    @classmethod
    def against(cls, measured: MachineSpeed, reference: MachineSpeed = PRIOR_MACHINE) -> "SpeedFactors":
        """Time scales inversely with speed; bounded to [PROBE_MIN, PROBE_MAX]."""
        def ratio(ref: float, got: float) -> float:
            if not (ref > 0 and got > 0):
                return 1.0
            return min(PROBE_MAX, max(PROBE_MIN, ref / got))

        return cls(ratio(reference.gemm_gflops, measured.gemm_gflops),
                   ratio(reference.stream_gbps, measured.stream_gbps))

    def to_dict(self) -> dict[str, float]:
        return {"prefill": round(self.prefill, 4), "decode": round(self.decode, 4)}
