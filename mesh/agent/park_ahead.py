"""Parking ahead: a model described on a node is built there once, before its first request,
and parked (issue 23: cold starts in under a second).

A parked worker (engines.parking) holds a built, warmed-up pipeline in host memory, the
fastest tier of ServerlessLLM's loading hierarchy (4.1): a load that adopts it is ready in
milliseconds instead of the seconds a build takes (`mesh bench coldstart`). Workers used to
be parked only when an instance stopped, so a model's first load always built: on a fresh
service every model's first requests waited a full build, on cores shared with the other
models' first builds. Here the node that describes a model (at registration, where its first
host copy lands) builds the instance a load would build, with the load's settings, and parks
it, so that the first load adopts it.

It spends only what is idle: one build at a time on the node, after the model's tokenizer
and its background preparation (engines.background_prepare: the build then reads the IR),
only while the node runs and loads no instance (a build competes with serving for the
cores), and only where the parking budget has room without ending a parked worker. A load of
the model that comes while its build is under way waits for that build and adopts it
(`pending`) rather than building a second worker beside it. A build that fails, or that no
budget holds, leaves the model to its first load as before.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from engines.parking import ParkingLot
from mesh.agent.protocol import InstanceSpec

log = logging.getLogger("mesh.agent.park_ahead")


class ParkAhead:
    """Builds and parks the instances of models described on this node (module docstring)."""

    def __init__(self, parking: ParkingLot, build: Callable[[InstanceSpec], Awaitable[Any]],
                 idle: Callable[[], bool]) -> None:
        """`build(spec)`: an unloaded engine for the load `spec` (the agent's make_engine);
        `idle()`: the node runs and loads no instance now."""
        self.parking = parking
        self.build = build
        self.idle = idle
        self._lock = asyncio.Lock()  # one build at a time on the node
        self._scheduled: dict[str, asyncio.Future[None]] = {}  # model -> its task (waits, builds, parks)
        self._building: dict[str, asyncio.Future[None]] = {}  # model -> done when its build has ended
        self.parked: list[str] = []  # models parked ahead, in order (views, tests)
        self.skipped: dict[str, str] = {}  # model -> why it was not parked ahead

    def schedule(self, spec: InstanceSpec, first: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Park `spec`'s instance ahead once `first()` (the model's tokenizer build, its
        background preparation) has ended; a model already scheduled is left alone."""
        if self.parking.budget_bytes <= 0 or spec.model in self._scheduled:
            return
        self._scheduled[spec.model] = asyncio.ensure_future(self._park(spec, first))

    def pending(self, model: str) -> asyncio.Future[None] | None:
        """The build of `model` under way (a load waits for it, then adopts its worker);
        None before it starts: a load then comes first, and the build is skipped."""
        return self._building.get(model)

    async def _park(self, spec: InstanceSpec, first: Callable[[], Awaitable[Any]] | None) -> None:
        try:
            if first is not None:
                try:
                    await first()
                except Exception:  # noqa: BLE001 - the build below reports what matters
                    pass
            async with self._lock:
                if not self.idle():
                    why = "the node is serving or loading (a build would take its cores)"
                else:
                    self._building[spec.model] = building = asyncio.get_running_loop().create_future()
                    try:
                        why = await self._build_and_park(spec)
                    finally:
                        del self._building[spec.model]
                        building.set_result(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an optimisation: the first load builds instead
            why = f"its build failed: {exc}"
        if why:
            self.skipped[spec.model] = why
            log.info("model %s is not parked ahead: %s", spec.model, why)
        else:
            self.parked.append(spec.model)
            log.info("model %s is parked ahead: its first load here adopts a built worker", spec.model)

    async def _build_and_park(self, spec: InstanceSpec) -> str:
        """'' once parked, else why not."""
        engine = await self.build(spec)
        room = self.parking.budget_bytes - self.parking.held_bytes
        if engine.weight_bytes > room:
            return (f"the parking budget has {room / 2**20:.0f} MiB free and the weights alone take "
                    f"{engine.weight_bytes / 2**20:.0f} MiB")
        engine.parking = self.parking
        try:
            await engine.load()
        except BaseException:
            engine.kill_worker()  # cancelled (the agent stops) or failed: nothing of it is kept
            raise
        await engine.unload()  # parks the worker (or ends it: then the next load builds)
        return "" if spec.model in self.parking.models() else "the parking lot did not keep its worker"

    def view(self) -> dict[str, Any]:
        return {"parked": list(self.parked), "skipped": dict(self.skipped),
                "building": sorted(self._building)}

    def models(self) -> list[str]:
        """The models it holds anything for (scheduled, parked or skipped)."""
        return sorted(set(self._scheduled) | set(self.parked) | set(self.skipped))

    def forget(self, model: str) -> None:
        """A deleted model: its build ahead stops (scheduled or under way) and its record goes."""
        task = self._scheduled.pop(model, None)
        if task is not None and not task.done():
            task.cancel()
        if model in self.parked:
            self.parked.remove(model)
        self.skipped.pop(model, None)

    async def close(self) -> None:
        """Stop the builds (a worker in the middle of one dies with it)."""
        futures = [f for f in self._scheduled.values() if not f.done()]
        for fut in futures:
            fut.cancel()
        await asyncio.gather(*futures, return_exceptions=True)
