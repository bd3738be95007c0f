"""What one HTTP client may hold of the service: connections, time, body bytes.

aiohttp gives a keep-alive timer that also runs from a connection's start until its first
request head is parsed (and from each response to the next head), so `keepalive_timeout` is
the deadline for a request's head: a slow or idle head is closed. Bodies are read through
`read_body` (a deadline for the whole JSON body) and `body_chunks` (uploads: a deadline per
read and a floor on the average rate after a grace period). `guard_connections` bounds the
open connections in all and per client address; one over either bound gets a 503 in the
OpenAI error format and is closed before its request is parsed. `listen` opens the site with
both, and a listen backlog that holds `max_connections`.
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator

from aiohttp import web

from mesh.service.errors import ApiError
from mesh.service.schema import parse_json

# Open HTTP connections in all, and from one client address. One address is often a proxy, a
# gateway or a load generator holding a stream per waiting request (mesh replay --live, mesh
# bench load): the per-address bound stops one address from taking them all, not a busy
# client. The service raises its file-descriptor limit to fit (HttpLimits.fit_fd_limit).
MAX_CONNECTIONS = 4096
MAX_CONNECTIONS_PER_CLIENT = 1024
# How long a client may keep an idle connection for reuse: under the service's head deadline
# (HttpLimits.head_timeout_s, 10 s), which also closes idle connections, so that a client never
# sends a request on a connection the service is closing (aiohttp's client keeps them 15 s: one
# request of 3,851 in a 128-function live replay failed "Server disconnected" that way). The
# OpenAI SDK's httpx keeps them 5 s. Mesh's own load generators use this.
CLIENT_KEEPALIVE_S = 5.0


@dataclass(frozen=True, slots=True)
class HttpLimits:
    head_timeout_s: float = 10.0  # a request head (and the idle time between requests) must arrive in this
    body_timeout_s: float = 60.0  # a JSON body must arrive in this
    upload_idle_s: float = 30.0  # an upload that sends nothing this long is cut
    upload_min_bytes_per_s: float = 64 * 1024  # ...or whose average rate falls under this after the grace
    upload_grace_s: float = 10.0
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT
    linger_s: float = 2.0  # after an error answered before its body was read, the rest is read (dropped) this long

    refused_drain_bytes: int = 16 << 20  # an upload refused mid-body: at most this much more is read, then closed

    def fit_fd_limit(self) -> int:
        """Raise this process's open-file limit towards what the connections need (plus room
        for agents, logs and models), up to the hard limit; returns the soft limit now."""
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = self.max_connections + FD_RESERVE
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
        return soft

    def runner_options(self) -> dict[str, Any]:
        """aiohttp AppRunner keywords that enforce the head deadline and bound lingering, and
        keep request bodies as sent: aiohttp inflates an encoded body as it arrives (its
        payload parser), also while it lingers after a refusal, so a refused 256 KiB gzip bomb
        would cost the service's loop inflating 256 MiB each time, enough to make a
        well-behaved tenant's request miss its SLO; encoded bodies are refused (415)."""
        return {"keepalive_timeout": self.head_timeout_s, "lingering_time": self.linger_s, "auto_decompress": False}


def timed_out(what: str, limit_s: float) -> ApiError:
    return ApiError(408, f"The {what} did not arrive within {limit_s:g} s; send it at once (and faster).",
                    "invalid_request_error", None, "request_timeout")


