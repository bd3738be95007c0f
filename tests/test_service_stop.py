"""`mesh serve` stops in bounded time, whatever it was doing, and leaves no process behind
(issue 32's long-running service; the founders' "no process outlives the process that
started it"):

- streaming clients that vanish (their process killed mid-stream) do not hold the drain;
- SIGTERM just after a node agent was killed (its supervisor restarting it) ends the service
  and every agent, the restarted one included;
- a wedged agent (SIGSTOP: it answers nothing, reads no stdin, takes no SIGTERM) is killed
  once the stop's bound has passed, and a further signal during the stop cuts it at once;
- a second signal during the drain ends the drain;
- a benchmark that dies (SIGKILL) takes the service it started (mesh.bench.serve_process)
  and its agents along;
- a step of the stop that ignores its cancellation, and an exit that waits for it, cannot
  keep the process alive: a thread ends it, its agents killed.

Every process here is the real one: `mesh serve` (with the demo model where requests
stream), its node agents, clients with the OpenAI SDK in their own processes. Each test
marks the processes it starts (an environment variable every child inherits) and kills any
still running at its end.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from mesh.bench.serve_process import ServiceProcess, start_service, stop_service
from mesh.service.app import CLUSTER_STOP_S, HTTP_CLOSE_S, HURRY_S

MARK = "MESH_STOP_TEST"
STOP_S = HTTP_CLOSE_S + CLUSTER_STOP_S  # the stop's bound after the drain
SLACK_S = 10.0  # a loaded 2-core machine: process exits and /proc reads lag
GONE_S = 15.0  # an agent whose service has exited: it reads EOF on stdin and exits (--exit-with-parent)

_CLIENT = """
import sys, threading, time, openai
url, key, n, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=2, timeout=120)
def say(*words):
    sys.stdout.write(" ".join(map(str, words)) + "\\n")  # one write: the threads' lines stay whole
    sys.stdout.flush()
