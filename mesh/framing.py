"""Length-prefixed JSON frames over a byte stream: the framing both Mesh protocols use.

A frame is a 4-byte big-endian unsigned length, then that many bytes of UTF-8 JSON holding
one object (the header, a message), then, only for protocols that carry payloads and only
when the header has `nbytes` > 0, that many raw payload bytes. One connection carries frames
in sequence. Headers over MAX_HEADER_BYTES, and payloads over MAX_PAYLOAD_BYTES (or a
smaller bound the caller passes), are protocol errors found from the length alone, before any
of the frame is read (the reader closes the connection).

A listening side authenticates first (`read_first_frame`): the first frame of a connection
may be at most AUTH_FRAME_BYTES and must arrive within AUTH_DEADLINE_S, and only its header
is read; the caller checks the token before it reads a payload. `ConnectionGate` bounds the
connections a port holds before they authenticate, so a stranger's idle or slow connections
cannot use up the process's memory or file descriptors.

Each protocol names its type key and whether it carries payloads; the messages are its own:
- the node agent protocol (mesh.wire.agent_protocol): type key `t`, no payloads;
- the weights transport (mesh.weights.frames): type key `type`, a block's bytes as
  the payload of a `block` frame.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import struct
from typing import Any, Mapping

try:  # a JSON codec several times faster than the standard one; frames are the same JSON either way
    import orjson
except ImportError:  # pragma: no cover - a dependency; the standard codec serves without it
    orjson = None

MAX_HEADER_BYTES = 16 * 2**20  # a plan for a few hundred nodes and blocks fits easily
MAX_PAYLOAD_BYTES = 2**30  # a weights block (plans cut 4-256 MiB blocks)
AUTH_FRAME_BYTES = 4096  # a hello or a start's token fits; a stranger's first frame is read into no more
AUTH_DEADLINE_S = 5.0  # a connection that has not sent its first frame by then is closed
MAX_UNAUTHENTICATED = 64  # connections per port waiting for (or failing) their first frame
LENGTH = struct.Struct(">I")


class ProtocolError(RuntimeError):
    """A peer sent something that is not a valid frame or message."""


class UndecodableFrame(ProtocolError):
    """A whole frame was read, but its header is not a JSON object with a type: the stream is
    still in step, so a reader may answer it (its `message_id`, when one was found) and go on."""

    def __init__(self, message: str, message_id: int | None) -> None:
        super().__init__(message)
        self.message_id = message_id


def encode_json(header: Mapping[str, Any]) -> bytes:
    """Compact UTF-8 JSON of `header`: orjson's, or the standard codec's for what orjson does
    not take (integers past 64 bits, keys that are not strings, other types: the standard
    codec says what is wrong) and for NaN and infinities, which orjson would write as null
    and the standard codec refuses."""
    if orjson is not None:
        try:
            body = orjson.dumps(header)
        except TypeError:
            pass
        else:
            if b"null" not in body or not _has_nonfinite(header):
                return body
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _has_nonfinite(value: Any) -> bool:
    if isinstance(value, float):
        return value != value or value in (float("inf"), float("-inf"))
    if isinstance(value, Mapping):
        return any(_has_nonfinite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_nonfinite(v) for v in value)
    return False


def encode_frame(header: Mapping[str, Any]) -> bytes:
    """The length prefix and the compact JSON of `header` (a payload, if any, follows it)."""
    body = encode_json(header)
    if len(body) > MAX_HEADER_BYTES:
        raise ProtocolError(f"frame header of {len(body)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit "
                            f"(starts {body[:60]!r})")
    return LENGTH.pack(len(body)) + body


# No field of Mesh's protocols or of its HTTP API holds a longer integer (64 bits: 20 digits).
# Python's int() of a long digit string costs quadratic time and, past 4,300 digits, raises a
# ValueError: a decoder refuses such an integer first.
MAX_INT_DIGITS = 20


class LongInteger(ValueError):
    """A JSON integer of more than MAX_INT_DIGITS digits (`digits`: its text)."""

    def __init__(self, digits: str) -> None:
        super().__init__(f"an integer of {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
        self.digits = digits


def bounded_int(text: str) -> int:
    """json's parse_int: an integer of at most MAX_INT_DIGITS digits, else LongInteger."""
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise LongInteger(text)
    return int(text)


