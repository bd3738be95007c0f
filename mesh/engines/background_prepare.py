"""Preparing models in the background (mesh.engines.node_cache.prepare), one at a time, in a
process of its own at idle CPU priority (SCHED_IDLE, nice 19; mesh.background.
run_as_background) with one compute thread: never on a request's path.

    python -m mesh.engines.background_prepare GGUF [--root DIR]

Why a process: preparation converts and compiles for seconds while holding the GIL part of
the time; in the node agent that would stall its event loop (admissions, heartbeats), and
in an instance's worker it would delay that instance's iterations. Why idle priority: on a
node with few cores it competes with serving; it is worth doing only when cores are idle
(`mesh bench interference` measures what it still costs a serving instance).

Order: by expected need (`schedule(path, need_at)`): the model whose first load is expected
first is prepared first. A model received here before any request (its first host copy, at
registration: its traffic starts soon) is needed now; a model that was loaded here from its
GGUF is prepared for its next load, which cannot come before its instance stops
(NEXT_LOAD_S later). Equal needs keep the order they came in.
The process dies with its parent (PR_SET_PDEATHSIG); a half-written folder it leaves is
a `.tmp-*` folder that lookups never read and the next preparation removes.
"""
from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import logging
import signal
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

NEXT_LOAD_S = 60.0  # a loaded model's next load here: no sooner than its instance's keep-alive (the default's)


class BackgroundPreparer:
    """Prepares the GGUFs it is given, one at a time, each once, in a child process."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else None
        self._queue: list[tuple[float, int, str]] = []  # a heap of (need_at, order, path)
        self._order = itertools.count()
        self._seen: set[str] = set()
        self._current: str | None = None  # the path being prepared now
        self._task: asyncio.Task[None] | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self.done: dict[str, int] = {}  # path -> the child's exit status

    def schedule(self, path: str | Path, need_at: float | None = None) -> bool:
        """Queue `path` for preparation unless it is not a GGUF, is prepared already (and
        this OpenVINO's blob import probed), or was queued before; `need_at`: the event
        loop's time of its expected first load here (default now; module docstring). A path
        queued and not started yet moves up to an earlier need. Needs a running event loop.
        Returns whether it was queued."""
        p = str(Path(path).resolve())
        loop = asyncio.get_running_loop()
        need = loop.time() if need_at is None else need_at
        queued = next((i for i, q in enumerate(self._queue) if q[2] == p), None)
        if queued is not None and need < self._queue[queued][0]:
            self._queue[queued] = (need, self._queue[queued][1], p)
            heapq.heapify(self._queue)
        if p in self._seen or not _is_gguf(Path(p)):
            return False
        from mesh.engines.node_cache import blob_support, find_prepared

        if find_prepared(p, self.root) is not None and blob_support(self.root, "CPU") is not None:
            return False  # prepared, and the blob probe answered (a killed probe is run again)
        self._seen.add(p)
        heapq.heappush(self._queue, (need, next(self._order), p))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain())
        return True

    async def _drain(self) -> None:
        from mesh.engines.worker_process import background_env

        while self._queue:
            path = heapq.heappop(self._queue)[2]
            self._current = path
            argv = [sys.executable, "-m", "mesh.engines.background_prepare", path]
            if self.root is not None:
                argv += ["--root", str(self.root)]
            self._proc = await asyncio.create_subprocess_exec(*argv, env=background_env(), stdout=subprocess.DEVNULL,
                                                              stderr=subprocess.PIPE)
            _, err = await self._proc.communicate()
            if path in self._seen and not Path(path).exists():
                # its file removed under it (a deleted model's copy went before its forget came): no error
                log.info("not preparing %s: its file was removed", path)
                self._seen.discard(path)
            if path not in self._seen:  # forgotten meanwhile (its model deleted: killed) or removed: not recorded
                self._proc = self._current = None
                continue
            self.done[path] = self._proc.returncode
            if self._proc.returncode != 0:
                log.warning("preparing %s failed (%s): %s", path, self._proc.returncode,
                            err.decode(errors="replace")[-1000:])
            self._proc = None
            self._current = None

    def forget(self, path: str | Path) -> None:
        """A deleted model's file: it leaves the queue and the records (they grew by every
        model ever received), and its preparation under way is killed (its CPU is not spent on
        a file that is going away)."""
        p = str(Path(path).resolve())
        self._queue = [q for q in self._queue if q[2] != p]
        heapq.heapify(self._queue)
        self._seen.discard(p)
        self.done.pop(p, None)
        if self._current == p and self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    async def wait(self, path: str | Path | None = None) -> None:
        """Until everything queued is prepared (tests, benchmarks), or, with `path`, until that
        model's preparation has ended (at once if it is not queued): a build ahead waits for
        its own model's IR, not for every other model's."""
        if path is not None:
            p = str(Path(path).resolve())
            while self._current == p or any(q[2] == p for q in self._queue):
                await asyncio.sleep(0.1)
            return
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def close(self) -> None:
        """Stop: the preparation in flight is killed at once (its `.tmp-*` folder is never
        used, and the next preparation removes it)."""
        self._queue.clear()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.kill()  # not SIGTERM: a conversion inside OpenVINO would hold it for seconds
            await proc.wait()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it was being stopped
                pass
            self._task = None


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mesh.engines.background_prepare")
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--root", help="the node cache's root (default: <data dir>/compiled)")
    parser.add_argument("--no-probe", action="store_true", help="do not probe whether compiled blobs import")
    parser.add_argument("--normal-priority", action="store_true",
                        help="run at normal priority with OpenVINO's default threads (`mesh bench interference`'s "
                             "comparison)")
    args = parser.parse_args(argv)
    from mesh.background import run_as_background
    from mesh.lifetime import die_with_parent

    if args.normal_priority:
        die_with_parent()
    else:
        run_as_background(own_session=True)  # first: OpenVINO's thread pools inherit it; it dies with the agent
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds where it can: prepare removes its .tmp
    from mesh.engines.node_cache import prepare

    prepared = prepare(args.model, args.root, probe_blobs=not args.no_probe,
                       threads=None if args.normal_priority else 1)
    print(prepared.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
