"""A virtual-time asyncio event loop: the same runtime code runs a long scenario in seconds.

`loop.time()` returns a virtual clock. When the loop has nothing ready to run and would
sleep until its next timer, the clock jumps to that timer instead of waiting. Real I/O
still works (the selector is polled without blocking), so a replay can talk to sockets;
with no timer pending the loop blocks on real I/O as usual.
"""
from __future__ import annotations

import asyncio
import selectors
from typing import Any, Awaitable, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: "VirtualTimeLoop") -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            return super().select(None)  # nothing scheduled: wait for real I/O
        events = super().select(0)
        if not events and timeout > 0:
            self._loop.advance(timeout)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = start
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds


def run_virtual(main: Awaitable[T], start: float = 0.0) -> T:
    """Run a coroutine to completion on a fresh virtual-time loop."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