def not_a_number(name: str) -> Any:
    """json's parse_constant: NaN and the infinities are not JSON (RFC 8259), though Python's
    decoder takes them."""
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads_strict(body: bytes) -> Any:
    """JSON as RFC 8259 has it: no NaN or infinities, no number out of a double's range, no
    integer of more than MAX_INT_DIGITS digits; ValueError (or RecursionError, nested too
    deep) otherwise. orjson refuses all of these itself (an integer past 64 bits becomes a
    finite float or an error)."""
    if orjson is not None:
        return orjson.loads(body)
    return json.loads(body, parse_int=bounded_int, parse_float=_finite_float, parse_constant=not_a_number)


def decode_header(body: bytes, type_key: str) -> dict[str, Any]:
    """The header in a frame body; UndecodableFrame (a ProtocolError) unless it is a JSON
    object with a string under `type_key`."""
    try:
        header = loads_strict(body)
    except (ValueError, RecursionError) as exc:  # orjson's JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UndecodableFrame(f"frame header is not valid UTF-8 JSON: {exc}", message_id(body)) from exc
    if not isinstance(header, dict) or not isinstance(header.get(type_key), str):
        mid = header.get("id") if isinstance(header, dict) else None
        raise UndecodableFrame(f"frame header must be a JSON object with a string type {type_key!r}, "
                               f"got {str(header)[:80]}", mid if is_message_id(mid) else None)
    return header


MESSAGE_ID_BITS = 63


