"""Message framing between the coordinator and node agents, and between agents.

A frame is a 4-byte big-endian length, that many bytes of a UTF-8 JSON header, then, when
the header has "nbytes" > 0, that many bytes of payload (a block). One TCP connection
carries frames in sequence. docs/multicast.md lists the message types.
"""
from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

MAX_HEADER = 16 << 20  # a plan for a few hundred nodes and blocks fits easily
STREAM_LIMIT = 4 << 20  # StreamReader buffer: fewer pause/resume rounds on large blocks
_LEN = struct.Struct(">I")


class ProtocolError(ValueError):
    """A malformed frame or an unexpected message."""


def frame(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER:
        raise ProtocolError(f"header of {len(raw)} B exceeds {MAX_HEADER} B ({header.get('type')!r})")
    return _LEN.pack(len(raw)) + raw


async def read_message(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes] | None:
    """The next (header, payload), or None on a clean end of stream between frames."""
    try:
        head = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("connection closed inside a frame length") from exc
    (n,) = _LEN.unpack(head)
    if n > MAX_HEADER:
        raise ProtocolError(f"header length {n} B exceeds {MAX_HEADER} B")
    try:
        header = json.loads(await reader.readexactly(n))
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or "type" not in header:
        raise ProtocolError(f"header without a type: {str(header)[:80]}")
    nbytes = int(header.get("nbytes", 0))
    payload = await reader.readexactly(nbytes) if nbytes > 0 else b""
    return header, payload


async def send(writer: asyncio.StreamWriter, header: dict[str, Any]) -> None:
    """Write one frame without payload (control messages and events)."""
    writer.write(frame(header))
    await writer.drain()
