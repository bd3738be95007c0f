"""The benchmarks' `mesh serve`: one launcher for every bench that starts its own service.

`start_service` runs `mesh serve --host 127.0.0.1 --port 0 --data-dir DATA ARGS...` as a child
tied to the bench: the kernel sends it SIGTERM when the bench dies, however it dies
(`PR_SET_PDEATHSIG`, mesh.lifetime.die_with_parent), so the service drains,
stops its node agents and exits instead of running on under init (a bench stopped with
SIGTERM or SIGKILL runs no `finally`). It waits for the service's ready line (within a time
limit) and then keeps reading the service's stdout, so a full pipe never blocks it.
`stop_service` stops it: SIGTERM (it drains and stops), then SIGKILL past a grace time.
It runs in a session of its own: a Ctrl-C reaches the bench, which stops it in order.

The death signal belongs to the thread that started the child: call `start_service` from the
bench's main thread (a worker thread that ends would stop the service with it).
"""
from __future__ import annotations

import functools
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

READY = re.compile(r"ready url=(\S+)(?: api_key=(\S+))?")
READY_TIMEOUT_S = 600.0  # a cold machine converts and warms the demo model first


@dataclass
class ServiceProcess:
    """A `mesh serve` started by `start_service`."""
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT (no trailing slash)
    key: str  # the demo tenant's API key ("" without --demo)
    admin_token: str  # its MESH_ADMIN_TOKEN
    log: Path | None = None  # its stderr (None: the bench's own stderr)

    @property
    def pid(self) -> int:
        return self.proc.pid


def start_service(data_dir: Path, args: Sequence[str] = (), log: Path | None = None,
                  ready_timeout_s: float = READY_TIMEOUT_S) -> ServiceProcess:
    """`mesh serve` on a free loopback port with `data_dir` and `args` (e.g. "--demo",
    "--cpu-nodes", "2"), its stderr to `log` (None: inherited), dying with this process;
    returns once it printed its ready line. RuntimeError (the service stopped) if it exits
    first or is not ready within `ready_timeout_s`."""
    token = secrets.token_hex(32)
    cmd = [sys.executable, "-m", "mesh.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--data-dir", str(data_dir), *args]
    from mesh.lifetime import die_with_parent

    err: IO | None = open(log, "a") if log is not None else None
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env=dict(os.environ, MESH_ADMIN_TOKEN=token), start_new_session=True,
                                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM))
    finally:
        if err is not None:
            err.close()  # the child holds its own copy
    ready: list[re.Match] = []
    seen = threading.Event()

    def read() -> None:  # the ready line, then the rest (a full pipe would block the service)
        assert proc.stdout is not None
        for line in proc.stdout:
            if not ready and (m := READY.search(line)):
                ready.append(m)
                seen.set()
        seen.set()  # its stdout closed: it exited

    threading.Thread(target=read, name=f"mesh serve {proc.pid} stdout", daemon=True).start()
    if not seen.wait(ready_timeout_s) or not ready:
        why = (f"exited with status {proc.poll()}" if proc.poll() is not None
               else f"was not ready in {ready_timeout_s:g} s")
        proc.kill()  # (no handlers yet: SIGTERM would end it as abruptly; its agents exit on EOF)
        proc.wait(30)
        raise RuntimeError(f"mesh serve {why} before its ready line"
                           + (f"; its log ends:\n{_tail(log)}" if log else ""))
    m = ready[0]
    return ServiceProcess(proc, m.group(1).rstrip("/"), m.group(2) or "", token, log)


def stop_service(service: ServiceProcess, grace_s: float = 90.0) -> int | None:
    """Stop it: SIGTERM (it drains its open requests, up to its --drain-timeout, and stops its
    agents); SIGKILL if it has not exited after `grace_s`. Its exit status (None if it could
    not be reaped)."""
    proc = service.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            return None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
