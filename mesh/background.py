"""Background work: a process that runs only on cycles serving leaves idle.

Used by the jobs Mesh runs beside serving (mesh.engines.background_prepare, mesh.modelfiles.convert
--background); a base module, so that every layer may use it.
"""
from __future__ import annotations

import os

from mesh.lifetime import die_with_parent

# A background job's thread pools: one thread each (OpenMP, BLAS, torch, HF tokenizers); set
# before the libraries load, in the job's environment (background_env).
BACKGROUND_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                      "NUMEXPR_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


IOPRIO_CLASS_IDLE = 3  # linux/ioprio.h: disk time only when no one else wants the disk
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # the ioprio_set syscall's number


def run_as_background(own_session: bool = False) -> str:
    """Make this process background work: it runs only on cycles serving
    leaves idle. SCHED_IDLE where the kernel has it (a runnable serving thread always
    preempts it, whatever its nice), nice 19 as well (where SCHED_IDLE is refused, and for
    what reads nice), the idle I/O class (a conversion writes hundreds of MB), and its
    session's autogroup at nice 19 (`_idle_autogroup`: else the first two act only within
    its session); threads and children started after this inherit them all, so call it
    first thing, before a library starts its thread pool. One way only: an unprivileged process cannot raise its
    priority back. `own_session`: leave the parent's session for one of its own, whose
    autogroup it then lowers, and die with the parent (mesh.lifetime.die_with_parent: a
    session of its own gets no hangup from the parent's). Returns what it got ("SCHED_IDLE,
    nice 19, idle I/O, autogroup nice 19")."""
    if own_session:
        die_with_parent()
        if os.getsid(0) != os.getpid():
            try:
                os.setsid()
            except OSError:
                pass
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
    if _idle_autogroup():
        got.append("autogroup nice 19")
    return ", ".join(got) or "normal priority"


def _idle_autogroup() -> bool:
    """Where the kernel groups tasks by session (autogroup, sched(7): on by default on most
    desktops and on this project's machines), CFS shares the CPU between sessions first, and
    SCHED_IDLE and nice act only inside one: a job in a session of its own (Mesh starts its
    workers with start_new_session) got half of a serving core whatever its policy (measured:
    the serving node's TPOT p50 +98% at "idle priority", the same as at normal priority).
    Writing 19 to /proc/self/autogroup gives the session the least weight. Only for a
    session leader: a job sharing its parent's session would lower the parent too."""
    if os.getsid(0) != os.getpid():
        return False
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
        return True
    except OSError:
        return False


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
