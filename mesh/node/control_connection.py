"""The node agent's end of its control connection: frames in and out, the gate and the
token in front of it, requests dispatched by their class, replies, and the `node` event.

One control connection at a time: a new one (after its hello) replaces the old one, whose
requests are aborted (`on_lost`). Every message is decoded into its request type
(mesh.wire.agent_protocol) before a handler sees it; a handler is picked by that type from
the table the agent gives (`handlers`), returns the request's reply type (or raises Refused),
and may be a coroutine. Messages queued in one loop turn go out as one write; the `tokens`
events of one turn are merged into one frame.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any, Callable, Mapping

from mesh.framing import ConnectionGate, UndecodableFrame, is_message_id
from mesh.node.runtime import NodeRuntime
from mesh.wire.agent_protocol import (
    TYPE_KEY,
    Code,
    FailureReply,
    Hello,
    NodeEvent,
    ProtocolError,
    TokensEvent,
    encode_frame,
    failure_message,
    read_frame,
    read_hello,
    reply_message,
    request_from_message,
)

log = logging.getLogger(__name__)

Handler = Callable[[Any], Any]  # a request -> its reply (or a coroutine giving it)


class Refused(Exception):
    """Raised by a handler to answer ok=false with a code."""

    def __init__(self, code: Code, message: str, shortfall_bytes: int | None = None) -> None:
        super().__init__(message)
        self.code, self.shortfall_bytes = code, shortfall_bytes


class ControlConnection:
    """The control connection of one node agent (at most one at a time)."""

    def __init__(self, node: NodeRuntime, token: str | None, handlers: Mapping[type, Handler],
                 on_lost: Callable[[str], None], before_flush: Callable[[], None] = lambda: None) -> None:
        """`handlers`: the handler of each request type. `on_lost(why)`: the connection
        ended or was replaced (its requests end). `before_flush`: runs before each write
        (what the agent learns of its iterations, it learns then)."""
        self.node = node
        self.token = token
        self.handlers = dict(handlers)
        self.on_lost = on_lost
        self.before_flush = before_flush
        self.gate = ConnectionGate()  # connections waiting for their hello
        self.writer: asyncio.StreamWriter | None = None
        self._node_sent: NodeEvent | None = None  # the last `node` event this connection was told
        self._outbox: list[dict[str, Any]] = []
        self._flush_scheduled = False

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One control connection, from its hello to its end."""
        peer = writer.get_extra_info("peername")
        if not self.gate.enter():  # too many connections not yet authenticated
            writer.close()
            return
        try:  # authentication first: a small hello, soon (mesh.framing)
            first = await read_hello(reader)
        except (ProtocolError, ConnectionError) as exc:
            log.warning("control connection from %s refused before hello: %s", peer, exc)
            writer.close()
            return
        finally:
            self.gate.leave()
        if first is None or not self._authenticated(first):
            if first is not None and "id" in first:
                writer.write(encode_frame(failure_message(first["id"], FailureReply(
                    Code.UNAUTHORIZED.value, "hello first, with the agent token ($MESH_AGENT_TOKEN)"))))
            writer.close()
            return
        if self.writer is not None:  # a new control connection replaces the old one
            log.warning("a new control connection from %s replaces the current one", peer)
            self.on_lost("the control connection was replaced")
            self.flush()
            self.writer.close()
        self.writer = writer
        self._node_sent = None  # the new connection is told the node's state
        self.dispatch(first)
        try:
            while True:
                try:
                    message = await read_frame(reader)
                except UndecodableFrame as exc:  # a whole frame that is no message: answered, the rest goes on
                    log.warning("control connection from %s sent a message that does not decode: %s", peer, exc)
                    self._refuse(exc.message_id, exc)
                    continue
                if message is None:
                    break
                self.dispatch(message)
                if writer.transport.get_write_buffer_size() > 2**20:
                    await writer.drain()
        except (ProtocolError, ConnectionError) as exc:
            log.warning("control connection from %s failed: %s", peer, exc)
        except asyncio.CancelledError:  # the agent is shutting down
            pass
        finally:
            if self.writer is writer:
                self.writer = None
                self.on_lost("the control connection was lost")
            writer.close()

    def _authenticated(self, first: Mapping[str, Any]) -> bool:
        """Is the first message a hello with the agent's token (any, when it has none)?"""
        if first.get(TYPE_KEY) != Hello.T:
            return False
        try:
            token = Hello.from_message(first).token
        except ProtocolError:
            return False
        if not self.token:
            return True
        return token is not None and hmac.compare_digest(token.encode(), self.token.encode())

    def dispatch(self, message: Mapping[str, Any]) -> None:
        """Decode a message into its request and run the handler of its type; answer it."""
        kind = message.get(TYPE_KEY)
        mid = message.get("id")
        if mid is not None and not is_message_id(mid):  # no reply can name it: dropped
            log.warning("a %.40r message with a bad id %.80r (an integer in [0, 2^63) expected) is dropped", kind, mid)
            return
        try:
            request = request_from_message(message)
            result = self.handlers[type(request)](request)
        except (Refused, ProtocolError) as exc:
            self._refuse(mid, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bug in one handler fails that call, not the connection
            self._failed(mid, kind, exc)
            return
        if asyncio.iscoroutine(result):
            asyncio.get_running_loop().create_task(self._finish_async(mid, kind, result))
        elif mid is not None:
            self.send(reply_message(mid, result))

    def _refuse(self, mid: Any, exc: Exception) -> None:
        """Answer a message that was refused (Refused) or malformed (ProtocolError)."""
        if mid is None:
            return
        if isinstance(exc, Refused):
            self.send(failure_message(mid, FailureReply(exc.code.value, str(exc), exc.shortfall_bytes)))
        else:
            self.send(failure_message(mid, FailureReply(Code.PROTOCOL.value, str(exc))))

    async def _finish_async(self, mid: Any, kind: Any, coro: Any) -> None:
        try:
            result = await coro
        except (Refused, ProtocolError) as exc:
            self._refuse(mid, exc)
            return
        except Exception as exc:  # noqa: BLE001 - any failure is answered, never lost
            self._failed(mid, kind, exc)
            return
        if mid is not None:
            self.send(reply_message(mid, result))

    def _failed(self, mid: Any, kind: Any, exc: Exception) -> None:
        """Answer a message whose handler raised unexpectedly: `failed`, with the exception."""
        log.exception("handler of %.40s failed", kind or "a message", exc_info=exc)
        if mid is not None:
            self.send(failure_message(mid, FailureReply(Code.FAILED.value, f"{type(exc).__name__}: {exc}")))

    def send(self, message: dict[str, Any]) -> None:
        """Queue a message; everything queued in one loop turn goes out together."""
        if (message.get(TYPE_KEY) == TokensEvent.T and self._outbox
                and self._outbox[-1].get(TYPE_KEY) == TokensEvent.T):
            self._outbox[-1]["items"].extend(message["items"])
        else:
            self._outbox.append(message)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def send_event(self, event: Any) -> None:
        """Queue an event (mesh.wire.agent_protocol.Event)."""
        self.send(event.to_message())

    def _node_state(self) -> NodeEvent:
        return NodeEvent(self.node.stepping, self.node.memory.station.budget)

    def stepping(self, instance_id: str | None) -> None:
        """The node's loop started (an instance) or ended (None) an iteration: the service is
        told at the next flush, if the node's state changed by then (an instance that steps
        again right after its own iteration sends nothing). An engine that holds the loop
        while it steps (a real one) would delay that flush past its iteration: its start
        goes out now."""
        if self.writer is None or self._node_state() == self._node_sent:
            return
        inst = self.node.instances.get(instance_id or "")
        if inst is not None and getattr(inst.engine, "blocks_event_loop", False):
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        self.before_flush()
        state = self._node_state()
        if self.writer is not None and state != self._node_sent:
            self._node_sent = state  # after the frames (replies, tokens) of what changed it
            self._outbox.append(state.to_message())
        outbox, self._outbox = self._outbox, []
        if self.writer is None or not outbox:
            return
        frames = []
        for m in outbox:  # one message that cannot be encoded (a bug) must not take the others with it
            try:
                frames.append(encode_frame(m))
            except Exception:  # noqa: BLE001 - one bad message must not drop the others
                log.exception("cannot encode a %r message for the control service; dropped", m.get(TYPE_KEY))
        try:
            self.writer.write(b"".join(frames))
        except (ConnectionError, RuntimeError) as exc:
            log.warning("cannot write to the control connection: %s", exc)
