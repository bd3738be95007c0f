"""A child process's lifetime: it never outlives the process that started it."""
from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; elsewhere a
    no-op, and the parent's socket closing still ends a worker). Called first thing in a
    child: if the parent is already gone (the reparenting happened before the call), exit."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if parent == 1 or os.getppid() != parent:
        os._exit(0)
