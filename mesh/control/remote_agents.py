"""Remote node agents: `python -m mesh.agent` that another machine runs, reached over TCP.

`RemoteAgent` has `LocalAgent`'s interface (mesh.control.supervisor) without the process: the
control service connects to the agent's address, says hello with the agent token, and, when
the connection ends (the agent or its machine went away, or a heartbeat went unanswered),
reconnects with a backoff that grows while the agent stays unreachable. Stopping the service
closes the connection and leaves the agent running: it belongs to its machine.

The node's kind and memory budget come from the agent's `hello`, whose `node_id` must be
the one the service was told (`--remote-agent ID=HOST:PORT`), so that a wrong address is
refused rather than served under another name. Weights reach the node by multicast to the
weights receiver it reports in `hello` (start it with `--weights-listen 0.0.0.0:PORT`; an
unspecified host means the address the service reached the agent at).

The address is a string (`--remote-agent`), or an *address source*: an async callable asked
before every connection, for agents whose address changes when they restart (a Ray actor's
agent, mesh.ray.membership). Both ways run through this one class.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Awaitable, Callable, Union

from mesh.control.agent_client import AgentClient
from mesh.control.supervisor import AgentHandle, AgentSettings, DownCallback, EventCallback, UpCallback
from mesh.policy.node_spec import NodeSpec
from mesh.tasks import cancel_all

log = logging.getLogger(__name__)

AddressSource = Callable[[], Awaitable[str]]


def parse_remote(text: str) -> tuple[str, str]:
    """'ID=HOST:PORT' -> (node id, address); ValueError says what is wrong."""
    node_id, sep, address = text.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not node_id or not colon or not host or not port.isdigit():
        raise ValueError(f"a remote agent is ID=HOST:PORT (e.g. cpu-7=10.0.0.7:7000), got {text!r}")
    return node_id, address


class RemoteAgent(AgentHandle):
    """One remote node agent's connection, kept open. `restarts` counts reconnections; the
    spec's kind and memory are replaced by the agent's own at every hello."""

    remote = True  # its process is on another machine: no pid here (AgentHandle.pid)

    def __init__(self, spec: NodeSpec, address: Union[str, AddressSource], token: str | None, on_up: UpCallback,
                 on_down: DownCallback, on_event: EventCallback, settings: AgentSettings | None = None,
                 where: str | None = None) -> None:
        """`address`: "host:port", or an async callable giving the current one; `where`: what
        /admin/cluster shows as its location (default: the address)."""
        super().__init__(spec, on_up, on_down, on_event, settings)
        self._source: AddressSource | None = None if isinstance(address, str) else address
        self.address = address if isinstance(address, str) else ""
        self._where = where
        self.token = token

    @property
    def location(self) -> str:
        return self._where or self.address

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        await cancel_all([self._task])
        if self.client is not None:
            await self.client.close()
        self.state = "stopped"

    async def _supervise(self) -> None:
        backoff = self.settings.restart_backoff_s
        while not self._stopping:
            self.state = "starting"
            self._gone.clear()
            try:
                await self._connect()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # AgentDown, OSError, a timeout, a wrong node, or the address source's error
                self.last_error = f"cannot connect: {exc}"
                log.error("remote agent %s at %s: %s", self.node_id, self.address, self.last_error)
                self.state = "down"
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.settings.restart_backoff_max_s)
                continue
            backoff = self.settings.restart_backoff_s
            self.state = "up"
            self._up.set()
            self.on_up(self)
            await self._gone.wait()
            self.last_error = (self.client.closed_reason if self.client else None) or "connection lost"
            self.state = "down"
            self._up.clear()
            if self._stopping:
                return
            log.error("remote agent %s is down: %s; reconnecting", self.node_id, self.last_error)
            self.on_down(self, self.last_error)
            self.restarts += 1
            await asyncio.sleep(backoff)

    async def _connect(self) -> None:
        if self._source is not None:
            self.address = await asyncio.wait_for(self._source(), self.settings.start_timeout_s)
        client = AgentClient(self.node_id, lambda m: self.on_event(self, m), lambda reason: self._gone.set(),
                             self.settings.heartbeat_s, self.settings.heartbeat_timeout_s)
        hello = await client.connect(self.address, self.token, self.settings.start_timeout_s)
        if hello.node_id != self.node_id:
            await client.close()
            raise ValueError(f"the agent at {self.address} is node {hello.node_id!r}, not {self.node_id!r}")
        self.spec = replace(self.spec, kind=hello.kind, memory_bytes=hello.memory_bytes)
        self.generation += 1
        self.client = client
