"""Background work (issue 31 item 2): a process that runs only on cycles serving leaves idle.

Used by the jobs Mesh runs beside serving (engines.background_prepare, mesh.modelfiles.convert
--background); a base module, so that every layer may use it.
"""
from __future__ import annotations

import os

# A background job's thread pools: one thread each (OpenMP, BLAS, torch, HF tokenizers); set
# before the libraries load, in the job's environment (background_env).
BACKGROUND_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                      "NUMEXPR_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_as_background() -> str:
    """Make this process background work (issue 31 item 2): it runs only on cycles serving
    leaves idle. SCHED_IDLE where the kernel has it (a runnable serving thread always
    preempts it, whatever its nice), and nice 19 as well (where SCHED_IDLE is refused, and
    for what reads nice); threads and children started after this inherit both, so call it
    first thing, before a library starts its thread pool. One way only: an unprivileged
    process cannot raise its priority back. Returns what it got ("SCHED_IDLE", "nice 19")."""
    got = []
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        got.append("SCHED_IDLE")
    except (AttributeError, OSError):
        pass
    try:
        os.nice(19 - os.nice(0))
        got.append("nice 19")
    except OSError:
        pass
    return ", ".join(got) or "normal priority"
