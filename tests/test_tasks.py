"""mesh.tasks.cancel_all ends a task that swallowed its cancellation, as
asyncio.wait_for can before Python 3.12 (a single cancel and gather would wait forever)."""
from __future__ import annotations

import asyncio

from mesh.tasks import cancel_all


def test_a_task_that_swallows_one_cancellation_still_ends():
    async def main():
        swallowed = []

        async def stubborn() -> None:
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed.append(True)  # the first cancellation is lost, as in the wait_for race

        task = asyncio.ensure_future(stubborn())
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_all([task, None]), 5)
        assert task.cancelled() and swallowed == [True]

    asyncio.run(main())
