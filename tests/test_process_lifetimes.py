"""Every process Mesh starts dies with its parent, and gets only the secrets it needs
(issue 21): a node agent killed with SIGKILL leaves neither its engine worker nor its
tokenizer worker behind; an agent whose service is killed with SIGKILL exits; an agent has
no admin or metrics token in its environment, and its workers have none of Mesh's tokens."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_doubles import until
from mesh.control.supervisor import AgentSettings, LocalAgent
from mesh.engines.worker_process import SECRET_ENV
from mesh.policy.node_spec import NodeSpec
from mesh.wire.agent_protocol import InstanceSpec


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a running process; None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (int(fields[1]), fields[19])


def descendants(root: int) -> dict[int, tuple[str, str]]:
    """pid -> (start time, command line) of every running descendant of `root`."""
    parents: dict[int, tuple[int, str]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (st := _stat(int(proc.name))) is not None:
            parents[int(proc.name)] = st
    found: dict[int, tuple[str, str]] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in parents.items():
            if ppid == parent and pid not in found:
                try:
                    found[pid] = (started, Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
                except OSError:  # ended meanwhile
                    continue
                frontier.append(pid)
    return found


def still_running(pids: dict[int, str], limit_s: float) -> dict[int, str]:
    """The processes of `pids` (pid -> start time) still running after up to `limit_s`."""
    deadline = time.monotonic() + limit_s
    while True:
        left = {pid: t for pid, t in pids.items() if (st := _stat(pid)) is not None and st[1] == t}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


@pytest.mark.slow
def test_a_sigkilled_agent_leaves_no_process_behind(demo_gguf, monkeypatch):
    """The real agent the service starts (LocalAgent), a real OpenVINO instance loaded (its
    engine worker) and a prompt tokenized (its tokenizer worker); SIGKILL the agent: both
    workers are gone within seconds, and the supervisor's restarted agent serves on."""
    monkeypatch.setenv("MESH_ADMIN_TOKEN", "admin-secret")  # as in `mesh serve`'s environment
    monkeypatch.setenv("MESH_METRICS_TOKEN", "metrics-secret")

    async def main() -> None:
        events: list[dict] = []
        agent = LocalAgent(NodeSpec("cpu-0", "cpu", 3 * 10**9), lambda a: None, lambda a, why: None,
                           lambda a, m: events.append(m), AgentSettings(models_roots=(str(demo_gguf.parent),)))
        await agent.start()
        try:
            assert await agent.wait_up(60)
            first = agent.pid
            await agent.client.call_message(InstanceSpec("i1", "smollm2", str(demo_gguf), 512,
                                                         max_num_seqs=2).to_message())
            await until(lambda: any(e["t"] == "instance" and e["instance_id"] == "i1" for e in events), 180)
            (state,) = [e["state"] for e in events if e["t"] == "instance"]
            assert state == "ready", events
            ids = (await agent.client.call_message({"t": "tokenize", "instance_id": "i1", "prompt": "Hello"}))["ids"]
            assert ids

            found = descendants(first)
            workers = {pid: started for pid, (started, _) in found.items()}
            commands = " ".join(cmd for _, cmd in found.values())
            assert "mesh.engines.openvino_worker" in commands and "mesh.node.tokenizer_worker" in commands, commands
            agent_env = environment(first)
            assert agent_env.get("MESH_AGENT_TOKEN") and "MESH_ADMIN_TOKEN" not in agent_env
            assert "MESH_METRICS_TOKEN" not in agent_env
            for pid in workers:
                assert not set(SECRET_ENV) & set(environment(pid)), f"{found[pid][1]} (pid {pid}) holds a secret"

            os.kill(first, signal.SIGKILL)
            left = await asyncio.to_thread(still_running, workers, 10.0)
            assert not left, f"the killed agent's processes still run: {[found[pid][1] for pid in left]}"
            await until(lambda: agent.up and agent.pid not in (None, first), 60)  # restarted
            await agent.client.call_message({"t": "ping"})  # it answers
        finally:
            await agent.stop()

    asyncio.run(main())


_SERVICE = """
import asyncio, sys
from mesh.control.supervisor import LocalAgent
from mesh.policy.node_spec import NodeSpec

async def main():
    agent = LocalAgent(NodeSpec("cpu-0", "cpu", 10**9), lambda a: None, lambda a, why: None, lambda a, m: None)
    await agent.start()
    assert await agent.wait_up(60)
    print(agent.pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_an_agent_exits_when_its_service_is_sigkilled():
    """A stand-in for `mesh serve` (the same LocalAgent) killed with SIGKILL: its agent sees
    its stdin close and exits by itself."""
    service = subprocess.Popen([sys.executable, "-c", _SERVICE], stdout=subprocess.PIPE, text=True)
    try:
        agent = int(service.stdout.readline())
        started = _stat(agent)
        assert started is not None and started[0] == service.pid
        service.kill()
        service.wait()
        assert not still_running({agent: started[1]}, 15.0), "the agent outlived its service"
    finally:
        service.kill()
