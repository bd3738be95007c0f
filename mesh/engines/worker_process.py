"""One engine instance in its own worker process, driven over sockets: both sides.

Why a process: an engine's iteration computes for tens of milliseconds to seconds, and
OpenVINO's holds the Python GIL while it does; vLLM's shutdown is process-wide. In a worker
the agent's event loop stays free while an instance computes (admissions, shadow
validations, aborts and heartbeats are answered at once), the end of the process frees all
of the instance's memory, and a crash takes down one instance, not the node agent.

Wire: pickled dicts with a 4-byte big-endian length in front, on a socket pair whose child
end the worker inherits (`--fd N`, and `--sync-fd M` for a second socket served by a
thread, used by vLLM's tokenizer).

- Parent (`WorkerConnection`): `call(op, **fields)` sends a command and returns a
  concurrent future resolved by its reply, in command order (a reader thread reads the
  replies); `wait(future)` awaits one from asyncio. Commands sent without waiting (add,
  abort) are still executed in order before the next step.
- Parent, sync socket: `call_sync(op, deadline_s=..., **fields)` blocks its thread for the
  reply, at most `deadline_s` (default `SYNC_CALL_DEADLINE_S`, the node's tokenize-job
  deadline: mesh.node.tokenizers). A worker that answers nothing by then is stuck: the
  call raises `WorkerStuck`, and the sync socket is closed for good (a late reply would
  answer the next call); the caller kills the worker (the node agent does:
  mesh.node.model_fronts).
- Child (`WorkerLoop`): a reader thread queues the commands as they arrive (so the parent
  never blocks on a full socket while an iteration runs), the main thread executes them in
  order with `handle(op, msg)` and answers {"ok": True, "value": ...} or {"ok": False,
  "error": message, "engine_error": bool}. It exits on `shutdown` (os._exit: the process
  ending frees the instance's memory at once) or when the parent's socket closes.

A worker dies with its parent: the socket's end says so between two commands, and
PR_SET_PDEATHSIG kills it at once even in the middle of one (`die_with_parent`). It gets
the parent's environment without Mesh's secrets (`worker_env`): an engine has no use for
the admin, metrics, agent or weights tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import pickle
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any, Callable

from mesh.background import BACKGROUND_THREADS
from mesh.engines.engine_api import EngineError, FinishReason, StepResult
from mesh.lifetime import die_with_parent
from mesh.policy.batching import IterationKind

REPO_ROOT = Path(__file__).resolve().parents[2]  # <repo>/mesh/engines/worker_process.py

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")

# Mesh's secrets: what only the control service and its agents' ports need, never a worker.
SECRET_ENV = ("MESH_ADMIN_TOKEN", "MESH_METRICS_TOKEN", "MESH_AGENT_TOKEN", "MESH_WEIGHTS_TOKEN")

# How long a call on a worker's sync socket (vLLM's tokenizer) may take, and the node's tokenize
# job deadline (mesh.node.tokenizers.JOB_TIMEOUT_S is this number). A first call builds the
# tokenizer (2.6 s for the demo GGUF here, more on a core shared with loading instances); a
# 5.7 MiB prompt tokenizes in ~1 s.
SYNC_CALL_DEADLINE_S = 30.0


class WorkerStuck(EngineError):
    """A worker answered no call on its sync socket within the call's deadline: it is stuck
    (wedged or stopped), and its sync socket is closed; the caller kills it."""


def worker_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: without SECRET_ENV, the repository on
    PYTHONPATH (workers run `python -m mesh...` from any folder), and `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def background_env(**extra: str) -> dict[str, str]:
    """`worker_env` for a background job (a conversion, an IR preparation): bounded thread pools."""
    return worker_env(**BACKGROUND_THREADS, **extra)


def send_msg(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_msg(sock: socket.socket, deadline: float | None = None) -> Any:
    """One message; EOFError when the other side closed the socket. `deadline` (a
    time.monotonic() instant; the socket must have a timeout): TimeoutError past it."""
    header = _recv_exact(sock, _LEN.size, deadline)
    return pickle.loads(_recv_exact(sock, _LEN.unpack(header)[0], deadline))


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks = []
    while n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the reply did not come in time")
            sock.settimeout(left)
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("socket closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


async def wait(fut: concurrent.futures.Future) -> Any:
    """Await a command's reply from asyncio."""
    if fut.done():
        return fut.result()
    return await asyncio.wrap_future(fut)