def is_message_id(value: Any) -> bool:
    """A request's `id`: an integer (not a bool) in [0, 2^63)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**MESSAGE_ID_BITS


_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+')
_ID = re.compile(rb"\d{1,18}")
ID_SCAN_BYTES = 65536  # a sender puts `id` first (mesh.control.agent_client); it is looked for this far at most


def message_id(body: bytes) -> int | None:
    """The top-level integer `id` of a frame body that does not decode (bad JSON, a number
    out of range, nesting too deep), found by scanning its first ID_SCAN_BYTES without
    decoding it; None if there is none there."""
    depth, prev, key = 0, b"", None
    for match in _TOKENS.finditer(body, 0, min(len(body), ID_SCAN_BYTES)):
        tok = match.group()
        if tok == b"{" or tok == b"[":
            if depth == 1 and key == b'"id"':
                return None
            depth, key = depth + 1, None
        elif tok == b"}" or tok == b"]":
            depth -= 1
            if depth <= 0:
                return None
        elif depth == 1:
            if tok == b":":
                key = prev
            elif key == b'"id"':
                return int(tok) if _ID.fullmatch(tok) else None
            elif tok != b",":
                key = None
        prev = tok
    return None


def payload_size(header: Mapping[str, Any]) -> int:
    """The payload bytes that follow `header` (its `nbytes`, 0 when absent)."""
    n = header.get("nbytes", 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ProtocolError(f"frame header has a bad nbytes {n!r} (want an integer >= 0)")
    return n


def _check_length(length: int, limit: int = MAX_HEADER_BYTES) -> None:
    if length > limit:
        raise ProtocolError(f"frame header of {length} bytes exceeds the {limit}-byte limit")


async def _read(reader: asyncio.StreamReader, n: int, where: str) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"connection closed inside a frame {where} ({len(exc.partial)} of {n} bytes)") from exc


async def read_header(reader: asyncio.StreamReader, type_key: str,
                      max_bytes: int = MAX_HEADER_BYTES) -> dict[str, Any] | None:
    """The next frame's header (its payload, if any, still unread), or None at a clean end of
    stream. A length over `max_bytes` is refused before the header is read."""
    try:
        head = await reader.readexactly(LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError(f"connection closed inside a frame header "
                            f"({len(exc.partial)} of {LENGTH.size} length bytes)") from exc
    (length,) = LENGTH.unpack(head)
    _check_length(length, max_bytes)
    return decode_header(await _read(reader, length, "header"), type_key)


async def read_payload(reader: asyncio.StreamReader, header: Mapping[str, Any],
                       max_bytes: int = MAX_PAYLOAD_BYTES) -> bytes:
    """The payload `header` announces; ProtocolError, before reading any of it, when it
    announces more than `max_bytes`."""
    n = payload_size(header)
    if n > max_bytes:
        raise ProtocolError(f"frame payload of {n} bytes exceeds the {max_bytes}-byte limit")
    return await _read(reader, n, "payload") if n else b""


async def skip_payload(reader: asyncio.StreamReader, header: Mapping[str, Any],
                       max_bytes: int = MAX_PAYLOAD_BYTES) -> None:
    """Read past the payload `header` announces without keeping it (bounded like read_payload)."""
    n = payload_size(header)
    if n > max_bytes:
        raise ProtocolError(f"frame payload of {n} bytes exceeds the {max_bytes}-byte limit")
    while n:
        n -= len(await _read(reader, min(n, 1 << 20), "payload"))


async def read_frame(reader: asyncio.StreamReader, type_key: str, payloads: bool = False,
                     max_payload: int = MAX_PAYLOAD_BYTES) -> tuple[dict[str, Any], bytes] | None:
    """The next (header, payload), or None at a clean end of stream (EOF between frames).
    Without `payloads` the payload is always b"" (an `nbytes` key is just a field)."""
    header = await read_header(reader, type_key)
    if header is None:
        return None
    return header, (await read_payload(reader, header, max_payload) if payloads else b"")


async def read_first_frame(reader: asyncio.StreamReader, type_key: str) -> dict[str, Any] | None:
    """A connection's first header, the one that must carry its token: at most
    AUTH_FRAME_BYTES, within AUTH_DEADLINE_S (ProtocolError otherwise); None on a clean EOF."""
    try:
        return await asyncio.wait_for(read_header(reader, type_key, AUTH_FRAME_BYTES), AUTH_DEADLINE_S)
    except asyncio.TimeoutError:
        raise ProtocolError(f"no first frame within {AUTH_DEADLINE_S:g} s") from None


class ConnectionGate:
    """At most `limit` connections of a port before they authenticate: one over it is closed
    at once (`enter` False), so idle strangers cannot hold the port's file descriptors."""

    def __init__(self, limit: int = MAX_UNAUTHENTICATED) -> None:
        self.limit = limit
        self.pending = 0
        self.refused = 0  # connections closed for being over the limit

    def enter(self) -> bool:
        if self.pending >= self.limit:
            self.refused += 1
            return False
        self.pending += 1
        return True

    def leave(self) -> None:
        self.pending -= 1


async def send_frame(writer: asyncio.StreamWriter, header: Mapping[str, Any]) -> None:
    """Write one frame without payload and wait for the transport's buffer to drain."""
    writer.write(encode_frame(header))
    await writer.drain()


class FrameDecoder:
    """Incremental decoder of payload-less frames, for callers that get bytes in arbitrary
    pieces (tests, tools)."""

    def __init__(self, type_key: str) -> None:
        self.type_key = type_key
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The headers completed by `data`, in order."""
        self._buf += data
        out = []
        while len(self._buf) >= LENGTH.size:
            (length,) = LENGTH.unpack_from(self._buf)
            _check_length(length)
            end = LENGTH.size + length
            if len(self._buf) < end:
                break
            out.append(decode_header(bytes(self._buf[LENGTH.size:end]), self.type_key))
            del self._buf[:end]
        return out
