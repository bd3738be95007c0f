"""Stopping asyncio tasks and child processes for sure.

`asyncio.wait_for` before Python 3.12 can swallow a cancellation that arrives just as the
awaited future completes (CPython gh-86296): the task goes on as if never cancelled, and a
`gather` on it waits forever (seen as a rare hang in the service's shutdown, in its
housekeeping loop). `cancel_all` cancels again until every task has ended.

A child process's pipes outlive its exit until the loop reads their EOF; one still open when
the loop closes is closed by the garbage collector later, in another loop's time, and raises
'Event loop is closed' there. `close_pipes` ends them once the process has exited.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Iterable

RECANCEL_S = 0.5
PIPE_EOF_S = 5.0  # how long an exited child's pipe may take to reach EOF (its own children exit after it)


async def cancel_all(tasks: Iterable[asyncio.Future | None]) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again those that
    swallowed the cancellation."""
    pending = [t for t in tasks if t is not None]
    while pending := [t for t in pending if not t.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=RECANCEL_S)


async def close_pipes(process: asyncio.subprocess.Process, timeout_s: float = PIPE_EOF_S) -> None:
    """After `process` has exited: close our end of its stdin and read its stdout to EOF, within
    `timeout_s` (its own children, which inherited the pipe, may hold it a moment longer)."""
    if process.stdin is not None:
        process.stdin.close()
    if process.stdout is not None:
        with contextlib.suppress(asyncio.TimeoutError, RuntimeError):  # RuntimeError: another task reads it
            await asyncio.wait_for(process.stdout.read(), timeout_s)