class WorkerRequests:
    """The requests an engine's worker holds, as the engine sees them: `live` maps each id to
    [prompt tokens, generated tokens]. Adds and aborts reach the worker without a wait, so
    a refused add is learnt later (it ends, aborted, at the next step) and a step's token
    for a request aborted while the step ran is dropped (`apply`)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.live: dict[str, list[int]] = {}
        self._refused: dict[str, str] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.live

    def __bool__(self) -> bool:
        return bool(self.live)

    def added(self, request_id: str, prompt_len: int, sent: concurrent.futures.Future) -> None:
        self.live[request_id] = [prompt_len, 0]
        sent.add_done_callback(lambda f, rid=request_id: self._add_done(rid, f))

    def _add_done(self, request_id: str, fut: concurrent.futures.Future) -> None:
        exc = fut.exception()
        if exc is not None and request_id in self.live:
            log.warning("%s: the worker refused request %s: %s", self.model_name, request_id, exc)
            self._refused[request_id] = str(exc)

    def aborted(self, request_id: str) -> bool:
        """Forget a request; whether it was live (then the worker must be told)."""
        self._refused.pop(request_id, None)
        return self.live.pop(request_id, None) is not None

    def clear(self) -> None:
        self.live.clear()
        self._refused.clear()

    def refused(self) -> StepResult | None:
        """The requests the worker refused since the last step, ended (aborted), if any."""
        if not self._refused:
            return None
        finished = {rid: FinishReason.ABORT for rid in self._refused if self.live.pop(rid, None) is not None}
        self._refused.clear()
        return StepResult(IterationKind.DECODE, [], [], [], finished) if finished else None

    def apply(self, result: StepResult) -> StepResult:
        """A worker's step result as the engine reports it: what belongs to requests aborted
        while the step ran is dropped; tokens are counted and finished requests forgotten."""
        live = self.live
        keep = [i for i, rid in enumerate(result.request_ids) if rid in live]
        if len(keep) != len(result.request_ids):
            result = StepResult(result.kind, [result.request_ids[i] for i in keep],
                                [result.token_ids[i] for i in keep] if result.token_ids is not None else None,
                                [result.texts[i] for i in keep] if result.texts is not None else None,
                                {k: v for k, v in result.finished.items() if k in live},
                                [result.logprobs[i] for i in keep] if result.logprobs is not None else None)
        elif any(rid not in live for rid in result.finished):
            result.finished = {k: v for k, v in result.finished.items() if k in live}
        for rid in result.request_ids:
            live[rid][1] += 1
        for rid in result.finished:
            live.pop(rid, None)
        return result


class WorkerConnection:
    """A worker process (`python -m <module> --fd N [--sync-fd M]`) and its sockets;
    replies resolve futures in command order. `name` says whose worker it is in errors."""

    def __init__(self, module: str, python: str, env: dict[str, str], log_path: Path, *, name: str,
                 sync: bool = False, install_hint: str = "") -> None:
        self.name = name
        parent_main, child_main = socket.socketpair()
        parent_sync, child_sync = socket.socketpair() if sync else (None, None)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "ab")
        fds = [child_main.fileno(), *([child_sync.fileno()] if child_sync is not None else [])]
        argv = [python, "-m", module, "--fd", str(child_main.fileno())]
        if child_sync is not None:
            argv += ["--sync-fd", str(child_sync.fileno())]
        try:
            self.proc = subprocess.Popen(argv, pass_fds=fds, env=env, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
                                         stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self._log.close()
            raise EngineError(f"cannot start the {name} worker with {python}: {exc}"
                              + (f"; {install_hint}" if install_hint else "")) from exc
        finally:
            child_main.close()
            if child_sync is not None:
                child_sync.close()
        self.main, self.sync = parent_main, parent_sync
        self._pending: deque[concurrent.futures.Future] = deque()
        self._send_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self.sync_stuck: str | None = None  # why the sync socket is closed for good (WorkerStuck)
        self.dead: str | None = None
        self._reader = threading.Thread(target=self._read, name=f"{name}-conn-{self.proc.pid}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        try:
            while True:
                reply = recv_msg(self.main)
                fut = self._pending.popleft()
                try:
                    if reply.get("ok"):
                        fut.set_result(reply.get("value"))
                    else:
                        fut.set_exception(EngineError(reply.get("error", f"{self.name} worker error")))
                except concurrent.futures.InvalidStateError:
                    pass  # its waiter was cancelled (asyncio.wrap_future cancels it): the reply has no taker,
                    # and the replies after it still go to theirs (this thread dying would strand them all)
        except (EOFError, OSError, IndexError) as exc:
            self._fail(f"the {self.name} worker (pid {self.proc.pid}) stopped ({type(exc).__name__})")

    def _fail(self, why: str) -> None:
        if self.dead is None:
            self.dead = f"{why}; last lines of its log {self.log_path}:\n{self.log_tail()}"
        while self._pending:
            fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(EngineError(self.dead))

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                text = f.read().decode(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def call(self, op: str, **fields: Any) -> concurrent.futures.Future:
        """Send a command; the future gets its reply (EngineError for a failure)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead is not None:
            fut.set_exception(EngineError(self.dead))
            return fut
        with self._send_lock:
            self._pending.append(fut)
            try:
                send_msg(self.main, {"op": op, **fields})
            except OSError as exc:
                self._fail(f"cannot reach the {self.name} worker: {exc}")
        return fut

    def call_sync(self, op: str, deadline_s: float = SYNC_CALL_DEADLINE_S, **fields: Any) -> Any:
        """A call on the sync socket (answered by a worker thread while the main one steps),
        blocking for at most `deadline_s`: past it, WorkerStuck, and the sync socket is
        closed for good (module docstring)."""
        if self.dead is not None:
            raise EngineError(self.dead)
        if self.sync is None:
            raise EngineError(f"the {self.name} worker has no sync socket")
        deadline = time.monotonic() + deadline_s
        if not self._sync_lock.acquire(timeout=deadline_s):  # a call before this one is stuck (it fails soon)
            raise WorkerStuck(f"the {self.name} worker (pid {self.proc.pid}) answered no {op} within {deadline_s:g} s: "
                              "a call before it is stuck")
        try:
            if self.sync_stuck is not None:
                raise WorkerStuck(self.sync_stuck)
            try:
                self.sync.settimeout(max(1e-3, deadline - time.monotonic()))  # sendall's whole send
                send_msg(self.sync, {"op": op, **fields})
                reply = recv_msg(self.sync, deadline)
            except TimeoutError as exc:  # socket.timeout too
                self.sync_stuck = (f"the {self.name} worker (pid {self.proc.pid}) answered no {op} within "
                                   f"{deadline_s:g} s: it is stuck")
                _shut(self.sync)  # its reply, if it ever comes, would answer the next call
                raise WorkerStuck(self.sync_stuck) from exc
            except (EOFError, OSError) as exc:
                raise EngineError(f"the {self.name} worker's sync socket is unreachable: {exc}") from exc
        finally:
            self._sync_lock.release()
        if not reply.get("ok"):
            raise EngineError(reply.get("error", f"{self.name} worker error"))
        return reply.get("value")

    async def shutdown(self, timeout_s: float) -> None:
        """Ask the worker to exit (it answers first), then close: the process ending frees
        the instance's memory."""
        if self.dead is None:
            try:
                await asyncio.wait_for(wait(self.call("shutdown")), timeout=timeout_s)
            except (EngineError, asyncio.TimeoutError):
                pass
        await asyncio.to_thread(self.close)

    def kill(self) -> None:
        """Kill the worker now (SIGKILL: a stopped or wedged worker answers nothing, not even
        `shutdown`), then close: its memory goes with it."""
        try:
            self.proc.kill()
        except OSError:
            pass
        self.close(timeout=10.0)

    def close(self, timeout: float = 30.0) -> None:
        for s in (self.main, self.sync):  # shut first: a thread blocked on one wakes up (close alone leaves it)
            if s is not None:
                _shut(s)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _shut(sock: socket.socket) -> None:
    """Shut a socket down both ways (a thread blocked on it wakes up), then close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class WorkerLoop:
    """The worker's side: subclasses implement `handle(op, msg)` (and `serve_sync(msg)` for
    the sync socket, `on_parent_gone()` for clean-up when the parent vanished)."""

    def __init__(self, main: socket.socket, sync: socket.socket | None = None) -> None:
        self.main = main
        self.sync = sync
        self.commands: queue.Queue = queue.Queue()

    def handle(self, op: str, msg: dict[str, Any]) -> Any:
        raise NotImplementedError

    def serve_sync(self, msg: dict[str, Any]) -> Any:
        raise ValueError(f"unknown call {msg.get('op')!r}")

    def on_parent_gone(self) -> None:
        """The parent closed its socket: release what needs releasing before exiting."""

    def before_exit(self) -> None:
        """Runs after the reply to `shutdown`, just before the process ends."""

    def _read_main(self) -> None:
        try:
            while True:
                self.commands.put(recv_msg(self.main))
        except (EOFError, OSError):
            self.commands.put(None)

    def _serve_sync(self) -> None:
        try:
            while True:
                msg = recv_msg(self.sync)
                try:
                    send_msg(self.sync, {"ok": True, "value": self.serve_sync(msg)})
                except Exception as exc:  # noqa: BLE001 - every failure goes back as a message
                    send_msg(self.sync, {"ok": False, "error": describe(exc), "engine_error": _is_engine_error(exc)})
        except (EOFError, OSError):
            return

    def run(self) -> int:
        die_with_parent()
        threading.Thread(target=self._read_main, name="worker-reader", daemon=True).start()
        if self.sync is not None:
            threading.Thread(target=self._serve_sync, name="worker-sync", daemon=True).start()
        while True:
            msg = self.commands.get()
            if msg is None:  # the parent is gone
                self.on_parent_gone()
                return 0
            op = msg.get("op")
            try:
                # `shutdown` is the loop's own: answered here, then the process ends (below)
                reply = {"ok": True, "value": None if op == "shutdown" else self.handle(op, msg)}
            except Exception as exc:  # noqa: BLE001 - every command gets a reply, failed or not
                log.debug("%s failed", op, exc_info=True)
                reply = {"ok": False, "error": describe(exc), "engine_error": _is_engine_error(exc)}
            try:
                send_msg(self.main, reply)
            except OSError:
                self.on_parent_gone()
                return 0
            if op == "shutdown":
                self.before_exit()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)


def worker_main(prog: str, make: Callable[[socket.socket], WorkerLoop], argv: list[str] | None = None) -> int:
    """The `main` of a worker module with one socket (`python -m MODULE --fd N`): logging at
    $MESH_WORKER_LOG (default WARNING), then `make(socket).run()`."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--fd", type=int, required=True, help="main socket (inherited file descriptor)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MESH_WORKER_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return make(socket.socket(fileno=args.fd)).run()


def describe(exc: BaseException) -> str:
    if _is_engine_error(exc):
        return str(exc)
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _is_engine_error(exc: BaseException) -> bool:
    return isinstance(exc, EngineError)
