"""Node agents as real processes on this machine (tests and `mesh bench multicast`)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from typing import Sequence


@dataclass
class AgentProcess:
    node: str
    host: str
    port: int
    process: asyncio.subprocess.Process

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL: the process dies mid-transfer, as a failed node would."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)


async def spawn_agent(node: str, link_mbps: float | None = None, host: str = "127.0.0.1",
                      ready_timeout_s: float = 30.0) -> AgentProcess:
    """Start `python -m mesh.runtime.weights.agent` and wait for its READY line."""
    args = [sys.executable, "-m", "mesh.runtime.weights.agent", "--host", host, "--port", "0"]
    if link_mbps is not None:
        args += ["--link-mbps", str(link_mbps)]
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), ready_timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        raise RuntimeError(f"agent {node!r} did not start within {ready_timeout_s} s") from None
    parts = line.decode().split()
    if len(parts) != 3 or parts[0] != "READY":
        proc.kill()
        raise RuntimeError(f"agent {node!r} did not start: {line!r}")
    return AgentProcess(node, parts[1], int(parts[2]), proc)


async def spawn_agents(nodes: Sequence[str], link_mbps: float | None = None,
                       host: str = "127.0.0.1") -> dict[str, AgentProcess]:
    procs = await asyncio.gather(*(spawn_agent(n, link_mbps, host) for n in nodes), return_exceptions=True)
    good = [p for p in procs if isinstance(p, AgentProcess)]
    bad = [p for p in procs if not isinstance(p, AgentProcess)]
    if bad:
        await stop_agents(good)
        raise bad[0]
    return {p.node: p for p in good}


async def stop_agents(agents: Sequence[AgentProcess] | dict[str, AgentProcess]) -> None:
    procs = list(agents.values()) if isinstance(agents, dict) else list(agents)
    for a in procs:
        if a.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                a.process.terminate()
    for a in procs:
        try:
            await asyncio.wait_for(a.process.wait(), 5.0)
        except asyncio.TimeoutError:
            a.kill()
            await a.process.wait()


@contextlib.asynccontextmanager
async def running_agents(nodes: Sequence[str], link_mbps: float | None = None):
    """async with running_agents(["s", "a", "b"]) as agents: ... (stopped on exit)."""
    agents = await spawn_agents(nodes, link_mbps)
    try:
        yield agents
    finally:
        await stop_agents(agents)
