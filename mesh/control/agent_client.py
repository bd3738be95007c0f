"""The control service's side of one agent connection: calls with replies, events, liveness.

`AgentClient.connect()` opens the connection and says hello. `call(request)` sends a
request (a mesh.wire.agent_protocol request type) and awaits its reply, decoded into the
request's reply type (AgentCallError when the agent says ok=false, or answers with a
malformed reply); `send()` sends without waiting (abort). `call_message()` speaks raw
frames, for tests and tools that must send what no request type writes. Events (tokens,
done, instance) go to `on_event`. When the connection ends - EOF, a reset, a protocol error, or no reply to a ping
within `heartbeat_timeout_s` - every pending call fails with AgentDown and `on_close(reason)` runs
once. A killed agent process closes its socket, so that is noticed at once; the heartbeat
catches an agent that hangs or a peer that vanished from the network.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from mesh.wire.agent_protocol import (
    REPLY,
    TYPE_KEY,
    Code,
    FailureReply,
    Hello,
    HelloReply,
    Ping,
    ProtocolError,
    Request,
    encode_frame,
    read_frame,
    reply_fields,
)

log = logging.getLogger(__name__)

R = TypeVar("R")
EventCallback = Callable[[dict[str, Any]], None]
CloseCallback = Callable[[str], None]


class AgentDown(ConnectionError):
    """The agent connection is gone (or was never there); the message says why."""


class AgentCallError(RuntimeError):
    """The agent answered ok=false."""

    def __init__(self, failure: FailureReply) -> None:
        super().__init__(failure.error)
        self.failure = failure
        self.code = failure.code

    @property
    def retryable(self) -> bool:
        try:
            return Code(self.code).retryable
        except ValueError:
            return False


@dataclass
class CallTimes:
    """Round trips of one kind of call: how long the agent took to answer, as seen here.
    An agent answers between its engines' iterations, so this is what the cluster
    dispatcher's decisions wait for (/admin/cluster shows it per node)."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, took_s: float) -> None:
        self.count += 1
        self.total_s += took_s
        self.max_s = max(self.max_s, took_s)

    def view(self) -> dict[str, float]:
        return {"count": self.count, "mean_s": round(self.total_s / self.count, 4) if self.count else 0.0,
                "max_s": round(self.max_s, 4)}


class AgentClient:
    def __init__(
        self,
        name: str,
        on_event: EventCallback,
        on_close: CloseCallback,
        heartbeat_s: float = 0.5,
        heartbeat_timeout_s: float = 10.0,
    ) -> None:
        self.name = name
        self.on_event = on_event
        self.on_close = on_close
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.hello: HelloReply | None = None  # who the agent said it is
        self.address = ""  # what connect() reached: "host:port" or "unix:path"
        self.closed_reason: str | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self.call_times: dict[str, CallTimes] = {}  # by message type
        self.frames_in = 0  # frames read from the agent (replies and events): the token path's cost

    @property
    def up(self) -> bool:
        return self._writer is not None and self.closed_reason is None

    async def connect(self, address: str, token: str | None, timeout_s: float = 10.0) -> HelloReply:
        """Connect to "host:port" or "unix:path" and say hello; return the agent's HelloReply."""
        self.address = address
        if address.startswith("unix:"):
            opening = asyncio.open_unix_connection(address[len("unix:"):], limit=2**20)
        else:
            host, _, port = address.rpartition(":")
            opening = asyncio.open_connection(host, int(port), limit=2**20)
        try:
            reader, self._writer = await asyncio.wait_for(opening, timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise AgentDown(f"cannot connect to agent {self.name} at {address}: {exc}") from exc
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._read_loop(reader), name=f"agent {self.name} reader"))
        self.hello = await self.call(Hello(token), timeout_s)
        self._tasks.append(loop.create_task(self._heartbeat(), name=f"agent {self.name} heartbeat"))
        return self.hello

    async def call(self, request: Request[R], timeout_s: float | None = None) -> R:
        """Send a request and await its reply, decoded into the request's reply type."""
        fields = await self.call_message(request.to_message(), timeout_s)
        try:
            return request.REPLY.from_fields(fields)
        except ProtocolError as exc:
            raise AgentCallError(FailureReply(Code.PROTOCOL.value, f"agent {self.name} answered {request.T} with a "
                                              f"malformed reply: {exc}")) from exc

    async def call_message(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send a message as it is and await its reply (the reply's fields, without t/re/ok)."""
        if not self.up:
            raise AgentDown(f"agent {self.name} is down: {self.closed_reason or 'not connected'}")
        mid = next(self._ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending[mid] = future
        sent = loop.time()
        try:
            # id first: an agent finds it even in a frame it cannot decode (mesh.framing.message_id)
            self._write({"id": mid, **{k: v for k, v in message.items() if k != "id"}})
            reply = await (asyncio.wait_for(future, timeout_s) if timeout_s else future)
        except asyncio.TimeoutError as exc:
            raise AgentDown(
                f"agent {self.name} did not answer {message.get(TYPE_KEY)} within {timeout_s:.1f} s") from exc
        finally:
            self._pending.pop(mid, None)
        self.call_times.setdefault(str(message.get(TYPE_KEY)), CallTimes()).add(loop.time() - sent)
        if not reply.get("ok"):
            try:
                failure = FailureReply.from_fields(reply)
            except ProtocolError as exc:
                failure = FailureReply(Code.PROTOCOL.value,
                                       f"agent {self.name} failed a call with a malformed reply: {exc}")
            raise AgentCallError(failure)
        return reply_fields(reply)

    def send(self, request: Request[Any]) -> None:
        """Send without waiting for a reply (ignored when the connection is down)."""
        if self.up:
            self._write(request.to_message())

    def _write(self, message: dict[str, Any]) -> None:
        if self._writer is None:
            raise AgentDown(f"agent {self.name} is not connected")
        try:
            self._writer.write(encode_frame(message))
        except (ConnectionError, RuntimeError) as exc:
            self._close(f"write failed: {exc}")
            raise AgentDown(f"agent {self.name} is down: {exc}") from exc

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        reason = "connection closed by the agent"
        try:
            while True:
                message = await read_frame(reader)
                if message is None:
                    break
                self.frames_in += 1
                if message[TYPE_KEY] == REPLY:
                    re_id = message.get("re")
                    future = self._pending.get(re_id) if isinstance(re_id, int) else None
                    if future is not None and not future.done():
                        future.set_result(message)
                    continue
                try:
                    self.on_event(message)
                except Exception:  # noqa: BLE001 - a bad event handler must not kill the connection
                    log.exception("agent %s: event handler failed on %s", self.name, message.get(TYPE_KEY))
        except (ProtocolError, ConnectionError) as exc:
            reason = f"connection failed: {exc}"
        except asyncio.CancelledError:
            reason = "connection closed by the control service"
            raise
        finally:
            self._close(reason)

    async def _heartbeat(self) -> None:
        while self.up:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.call(Ping(), self.heartbeat_timeout_s)
            except AgentDown as exc:
                self._close(f"heartbeat failed: {exc}")
                return
            except AgentCallError:
                continue

    def _close(self, reason: str) -> None:
        if self.closed_reason is not None:
            return
        self.closed_reason = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(AgentDown(f"agent {self.name} is down: {reason}"))
        self._pending.clear()
        if self._writer is not None:
            self._writer.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        try:
            self.on_close(reason)
        except Exception:  # noqa: BLE001 - a failing handler must not stop the close
            log.exception("agent %s: close handler failed", self.name)

    async def close(self) -> None:
        self._close("closed by the control service")
        await asyncio.gather(*self._tasks, return_exceptions=True)
