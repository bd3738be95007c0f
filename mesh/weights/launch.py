"""Node agents as real processes on this machine (tests and `mesh bench multicast`).

Every launch runs its agents with a weights token: a fresh random one unless given, passed
in the environment (MESH_WEIGHTS_TOKEN), and kept on each AgentProcess (`token`) for the
coordinator's `multicast(..., token=)`. The agents spawned together share one token (they
forward blocks to each other)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

from mesh.engines.worker_process import worker_env
from mesh.tasks import close_pipes
from mesh.weights.peer import TOKEN_ENV


@dataclass
class AgentProcess:
    node: str
    host: str
    port: int
    process: asyncio.subprocess.Process
    token: str  # its weights token (MESH_WEIGHTS_TOKEN)

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


def new_token() -> str:
    """A random weights token."""
    return secrets.token_urlsafe(32)


def token_of(agents: Mapping[str, AgentProcess] | Sequence[AgentProcess]) -> str:
    """The token shared by agents spawned together."""
    tokens = {a.token for a in (agents.values() if isinstance(agents, Mapping) else agents)}
    if len(tokens) != 1:
        raise ValueError(f"the agents have {len(tokens)} different tokens")
    return tokens.pop()


async def spawn_agent(node: str, link_mbps: float | None = None, host: str = "127.0.0.1",
                      ready_timeout_s: float = 30.0, token: str | None = None) -> AgentProcess:
    """Start `python -m mesh.weights.peer` with `token` (None: a new random one) in
    its environment and wait for its READY line."""
    token = token or new_token()
    args = [sys.executable, "-m", "mesh.weights.peer", "--host", host, "--port", "0"]
    if link_mbps is not None:
        args += ["--link-mbps", str(link_mbps)]
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                env=worker_env(**{TOKEN_ENV: token}))
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), ready_timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        raise RuntimeError(f"agent {node!r} did not start within {ready_timeout_s} s") from None
    parts = line.decode().split()
    if len(parts) != 3 or parts[0] != "READY":
        proc.kill()
        raise RuntimeError(f"agent {node!r} did not start: {line!r}")
    return AgentProcess(node, parts[1], int(parts[2]), proc, token)


async def spawn_agents(nodes: Sequence[str], link_mbps: float | None = None,
                       host: str = "127.0.0.1", token: str | None = None) -> dict[str, AgentProcess]:
    """One agent per node, all with `token` (None: one new random token for all of them)."""
    token = token or new_token()
    procs = await asyncio.gather(*(spawn_agent(n, link_mbps, host, token=token) for n in nodes),
                                 return_exceptions=True)
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
        await close_pipes(a.process)


@contextlib.asynccontextmanager
async def running_agents(nodes: Sequence[str], link_mbps: float | None = None, token: str | None = None):
    """async with running_agents(["s", "a", "b"]) as agents: ... (stopped on exit); their
    token is token_of(agents)."""
    agents = await spawn_agents(nodes, link_mbps, token=token)
    try:
        yield agents
    finally:
        await stop_agents(agents)