def refuse_encoded(request: web.Request, what: str) -> None:
    """415 for a body sent with a Content-Encoding: the server keeps bodies as sent (no
    inflating: a gzip bomb), so it could not read it."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(415, f"{what} must be sent without Content-Encoding (got '{encoding}'): the server does not "
                       "inflate request bodies. Send it uncompressed.", "invalid_request_error", None,
                       "unsupported_content_encoding")


async def read_body(request: web.Request, limits: HttpLimits, cap: tuple[int, ApiError] | None = None) -> bytes:
    """The whole body, within `body_timeout_s` (408 otherwise); 415 for an encoded one. `cap`:
    (bytes, the error for a body over them), checked from Content-Length before reading, and
    while reading a chunked one."""
    refuse_encoded(request, "Request bodies")
    if cap is not None and request.content_length is not None and request.content_length > cap[0]:
        raise cap[1]
    try:
        if cap is None or request.content_length is not None:
            return await asyncio.wait_for(request.read(), limits.body_timeout_s)
        return await asyncio.wait_for(_read_capped(request, *cap), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise timed_out("request body", limits.body_timeout_s) from None


async def _read_capped(request: web.Request, limit: int, over: ApiError) -> bytes:
    parts, size = [], 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise over
        parts.append(chunk)
    return b"".join(parts)


async def body_chunks(request: web.Request, limits: HttpLimits) -> AsyncIterator[bytes]:
    """An upload's body in pieces as they arrive; 408 when one read waits past `upload_idle_s`
    or the average rate stays under `upload_min_bytes_per_s` after `upload_grace_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    received = 0
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), limits.upload_idle_s)
        except asyncio.TimeoutError:
            raise timed_out("next part of the upload", limits.upload_idle_s) from None
        if not chunk:
            return
        received += len(chunk)
        elapsed = loop.time() - start
        if elapsed > limits.upload_grace_s and received < limits.upload_min_bytes_per_s * elapsed:
            raise ApiError(408, f"The upload arrives at {received / elapsed / 1024:.0f} KiB/s, under the server's "
                           f"floor of {limits.upload_min_bytes_per_s / 1024:.0f} KiB/s; upload over a faster link.",
                           "invalid_request_error", None, "request_timeout")
        yield chunk


async def refuse_mid_body(request: web.Request, error: ApiError, limits: HttpLimits) -> web.StreamResponse:
    """Answer `error` at once to a client still sending its body (an upload past its cap),
    read and drop at most `refused_drain_bytes` more of it within `linger_s` (so that the
    client is reading when the connection closes), and close the connection: aiohttp's own
    lingering would read the body at the client's full rate for `linger_s` (an over-quota
    upload repeated in a loop would keep the service's loop busy reading)."""
    response = error.response()
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    loop = asyncio.get_running_loop()
    end, drained = loop.time() + limits.linger_s, 0
    try:
        while drained < limits.refused_drain_bytes and not request.content.at_eof() and loop.time() < end:
            chunk = await asyncio.wait_for(request.content.readany(), end - loop.time())
            if not chunk:
                break
            drained += len(chunk)
    except (asyncio.TimeoutError, ConnectionError):
        pass
    request.protocol.force_close()  # no lingering after this response
    return response


class ConnectionLimits:
    """Counts a web.Server's open connections in all and per client address."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.total = 0
        self.per_client: Counter[str] = Counter()
        self.refused = 0
        self._admitted: dict[Any, str] = {}  # handler -> its client address

    def admit(self, handler: Any, transport: Any) -> bool:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "local"
        if self.total >= self.limits.max_connections:
            return self._refuse(transport, f"the server holds its limit of {self.limits.max_connections} connections")
        if self.per_client[client] >= self.limits.max_connections_per_client:
            return self._refuse(transport, f"your address holds the limit of {self.limits.max_connections_per_client}"
                                           " open connections; reuse connections or close idle ones")
        self.total += 1
        self.per_client[client] += 1
        self._admitted[handler] = client
        return True

    def release(self, handler: Any) -> None:
        client = self._admitted.pop(handler, None)
        if client is None:
            return
        self.total -= 1
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]

    def _refuse(self, transport: Any, why: str) -> bool:
        self.refused += 1
        body = json.dumps(ApiError(503, f"Too many connections: {why}. Retry shortly.", "server_error", None,
                                   "too_many_connections").body()).encode()
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        transport.close()
        return False


def guard_connections(server: web.Server, limits: HttpLimits) -> ConnectionLimits:
    """Bound `server`'s connections (the runner's web.Server, after runner.setup()): its
    connection_made/connection_lost hooks, which every connection's handler calls, are
    wrapped on this instance."""
    counts = ConnectionLimits(limits)
    made, lost = server.connection_made, server.connection_lost

    def connection_made(handler: Any, transport: Any) -> None:
        made(handler, transport)
        if not counts.admit(handler, transport):
            handler.force_close()  # its task ends without reading a request

    def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
        counts.release(handler)
        lost(handler, exc)

    server.connection_made = connection_made  # type: ignore[method-assign]
    server.connection_lost = connection_lost  # type: ignore[method-assign]
    return counts


async def listen(runner: web.AppRunner, host: str, port: int, limits: HttpLimits,
                 ssl_context: Any = None) -> tuple[web.TCPSite, ConnectionLimits]:
    """Serve `runner` (after runner.setup()) on host:port with its connections guarded. The
    listen backlog is `max_connections` (the kernel caps it at net.core.somaxconn): with
    aiohttp's 128, a burst of connections the loop has not yet accepted fills the queue, the
    kernel drops the next SYN, and a well-behaved client connecting then waits for its
    1 s SYN retransmit (a 1.1 s TTFT against 0.16 s unloaded)."""
    counts = guard_connections(runner.server, limits)
    site = web.TCPSite(runner, host, port, shutdown_timeout=5.0, ssl_context=ssl_context,
                       backlog=limits.max_connections)
    await site.start()
    return site, counts


FD_RESERVE = 512  # file descriptors beside the HTTP connections: agents, workers, logs, models
THREAD_PARSE_BYTES = 256 * 1024  # bodies larger than this are parsed in a worker thread, off the event loop


async def read_json(request: web.Request, limits: HttpLimits,
                    cap: tuple[int, ApiError] | None = None) -> dict[str, Any]:
    """The body as a checked JSON object (mesh.service.schema.parse_json), read within the
    body deadline (and `cap`, read_body) and, when large, parsed off the event loop (other
    requests keep moving)."""
    body = await read_body(request, limits, cap)
    if len(body) > THREAD_PARSE_BYTES:
        return await asyncio.to_thread(parse_json, body)
    return parse_json(body)
