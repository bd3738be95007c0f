"""The C heap of a long-lived Mesh process: memory it frees goes back to the system.

A node agent holds each model it receives in host memory until the transfer ends
(mesh.weights.peer; BlitzScale 5.1 forwards a block as soon as it is here): 4 MiB payloads,
a whole model's worth per transfer, several transfers at a time under registration churn.
glibc serves such blocks from `mmap` at first, but raises its threshold to the largest block
freed (up to 32 MiB), after which they come from the heap, whose free pages are returned
only from its top: one small allocation made above a freed model keeps the model's pages.
In a 30-minute soak the agent that was never restarted grew 23.8% (256 -> 317
MiB) in steps, each after a burst of transfers, while its Python objects stayed at 46 MiB
(tracemalloc): memory freed, never returned.

So the agent fixes the threshold at `LARGE_BLOCK_BYTES` at start (`map_large_blocks`: every
block is mapped and unmapped, never on the heap), and hands free heap pages back after each
transfer (`release`, glibc's `malloc_trim`). Both do nothing where the C library is not
glibc (musl, macOS): there the allocator's own policy holds.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

LARGE_BLOCK_BYTES = 1 << 20  # allocations this large or larger are mapped on their own
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def map_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Serve allocations of `threshold` bytes or more from their own mappings, for the
    process's life (this also stops glibc from raising the threshold). True if applied."""
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    if not ok:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused; large blocks may stay on the heap", threshold)
    return ok


def release() -> bool:
    """Return the heap's free pages to the system (glibc's malloc_trim(0)): a few ms on a
    heap of hundreds of MiB; call it off the event loop. True if some memory was returned."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
