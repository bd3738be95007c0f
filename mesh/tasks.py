"""Stopping asyncio tasks for sure.

`asyncio.wait_for` before Python 3.12 can swallow a cancellation that arrives just as the
awaited future completes (CPython gh-86296): the task goes on as if never cancelled, and a
`gather` on it waits forever (seen as a rare hang in the service's shutdown, in its
housekeeping loop). `cancel_all` cancels again until every task has ended.
"""
from __future__ import annotations

import asyncio
from typing import Iterable

RECANCEL_S = 0.5


async def cancel_all(tasks: Iterable[asyncio.Future | None]) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again those that
    swallowed the cancellation."""
    pending = [t for t in tasks if t is not None]
    while pending := [t for t in pending if not t.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=RECANCEL_S)
