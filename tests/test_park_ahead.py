"""Parking ahead without races (mesh.node.park_ahead, issue 32 item 6): a build ahead
stops while the node serves and goes on when it is idle, runs whatever the node does once
a load waits for it, never starts after the model's first load, and parks only where the
worker fits beside those parked (weights and KV cache, never ending one of them).

The build here is a real process in a session of its own, as an OpenVINO worker is
(mesh.engines.worker_process), that counts into a file: what is checked is whether the kernel
runs it, not what it computes (the real worker's build ahead: tests/test_parking.py)."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from mesh.engines.parking import Parked, ParkingLot
from mesh.node.park_ahead import ParkAhead
from mesh.wire.agent_protocol import InstanceSpec

COUNT = """
import sys, time
path = sys.argv[1]
for i in range(1, 10**6):
    with open(path, "w") as f:
        f.write(str(i))
    if i >= int(sys.argv[2]):
        break
    time.sleep(0.01)
"""


class CountingBuild:
    """An engine whose load is a counting process in its own session (a worker's build)."""

    weight_bytes = 100
    kv_bytes_per_token = 1
    block_size = 16

    def __init__(self, counter: Path, steps: int) -> None:
        self.counter, self.steps = counter, steps
        self.worker_pid: int | None = None
        self.parking: ParkingLot | None = None
        self.park_evicts = True
        self.killed = False

    async def load(self) -> None:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", COUNT, str(self.counter), str(self.steps),
                                                    start_new_session=True)
        self.worker_pid = proc.pid
        try:
            await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def unload(self) -> None:
        pass  # a real worker would be handed to the lot here (ParkingLot.hand_over)

    def kill_worker(self) -> None:
        self.killed = True


def _count(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def _state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


async def _until(cond: Any, timeout_s: float) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


def _spec(model: str) -> InstanceSpec:
    return InstanceSpec(f"ahead-{model}", model, "/nowhere", 2048)


def test_a_build_ahead_stops_while_the_node_serves_and_goes_on_when_it_is_idle(tmp_path):
    async def main() -> None:
        counter = tmp_path / "count"
        build = CountingBuild(counter, 150)
        idle = [True]
        ahead = ParkAhead(ParkingLot(10**6), lambda spec: asyncio.sleep(0, build), lambda: idle[0])
        ahead.schedule(_spec("m"))
        await _until(lambda: _count(counter) > 2, 20)
        idle[0] = False  # the node loads or serves another model
        await asyncio.sleep(0.3)
        assert build.worker_pid is not None and _state(build.worker_pid) == "T"
        held = _count(counter)
        await asyncio.sleep(0.3)
        assert _count(counter) == held  # stopped: not one cycle more
        assert ahead.view()["building"] == ["m"] and ahead.pauses == 1
        idle[0] = True
        await _until(lambda: _count(counter) > held, 10)  # continued
        idle[0] = False
        await _until(lambda: ahead.pauses == 2, 5)
        assert ahead.pending("m") is not None  # a load of this model waits for the build: it runs now
        await _until(lambda: "m" in ahead.skipped, 20)
        assert _count(counter) == 150 and ahead.pauses == 2
        assert "does not fit" in ahead.skipped["m"]  # this stand-in parks nothing
        await ahead.close()

    asyncio.run(main())


def test_a_build_ahead_waits_for_an_idle_node_and_yields_to_the_first_load(tmp_path):
    async def main() -> None:
        counter = tmp_path / "count"
        build = CountingBuild(counter, 5)
        idle = [False]
        ahead = ParkAhead(ParkingLot(10**6), lambda spec: asyncio.sleep(0, build), lambda: idle[0])
        ahead.schedule(_spec("m"))
        await asyncio.sleep(0.3)
        assert build.worker_pid is None and ahead.view()["building"] == []  # not started while the node serves
        assert ahead.pending("m") is None  # the model's first load comes first: it builds its own worker
        idle[0] = True
        await _until(lambda: "m" in ahead.skipped, 5)
        assert "first load came" in ahead.skipped["m"] and build.worker_pid is None and not counter.exists()
        await ahead.close()

    asyncio.run(main())


class _Conn:
    dead: str | None = None

    async def shutdown(self, timeout_s: float) -> None:
        pass


def test_parking_ahead_never_ends_a_parked_worker():
    """ParkingLot.park(evict=False), what a build ahead parks with: it fits beside those parked
    or is refused; a stopped instance (evict=True) still makes room by ending the oldest."""
    async def main() -> None:
        lot = ParkingLot(250)
        assert lot.park("a", Parked("ma", _Conn(), 100)) and lot.room_bytes() == 150
        assert not lot.park("b", Parked("mb", _Conn(), 151), evict=False)
        assert lot.models() == ["ma"]
        assert lot.park("b", Parked("mb", _Conn(), 150), evict=False) and lot.room_bytes() == 0
        assert lot.park("a", Parked("ma", _Conn(), 100), evict=False)  # its own key's room counts
        assert lot.park("c", Parked("mc", _Conn(), 100))  # a stopped instance: the oldest goes
        assert lot.models() == ["ma", "mc"]
        await lot.close()

    asyncio.run(main())


def test_a_build_ahead_that_cannot_fit_its_weights_and_a_kv_block_is_not_built(tmp_path):
    async def main() -> None:
        build = CountingBuild(tmp_path / "count", 5)  # 100 bytes of weights + 16 of one KV block
        ahead = ParkAhead(ParkingLot(110), lambda spec: asyncio.sleep(0, build), lambda: True)
        ahead.schedule(_spec("m"))
        await _until(lambda: "m" in ahead.skipped, 5)
        assert "one KV block" in ahead.skipped["m"] and build.worker_pid is None
        await ahead.close()

    asyncio.run(main())
