"""A worker's sync socket has a deadline (issue 32 item 4; mesh.engines.worker_process): the real
vLLM worker module, started with this Python (its sync side answers without vLLM), stopped
with SIGSTOP so that it answers nothing."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from mesh.engines.engine_api import EngineError
from mesh.engines.worker_process import WorkerConnection, WorkerStuck, worker_env


@pytest.fixture
def worker(tmp_path: Path):
    conn = WorkerConnection("mesh.engines.vllm_worker", sys.executable, worker_env(), tmp_path / "worker.log",
                            name="vLLM", sync=True)
    yield conn
    conn.kill()  # SIGKILL ends it stopped or not; reaped


def stop_process(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped. The kernel stops a
    process's threads one by one, starting from one it picks; on a busy machine that one may
    wait for a core, and meanwhile another thread can still answer a call (a vLLM worker busy
    importing answered a tokenize after its SIGSTOP here, twice, before this wait)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    tasks = Path(f"/proc/{pid}/task")
    while True:
        states = set()
        for task in tasks.iterdir():
            try:
                states.add((task / "stat").read_text().rpartition(")")[2].split()[0])
            except OSError:  # the thread ended meanwhile
                continue
        if states <= {"T", "t"}:
            return
        assert time.monotonic() < deadline, f"pid {pid} did not stop: its threads are {states}"
        time.sleep(0.01)


def _answered(conn: WorkerConnection) -> None:
    """A sync call the worker answers (with an error: no model was named): the socket works."""
    with pytest.raises(EngineError, match="model_path") as e:
        conn.call_sync("decode", 60.0, ids=[1])
    assert not isinstance(e.value, WorkerStuck)


@pytest.mark.timeout(60)
def test_a_sync_call_to_a_stopped_worker_ends_at_its_deadline_and_the_socket_is_closed_for_good(worker):
    _answered(worker)  # started and answering
    stop_process(worker.pid)
    start = time.monotonic()
    with pytest.raises(WorkerStuck, match=r"answered no decode within 0.5 s: it is stuck"):
        worker.call_sync("decode", 0.5, ids=[1])
    took = time.monotonic() - start
    assert 0.5 <= took < 5.0, took  # the deadline, not forever (the machine is shared)
    # the worker wakes up and answers the call given up on: that late reply must not answer the
    # next call (it would, on an open socket): the socket is closed, every later call fails at once
    os.kill(worker.pid, signal.SIGCONT)
    start = time.monotonic()
    with pytest.raises(WorkerStuck, match="it is stuck"):
        worker.call_sync("decode", 30.0, ids=[2])
    assert time.monotonic() - start < 1.0
    assert worker.dead is None  # the main socket is untouched: the node decides (kills the worker)


@pytest.mark.timeout(60)
def test_killing_a_worker_frees_a_thread_blocked_on_its_sync_socket(worker):
    """A kill (the node's, when a tokenize job ran past its deadline) wakes a thread still in
    a sync call at once, long before that call's own deadline."""
    _answered(worker)
    stop_process(worker.pid)
    failed: list[BaseException] = []

    def call() -> None:
        try:
            worker.call_sync("decode", 120.0, ids=[1])
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            failed.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # blocked on the stopped worker
    pid = worker.pid
    worker.kill()
    thread.join(10.0)
    assert not thread.is_alive() and len(failed) == 1 and isinstance(failed[0], EngineError), failed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
