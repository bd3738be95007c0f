"""Parked instances: a node's memory tier of compiled, warmed-up OpenVINO workers.

An OpenVINO load from the node's own disk cache (mesh.engines.node_cache: the prepared IR and
tokenizer IR) still compiles the model on every load, about 2 s of a 3.7 s cold start on
2 cores, because OpenVINO 2026.4's CPU plugin does not import the blobs of a paged-attention
model. What ServerlessLLM does with a checkpoint (keep it in host memory, the fastest tier
of its loading hierarchy, 4.1) and what vLLM's sleep mode does on a GPU, a node does here with
the compiled pipeline: when an instance stops, its worker process is not ended but parked,
its requests gone, its weights and KV cache kept; the next load of the same model with the
same settings on the node adopts it and is ready at once (`mesh bench coldstart`, row
`parked`).

The lot's memory is its own budget (`budget_bytes`: the agent's `--park-bytes`), outside the
memory the dispatcher plans on the node (`--memory-bytes`): parking never takes memory an
instance was promised. Within it, the least recently parked worker is ended first. What is
parked is reported (`models()`), so that the cold-start table predicts a load from the
parked tier only where one waits (mesh.perf.load_times.ColdStartTable).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping

from mesh.engines.engine_api import EngineError
from mesh.engines.worker_process import WorkerConnection, wait

PARK_REPLY_S = 10.0  # a worker that takes longer to drop its requests is ended, not parked


@dataclass
class Parked:
    """A worker whose pipeline is built and warm, with no requests."""

    model: str  # the model name its instance served (for reports)
    conn: WorkerConnection
    nbytes: int  # weights + the KV cache it holds (the cache never shrinks)


class ParkingLot:
    """Parked workers by load key (what must match for a worker to serve a new instance)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"a parking budget is >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lot: OrderedDict[Hashable, Parked] = OrderedDict()  # oldest first
        self._closed = False
        self._ending: set[asyncio.Task[None]] = set()

    @property
    def held_bytes(self) -> int:
        return sum(p.nbytes for p in self._lot.values())

    def models(self) -> list[str]:
        return sorted({p.model for p in self._lot.values()})

    def take(self, key: Hashable) -> Parked | None:
        """The parked worker for `key`, now the caller's; None if none waits (or it died)."""
        parked = self._lot.pop(key, None)
        if parked is not None and parked.conn.dead is not None:
            self._end(parked)
            return None
        return parked

    def room_bytes(self) -> int:
        """What the lot can take without ending a parked worker."""
        return self.budget_bytes - self.held_bytes

    def park(self, key: Hashable, parked: Parked, evict: bool = True) -> bool:
        """Keep `parked` under `key`, ending the oldest parked workers to make room; False
        (the caller ends it) when it alone is over the budget or the lot is closed, or, with
        `evict=False` (a build ahead: it never ends a worker that is parked), when it does
        not fit beside the workers parked now."""
        if self._closed or parked.conn.dead is not None or parked.nbytes > self.budget_bytes:
            return False
        if not evict and parked.nbytes > self.room_bytes() + (self._lot[key].nbytes if key in self._lot else 0):
            return False
        old = self._lot.pop(key, None)
        if old is not None:
            self._end(old)
        while self._lot and self.held_bytes + parked.nbytes > self.budget_bytes:
            self._end(self._lot.popitem(last=False)[1])
        self._lot[key] = parked
        return True

    async def hand_over(self, key: Hashable, model: str, conn: Any, nbytes: Callable[[Mapping[str, Any]], int],
                        stepping: bool = False, evict: bool = True) -> bool:
        """Park an instance's worker when its instance stops: the worker's `park` command
        drops its requests and answers its facts, from which `nbytes` says what it holds.
        False (the caller ends the worker): not a worker process, dead, in the middle of a
        step (a hung engine the watchdog gave up on, or a failed step), slow to answer, or
        no room (`evict`: as in `park`)."""
        if not isinstance(conn, WorkerConnection) or conn.dead is not None or stepping:
            return False
        try:
            async with asyncio.timeout(PARK_REPLY_S):
                facts = await wait(conn.call("park"))
        except (EngineError, TimeoutError):
            return False
        return self.park(key, Parked(model, conn, nbytes(facts)), evict)

    async def adopt(self, key: Hashable, op: str = "facts", **fields: Any) -> tuple[WorkerConnection, Any] | None:
        """The parked worker for `key` and its answer to `op` (its facts, or a resize), now
        the caller's; None if none waits or it cannot answer (then it is ended)."""
        parked = self.take(key)
        if parked is None:
            return None
        try:
            return parked.conn, await wait(parked.conn.call(op, **fields))
        except BaseException:
            self._end(parked)
            return None

    def forget(self, model: str) -> None:
        """A deleted model's parked workers end."""
        for key in [k for k, p in self._lot.items() if p.model == model]:
            self._end(self._lot.pop(key))

    def _end(self, parked: Parked) -> None:
        task = asyncio.get_running_loop().create_task(parked.conn.shutdown(30))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def close(self) -> None:
        """End every parked worker; parks nothing after."""
        self._closed = True
        while self._lot:
            self._end(self._lot.popitem(last=False)[1])
        if self._ending:
            await asyncio.gather(*self._ending, return_exceptions=True)

    def view(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "held_bytes": self.held_bytes, "models": self.models()}
