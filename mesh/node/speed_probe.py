"""The node agent's speed probe: a fraction of a second of numpy that tells
the agent how fast its cores are against the machine the prior was fitted on
(mesh.perf.speed). `python -m mesh.node.speed_probe` prints it (and is how PRIOR_MACHINE
was measured).

Two kernels on one core, each the median of a few timed repetitions after one warm-up, so
one preempted repetition on shared cores does not decide it, times the cores of this
process's affinity (the engine's threads: the node's own core set, which it records):
- prefill's stand-in: small square float32 GEMMs (compute-bound, like a prompt's matmuls;
  small enough that BLAS runs them on one thread);
- decode's stand-in: one pass summing a 64 MiB array (memory-bound: a decode step reads
  every weight once for a small batch).
Measured with BLAS's own threads instead, a GEMM on two shared cores swung 7-116 GFLOP/s
between runs seconds apart (a thread waiting for its preempted sibling): one core's figure
is stable; what other jobs take from the cores is left to AdaptiveTimes.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

from mesh.perf.speed import MachineSpeed, SpeedFactors

GEMM_N = 128  # small enough for one BLAS thread
GEMM_CALLS = 100  # per repetition: 0.4 GFLOP, a few ms
STREAM_BYTES = 64 * 2**20  # far beyond any L3 share
REPEATS = 5


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch pages, BLAS thread start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_speed(repeats: int = REPEATS, seed: int = 0) -> MachineSpeed:
    """Measure this machine (about 0.1-0.5 s on 1-2 cores)."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((GEMM_N, GEMM_N), dtype=np.float32)
    b = rng.standard_normal((GEMM_N, GEMM_N), dtype=np.float32)
    out = np.empty_like(a)

    def gemms() -> None:
        for _ in range(GEMM_CALLS):
            np.matmul(a, b, out=out)

    gemm_s = _median_s(gemms, repeats) / GEMM_CALLS
    w = rng.standard_normal(STREAM_BYTES // 4, dtype=np.float32)
    stream_s = _median_s(lambda: np.add.reduce(w), repeats)
    core_set = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    cores = len(core_set) or (os.cpu_count() or 1)
    return MachineSpeed(gemm_gflops=cores * 2 * GEMM_N**3 / gemm_s / 1e9, stream_gbps=cores * w.nbytes / stream_s / 1e9,
                        threads=cores, cores=core_set, seconds=time.perf_counter() - start)


def main() -> None:
    speed = probe_speed()
    print(json.dumps({"speed": speed.to_dict(), "factors": SpeedFactors.against(speed).to_dict()}))


if __name__ == "__main__":
    main()
