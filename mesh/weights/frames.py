"""Messages between the coordinator and node agents, and between agents.

Frames are mesh.framing's: a 4-byte big-endian length, that many bytes of a UTF-8 JSON
header with a `type`, then, when the header has "nbytes" > 0, that many bytes of payload
(a block). One TCP connection carries frames in sequence. docs/multicast.md lists the
message types.
"""
from __future__ import annotations

import asyncio
from typing import Any

from mesh import framing
from mesh.framing import MAX_HEADER_BYTES as MAX_HEADER  # noqa: F401 - part of this protocol's API
from mesh.framing import ProtocolError  # noqa: F401 - likewise
from mesh.framing import encode_frame as frame  # noqa: F401 - a header's frame; the payload follows it
from mesh.framing import send_frame as send  # noqa: F401 - write a payload-less frame and drain

TYPE_KEY = "type"  # every message's type
STREAM_LIMIT = 4 << 20  # StreamReader buffer: fewer pause/resume rounds on large blocks


async def read_message(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes] | None:
    """The next (header, payload), or None on a clean end of stream between frames."""
    return await framing.read_frame(reader, TYPE_KEY, payloads=True)


async def read_header(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next header only (the caller bounds and reads its payload), or None on a clean EOF."""
    return await framing.read_header(reader, TYPE_KEY)


async def read_first(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """A connection's first header, which carries the token: small and prompt (framing)."""
    return await framing.read_first_frame(reader, TYPE_KEY)
