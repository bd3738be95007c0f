"""Background work (issue 31 item 2): a process that runs only on cycles serving leaves idle.

Used by the jobs Mesh runs beside serving (mesh.engines.background_prepare, mesh.modelfiles.convert
--background); a base module, so that every layer may use it.
"""
from __future__ import annotations

import os

# A background job's thread pools: one thread each (OpenMP, BLAS, torch, HF tokenizers); set
# before the libraries load, in the job's environment (background_env).
BACKGROUND_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                      "NUMEXPR_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


IOPRIO_CLASS_IDLE = 3  # linux/ioprio.h: disk time only when no one else wants the disk
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # the ioprio_set syscall's number


def run_as_background() -> str:
    """Make this process background work (issue 31 item 2): it runs only on cycles serving
    leaves idle. SCHED_IDLE where the kernel has it (a runnable serving thread always
    preempts it, whatever its nice), nice 19 as well (where SCHED_IDLE is refused, and for
    what reads nice), and the idle I/O class (a conversion writes hundreds of MB); threads
    and children started after this inherit all three, so call it first thing, before a
    library starts its thread pool. One way only: an unprivileged process cannot raise its
    priority back. Returns what it got ("SCHED_IDLE, nice 19, idle I/O")."""
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
    if _idle_io():
        got.append("idle I/O")
    return ", ".join(got) or "normal priority"


def _idle_io() -> bool:
    """ioprio_set(IOPRIO_WHO_PROCESS, self, IOPRIO_CLASS_IDLE) (Linux; False elsewhere)."""
    import ctypes
    import platform

    number = _IOPRIO_SET.get(platform.machine())
    if number is None:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(number, 1, 0, IOPRIO_CLASS_IDLE << 13) == 0
    except (OSError, AttributeError):
        return False