def one(i):
    deadline = time.monotonic() + 200
    while True:
        try:
            stream = client.chat.completions.create(
                model="demo/smollm2", messages=[{"role": "user", "content": f"Tell a long story, number {i}."}],
                max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True})
        except openai.APIStatusError as exc:  # a 429 (a loaded machine: its SLO not met now), a 503: again
            say("refused", i, exc.status_code)
            if time.monotonic() > deadline:
                return
            time.sleep(1.0)
            continue
        try:
            for k, chunk in enumerate(stream):
                if k == 0:
                    say("streaming", i)
            say("ended", i)
        except openai.APIError as exc:  # the service went away mid-stream
            say("cut", i, type(exc).__name__)
        return
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
for t in threads: t.start()
for t in threads: t.join()
"""

_BENCH = """
import sys, time
from pathlib import Path
from mesh.bench.serve_process import start_service
service = start_service(Path(sys.argv[1]), ["--log-level", "INFO"], log=Path(sys.argv[2]), ready_timeout_s=300)
print(service.pid, flush=True)
time.sleep(3600)
"""


@pytest.fixture
def mark(monkeypatch: pytest.MonkeyPatch):
    """A mark in the environment of every process the test starts; any still running at
    its end is killed."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARK, value)
    yield value
    for pid in marked(value):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def marked(value: str) -> dict[int, str]:
    """pid -> command line of every running process carrying the mark."""
    tag = f"{MARK}={value}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if tag in (proc / "environ").read_bytes().split(b"\0"):  # a zombie's is empty
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def left_after(value: str, limit_s: float) -> dict[int, str]:
    """The marked processes still running after up to `limit_s`."""
    deadline = time.monotonic() + limit_s
    while (left := marked(value)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def agents(value: str) -> dict[int, str]:
    return {pid: cmd for pid, cmd in marked(value).items() if " -m mesh.agent " in cmd}


def serve(tmp_path: Path, *args: str) -> ServiceProcess:
    return start_service(tmp_path / "data", ["--log-level", "INFO", *args], log=tmp_path / "serve.log",
                         ready_timeout_s=300)


def assert_exits_0(service: ServiceProcess, limit_s: float) -> None:
    """The service exits with status 0 within `limit_s` (else its status, None if it still
    runs, and its log's tail)."""
    t0 = time.monotonic()
    try:
        status = service.proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        status = None
    took = time.monotonic() - t0
    assert status == 0, f"exit {status} after {took:.1f} s:\n{log_of(service)[-3000:]}"


def log_of(service: ServiceProcess) -> str:
    assert service.log is not None
    return service.log.read_text(errors="replace")


def wait_for_log(service: ServiceProcess, text: str, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while text not in log_of(service):
        assert time.monotonic() < deadline, f"{text!r} not in the log:\n{log_of(service)[-3000:]}"
        assert service.proc.poll() is None, \
            f"the service exited ({service.proc.returncode}):\n{log_of(service)[-3000:]}"
        time.sleep(0.1)


def output_lines(proc: subprocess.Popen) -> queue.Queue[str]:
    """`proc`'s stdout lines as they come ("" once it closed), read by a thread."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    return lines


def next_line(lines: queue.Queue[str], limit_s: float, what: str) -> str:
    try:
        line = lines.get(timeout=limit_s)
    except queue.Empty:
        raise AssertionError(f"{what}: nothing within {limit_s:g} s") from None
    assert line, f"{what}: the process closed its output"
    return line


def streaming_clients(service: ServiceProcess, n: int, max_tokens: int) -> subprocess.Popen:
    """A client process with `n` streams of `max_tokens` open, once every one has its first chunk."""
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, service.url, service.key, str(n), str(max_tokens)],
                              stdout=subprocess.PIPE, text=True)
    lines = output_lines(client)
    streaming: set[str] = set()
    said: list[str] = []
    deadline = time.monotonic() + 240
    while len(streaming) < n:
        line = next_line(lines, max(0.0, deadline - time.monotonic()), f"the client's streams (it said {said[-5:]})")
        said.append(line.strip())
        if line.startswith("streaming"):
            streaming.add(line.split()[1])
    return client


def node_pid(service: ServiceProcess) -> int:
    req = urllib.request.Request(f"{service.url}/admin/cluster",
                                 headers={"Authorization": f"Bearer {service.admin_token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["nodes"][0]["pid"]


@pytest.mark.slow  # a real service (or several)
def test_streaming_clients_that_vanish_do_not_hold_the_stop(tmp_path, mark, demo_gguf):
    """Three streams open, their client process killed, SIGTERM at once: the service exits 0
    well before its 60 s drain timeout, and its agent with it."""
    service = serve(tmp_path, "--demo", "--drain-timeout", "60")
    client = None
    try:
        assert agents(mark)
        client = streaming_clients(service, 3, 600)
        client.kill()
        client.wait(10)
        service.proc.send_signal(signal.SIGTERM)
        assert_exits_0(service, STOP_S + SLACK_S)
        assert "mesh serve: stopped" in log_of(service)
        assert not left_after(mark, GONE_S), "processes outlived the service"
    finally:
        if client is not None:
            client.kill()
        stop_service(service, grace_s=5)


@pytest.mark.slow  # a real service (or several)
@pytest.mark.parametrize("delay_s", [0.0, 0.5])
def test_sigterm_while_an_agent_restarts(tmp_path, mark, delay_s):
    """An agent killed with SIGKILL, the service signalled `delay_s` later (its supervisor
    noticing the death, or starting the next agent): the service exits 0 in bounded time,
    and no agent is left, neither the killed one nor one started meanwhile."""
    service = serve(tmp_path)
    try:
        pid = node_pid(service)
        os.kill(pid, signal.SIGKILL)
        time.sleep(delay_s)
        service.proc.send_signal(signal.SIGTERM)
        assert_exits_0(service, STOP_S + SLACK_S)
        assert not left_after(mark, GONE_S), "processes outlived the service"
    finally:
        stop_service(service, grace_s=5)


@pytest.mark.slow  # a real service (or several)
@pytest.mark.parametrize("cut", [False, True])
def test_a_wedged_agent_cannot_hold_the_stop(tmp_path, mark, cut):
    """The agent stopped with SIGSTOP (it answers nothing and reads no stdin; a SIGTERM stays
    pending): the service still exits within the stop's bound, the agent killed; with a
    further signal during the stop, within HURRY_S of it."""
    service = serve(tmp_path)
    pid = node_pid(service)
    try:
        os.kill(pid, signal.SIGSTOP)
        service.proc.send_signal(signal.SIGTERM)
        if cut:
            time.sleep(3.0)  # into the agents' stop: their shutdown call (2 s) is unanswered
            assert service.proc.poll() is None, "the stop did not wait for the wedged agent"
            service.proc.send_signal(signal.SIGTERM)
        assert_exits_0(service, HURRY_S + 3.0 if cut else STOP_S + SLACK_S)
        assert not left_after(mark, GONE_S), "processes outlived the service"
        if cut:
            assert "another signal" in log_of(service)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        stop_service(service, grace_s=5)


@pytest.mark.slow  # a real service (or several)
def test_a_second_signal_ends_the_drain(tmp_path, mark, demo_gguf):
    """A live client streams (2,000 tokens: a minute or more) and the drain timeout is 300 s: a second
    SIGTERM ends the drain, and the service stops at once (its stream is cut). One sent 0.2 s
    after the first is the same burst (a dying parent's threads) and does not."""
    service = serve(tmp_path, "--demo", "--drain-timeout", "300")
    client = None
    try:
        client = streaming_clients(service, 1, 2000)
        service.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        service.proc.send_signal(signal.SIGTERM)  # the same burst
        wait_for_log(service, "draining 1 open requests", 30)
        time.sleep(2.0)
        assert service.proc.poll() is None, "the service did not wait for the open stream"
        assert "a second signal" not in log_of(service)
        service.proc.send_signal(signal.SIGTERM)
        assert_exits_0(service, STOP_S + SLACK_S)
        assert "a second signal" in log_of(service)
        assert client.wait(30) is not None  # its stream ended with the service
        assert not left_after(mark, GONE_S), "processes outlived the service"
    finally:
        if client is not None:
            client.kill()
        stop_service(service, grace_s=5)


@pytest.mark.slow  # a real service (or several)
def test_a_sigterm_the_moment_it_is_ready_stops_it_in_order(tmp_path, mark):
    """SIGTERM as soon as the ready line is read: the service's handlers are in before it
    prints that line, so it stops in order and exits 0. (Printed before them, a SIGTERM in
    between ended it at once, agents orphaned: a CI run's killed bench did that.)"""
    service = serve(tmp_path)
    try:
        service.proc.send_signal(signal.SIGTERM)
        assert_exits_0(service, STOP_S + SLACK_S)
        assert "mesh serve: stopped" in log_of(service)
    finally:
        stop_service(service, grace_s=5)


@pytest.mark.slow  # a real service (or several)
def test_a_bench_killed_takes_its_service_along(tmp_path, mark):
    """A bench-like parent starts `mesh serve` through mesh.bench.serve_process and is
    killed with SIGKILL: the service gets SIGTERM from the kernel, stops and exits, and its
    agents with it."""
    bench = subprocess.Popen([sys.executable, "-c", _BENCH, str(tmp_path / "data"), str(tmp_path / "serve.log")],
                             stdout=subprocess.PIPE, text=True)
    try:
        next_line(output_lines(bench), 330, "the bench's service")  # its pid, once ready
        assert agents(mark), "the service has no agent"
        bench.kill()
        bench.wait(10)
        assert not left_after(mark, STOP_S + SLACK_S), "the service or its agents outlived the bench"
        assert "mesh serve: stopped" in (tmp_path / "serve.log").read_text()  # it stopped, not died
    finally:
        bench.kill()


_STUBBORN_STOP = """
import asyncio, os, signal, types
from mesh.service import app
app.EXIT_GRACE_S = 1.0
service = types.SimpleNamespace(config=types.SimpleNamespace(drain_timeout_s=1.0), draining=False, generating=0,
                                idle=None)

async def stubborn():
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # every cancellation ignored

async def main():
    service.idle = asyncio.Event()
    signals = app._Signals(service, lambda: print("agents killed", flush=True))
    os.kill(os.getpid(), signal.SIGTERM)
    await signals.stop.wait()
    await signals.drain()
    print("step in time:", await app._stop_step("a stubborn step", stubborn(), 1.0, signals.hurry), flush=True)
    signals.remove()

asyncio.run(main())  # its end cancels the stubborn step and waits for it, for ever
"""


def test_a_stop_step_that_ignores_its_cancellation_cannot_keep_the_process_alive():
    """`mesh serve`'s stop machinery (mesh.service.app) with a step that ignores every
    cancellation: the step is left after its bound, and when asyncio.run's end waits for
    it, the thread armed by the signal kills the agents and ends the process (status 1)."""
    proc = subprocess.run([sys.executable, "-c", _STUBBORN_STOP], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stdout.splitlines() == ["step in time: False", "agents killed"], (proc.stdout, proc.stderr)
    assert "a stubborn step did not end within 1 s" in proc.stderr
    assert "the stop overran its bound (1 s)" in proc.stderr
