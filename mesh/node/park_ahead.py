"""Parking ahead: a model described on a node is built there once, before its first request,
and parked, so that its first cold start takes under a second.

A parked worker (mesh.engines.parking) holds a built, warmed-up pipeline in host memory, the
fastest tier of ServerlessLLM's loading hierarchy (4.1): a load that adopts it is ready in
milliseconds instead of the seconds a build takes (`mesh bench coldstart`). Otherwise workers
are parked only when an instance stops, so a model's first load always builds: on a fresh
service every model's first requests would wait a full build, on cores shared with the other
models' first builds. Here the node that describes a model (at registration, where its first
host copy lands) builds the instance a load would build, with the load's settings, and parks
it, so that the first load adopts it.

It spends only what is idle:
- One build at a time on the node, after the model's tokenizer and its background
  preparation (mesh.engines.background_prepare: the build then reads the IR).
- Only while the node is idle: it loads no instance and none of its instances holds a
  request (NodeRuntime.idle; an instance kept alive between requests leaves the cores idle),
  and that is checked all along, not once: the build waits for the node to be
  idle before it starts, and its worker process (its whole process group) is stopped
  (SIGSTOP) as soon as the node serves or loads another model, and continued (SIGCONT) when
  the node is idle again. A stopped build takes no
  cycles from serving; it keeps its memory, which is the parking budget's, outside what
  the dispatcher plans. (Why not idle priority: an unprivileged process that drops to
  SCHED_IDLE or nice 19 may not come back, and the worker built here is the one that
  serves once a load adopts it.)
- A load of the model that comes while its build is under way waits for that build and
  adopts it (`pending`) rather than building a second worker beside it: the build then
  runs whatever the node does, since a request now waits for it. A load that comes before
  the build starts builds its own, and the build ahead is dropped.
- Only where the parking budget has room without ending a parked worker, counting what the
  worker really holds: its weights and the KV cache its warm-up allocated (the facts the
  worker answers when it is parked; ParkingLot.park with evict=False), checked atomically
  with the parking itself.
A build that fails, or that no budget holds, leaves the model to its first load as before.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any, Awaitable, Callable, TypeVar

from mesh.engines.parking import ParkingLot
from mesh.tasks import cancel_all
from mesh.wire.agent_protocol import InstanceSpec

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a build ahead checks that the node is still idle (its pause lags this much)
T = TypeVar("T")


class ParkAhead:
    """Builds and parks the instances of models described on this node (module docstring)."""

    def __init__(self, parking: ParkingLot, build: Callable[[InstanceSpec], Awaitable[Any]],
                 idle: Callable[[], bool]) -> None:
        """`build(spec)`: an unloaded engine for the load `spec` (the agent's make_engine);
        `idle()`: the node loads no instance and serves no request now."""
        self.parking = parking
        self.build = build
        self.idle = idle
        self._lock = asyncio.Lock()  # one build at a time on the node
        self._scheduled: dict[str, asyncio.Future[None]] = {}  # model -> its task (waits, builds, parks)
        self._building: dict[str, asyncio.Future[None]] = {}  # model -> done when its build has ended
        self._wanted: set[str] = set()  # models a load asked for (their build runs whatever the node does)
        self.pauses = 0  # times a build was stopped because the node served (views, tests)
        self.parked: list[str] = []  # models parked ahead, in order (views, tests)
        self.skipped: dict[str, str] = {}  # model -> why it was not parked ahead

    def schedule(self, spec: InstanceSpec, first: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Park `spec`'s instance ahead once `first()` (the model's tokenizer build, its
        background preparation) has ended; a model already scheduled is left alone."""
        if self.parking.budget_bytes <= 0 or spec.model in self._scheduled:
            return
        self._scheduled[spec.model] = asyncio.ensure_future(self._park(spec, first))

    def pending(self, model: str) -> asyncio.Future[None] | None:
        """The build of `model` under way (a load waits for it, then adopts its worker; the
        build now runs even while the node serves); None before it starts: a load then
        comes first, and the build ahead is dropped. Only a load asks."""
        scheduled = self._scheduled.get(model)
        if scheduled is not None and not scheduled.done():
            self._wanted.add(model)
        return self._building.get(model)

    async def _park(self, spec: InstanceSpec, first: Callable[[], Awaitable[Any]] | None) -> None:
        try:
            if first is not None:
                try:
                    await first()
                except Exception:  # noqa: BLE001 - the build below reports what matters
                    pass
            async with self._lock:
                while not self.idle() and spec.model not in self._wanted:
                    await asyncio.sleep(POLL_S)  # a build competes with serving for the node's cores
                if spec.model in self._wanted:
                    why = "its first load came before its build could start"
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
        finally:
            self._wanted.discard(spec.model)
        if why:
            self.skipped[spec.model] = why
            log.info("model %s is not parked ahead: %s", spec.model, why)
        else:
            self.parked.append(spec.model)
            log.info("model %s is parked ahead: its first load here adopts a built worker", spec.model)

    async def _build_and_park(self, spec: InstanceSpec) -> str:
        """'' once parked, else why not."""
        engine = await self.build(spec)
        room = self.parking.room_bytes()
        least = engine.weight_bytes + engine.kv_bytes_per_token * getattr(engine, "block_size", 1)
        if least > room:
            return (f"the parking budget has {room / 2**20:.0f} MiB free and its weights and one KV block "
                    f"take {least / 2**20:.0f} MiB")
        engine.parking = self.parking
        engine.park_evicts = False  # parked only beside the workers parked now, never in their place
        try:
            await self._while_idle(spec.model, engine, engine.load())
        except BaseException:
            engine.kill_worker()  # cancelled (the agent stops) or failed: nothing of it is kept
            raise
        await engine.unload()  # parks the worker (or ends it: then the next load builds)
        if spec.model in self.parking.models():
            return ""
        return (f"its worker (weights and the KV cache its warm-up allocated) does not fit beside the workers "
                f"parked now ({self.parking.room_bytes() / 2**20:.0f} MiB free)")

    async def _while_idle(self, model: str, engine: Any, work: Awaitable[T]) -> T:
        """Run `work` (the build in `engine`'s worker), stopping the worker's process group
        while the node serves and `model` is not wanted by a load, continuing it otherwise."""
        task = asyncio.ensure_future(work)
        stopped: int | None = None  # the process group stopped now
        try:
            while not task.done():
                pid = getattr(engine, "worker_pid", None)
                run = model in self._wanted or self.idle()
                if stopped is None and not run and pid is not None:
                    if _signal_group(pid, signal.SIGSTOP):
                        stopped = pid
                        self.pauses += 1
                        log.info("the build ahead of %s is stopped: the node serves", model)
                elif stopped is not None and run:
                    _signal_group(stopped, signal.SIGCONT)
                    stopped = None
                await asyncio.wait([task], timeout=POLL_S)
        finally:
            if stopped is not None:
                _signal_group(stopped, signal.SIGCONT)
            if not task.done():
                task.cancel()
                await asyncio.wait([task])
        return task.result()

    def view(self) -> dict[str, Any]:
        return {"parked": list(self.parked), "skipped": dict(self.skipped),
                "building": sorted(self._building), "pauses": self.pauses}

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
        await cancel_all(self._scheduled.values())


def _signal_group(pid: int, sig: int) -> bool:
    """Send `sig` to the process group a worker leads (its start_new_session); False if gone."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
