"""The layer protocol: activations between node agents (BlitzScale 5.2, λScale 4.3).

A node agent with a layer host (mesh.node.layer_host, `--layers-listen`) runs decoder layer
ranges of the models it holds, whole or still arriving block by block. Its peers (the
control side, and other agents pulling activations) talk to it over mesh.framing's frames
with type key `t` and payloads: a batch's hidden states travel as the payload of the frame
that carries them, as the C-contiguous (tokens, hidden_size) tensor, so one hop costs
hidden_size x tokens x dtype bytes (counted on both ends, `LayerCounters`).

Requests carry an integer `id` and get one reply `{t: "reply", re: id, ok, ...}`; a
connection's first frame is `auth {token}` (the agent's token; any when it has none).

    auth     {token}
    open     {model, path}                    -> {layers, ready}: start the model's engine from a
                                                 file here (whole), or from the blocks of a
                                                 transfer to this node as they arrive (path
                                                 names the transfer's output file)
    status   {model}                          -> {layers, ready, head}
    run      {model, start, stop, tokens | hidden | pull, keep?}
                                              -> {next: NextTokens} or {hidden: meta} + payload, or
                                                 {kept: true} when `keep`: the output stays here
                                                 for a peer to `take` (the new instance's queue,
                                                 BlitzScale Fig. 16); `pull: {request_ids,
                                                 address?, token?}`: the input is what that peer
                                                 kept for them, taken first (agent to agent,
                                                 never through the caller), or what this host
                                                 kept (no address)
    take     {model, request_ids}             -> {hidden: meta} + payload: kept outputs, removed
    release  {model, request_ids}             -> {}: free their KV caches (ended, moved)
    counters {}                               -> LayerCounters
    lend     {model, from_layer, layers, work_s, transfer_s, alone_s}
                                              -> {lent, after_s, why}: an emulated node's
                                                 ZigZag (mesh.node.lending): the target of a
                                                 live scale-out asks its partner instance
                                                 (`model`: its instance id) to run the rest of
                                                 an iteration; `after_s`: when that ends, from
                                                 the request's arrival

Every message is a dataclass here with `to_header()` / `from_header()`; decoders bound every
field and raise ProtocolError on anything else.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict, dataclass
from typing import Annotated, Any, ClassVar, Mapping

from mesh import framing
from mesh.engines.engine_api import DTYPE_BYTES, HiddenStates, NextTokens, TokenBatch
from mesh.framing import ProtocolError
from mesh.wire.codec import Declared, Wire

TYPE_KEY = "t"
STREAM_LIMIT = 4 << 20
MAX_BATCH = 4096  # requests in one batch
MAX_TOKENS = 1 << 20  # tokens in one batch
MAX_NAME = 512


def _int(h: Mapping[str, Any], key: str, lo: int = 0, hi: int = 1 << 40) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ProtocolError(f"layer message field {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _str(h: Mapping[str, Any], key: str) -> str:
    return _name(h.get(key), key)


def _name(v: Any, key: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME:
        raise ProtocolError(f"layer message field {key!r} must be a non-empty string of at most {MAX_NAME} "
                            f"characters, got {v!r}")
    return v


def _ints(v: Any, key: str, n: int | None = None) -> tuple[int, ...]:
    if (not isinstance(v, list) or len(v) > MAX_TOKENS
            or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in v)):
        raise ProtocolError(f"layer message field {key!r} must be a list of integers >= 0")
    if n is not None and len(v) != n:
        raise ProtocolError(f"layer message field {key!r} has {len(v)} entries, want {n}")
    return tuple(v)


def _seconds(v: Any, key: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 1e6:
        raise ProtocolError(f"layer message field {key!r} must be seconds in [0, 1e6], got {v!r}")
    return float(v)


def _ids(v: Any, key: str = "request_ids") -> tuple[str, ...]:
    if (not isinstance(v, list) or not 0 < len(v) <= MAX_BATCH
            or any(not isinstance(x, str) or not 0 < len(x) <= MAX_NAME for x in v)):
        raise ProtocolError(f"layer message field {key!r} must be a list of 1-{MAX_BATCH} request ids")
    if len(set(v)) != len(v):
        raise ProtocolError(f"layer message field {key!r} names a request twice")
    return tuple(v)


def tokens_to_header(batch: TokenBatch) -> dict[str, Any]:
    return {"request_ids": list(batch.request_ids), "positions": list(batch.positions),
            "token_ids": [list(t) for t in batch.token_ids]}


def tokens_from_header(h: Mapping[str, Any]) -> TokenBatch:
    ids = _ids(h.get("request_ids"))
    token_ids = h.get("token_ids")
    if not isinstance(token_ids, list) or len(token_ids) != len(ids):
        raise ProtocolError("token batch: one token list per request")
    lists = tuple(_ints(t, "token_ids") for t in token_ids)
    if sum(map(len, lists)) > MAX_TOKENS or any(not t for t in lists):
        raise ProtocolError(f"token batch: 1 to {MAX_TOKENS} tokens per batch, at least one per request")
    return TokenBatch(ids, _ints(h.get("positions"), "positions", len(ids)), lists)


def hidden_meta(hidden: HiddenStates) -> dict[str, Any]:
    """The header fields of hidden states whose `data` travels as the frame's payload."""
    return {"layer": hidden.layer, "request_ids": list(hidden.request_ids), "positions": list(hidden.positions),
            "token_counts": list(hidden.token_counts), "hidden_size": hidden.hidden_size, "dtype": hidden.dtype}


def hidden_from(meta: Mapping[str, Any], payload: bytes) -> HiddenStates:
    if not isinstance(meta, Mapping):
        raise ProtocolError("hidden states: want an object")
    ids = _ids(meta.get("request_ids"))
    dtype = meta.get("dtype")
    if dtype not in DTYPE_BYTES:
        raise ProtocolError(f"hidden states in {dtype!r}: want one of {', '.join(DTYPE_BYTES)}")
    counts = _ints(meta.get("token_counts"), "token_counts", len(ids))
    size = _int(meta, "hidden_size", 1, 1 << 20)
    if any(c < 1 for c in counts) or len(payload) != sum(counts) * size * DTYPE_BYTES[dtype]:
        raise ProtocolError(f"hidden states: {len(payload)} payload bytes do not hold {sum(counts)} tokens x {size} "
                            f"x {dtype}")
    return HiddenStates(_int(meta, "layer", 0, 1 << 16), ids, _ints(meta.get("positions"), "positions", len(ids)),
                        counts, size, str(dtype), payload)


Name = Annotated[str, Wire(_name)]  # a model, a path: 1 to MAX_NAME characters
RequestIds = Annotated[tuple[str, ...], Wire(_ids)]
LayerIndex = Annotated[int, Wire(lambda v, n: _int({n: v}, n, 0, 1 << 16))]
Seconds = Annotated[float, Wire(_seconds)]


@dataclass(frozen=True, slots=True)
class Peer:
    """Another agent's layer port, and the token its first frame needs."""

    address: str  # host:port
    token: str | None = None


class _Named(Declared):
    """A message of names only: its fields are strings, or tuples of request ids, declared as
    Name and RequestIds (one codec for open, status, take, release and counters)."""

    __slots__ = ()
    TAG: ClassVar[str]

    @classmethod
    def what(cls) -> str:
        return f"{cls.TAG} message"

    def to_header(self, mid: int) -> dict[str, Any]:
        return {TYPE_KEY: self.TAG, "id": mid, **self.to_fields()}

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> Any:
        return cls.from_fields(h)


@dataclass(frozen=True, slots=True)
class Open(_Named):
    TAG = "open"
    model: Name
    path: Name


@dataclass(frozen=True, slots=True)
class Status(_Named):
    TAG = "status"
    model: Name


@dataclass(frozen=True, slots=True)
class ModelState:
    """A model's engine on an agent: its layers, how many run now (a prefix), the LM head."""

    layers: int
    ready: int
    head: bool

    def to_fields(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, h: Mapping[str, Any]) -> "ModelState":
        return cls(_int(h, "layers", 0, 1 << 16), _int(h, "ready", 0, 1 << 16), bool(h.get("head")))


@dataclass(frozen=True, slots=True)
class Run:
    """Run layers [start, stop) of `model` over a batch: token ids (start 0), hidden states
    (carried as the payload), or (batch None) the hidden states kept for `pull_ids` by the
    peer `pull`, or by this host itself when `pull` is None (a loading instance going on
    with a request once more layers are in). `keep`: hold the output here for a peer's
    `take` instead of sending it back."""

    model: str
    start: int
    stop: int
    batch: TokenBatch | HiddenStates | None
    pull: Peer | None = None
    pull_ids: tuple[str, ...] = ()
    keep: bool = False

    def to_header(self, mid: int) -> tuple[dict[str, Any], bytes]:
        h: dict[str, Any] = {"t": "run", "id": mid, "model": self.model, "start": self.start, "stop": self.stop,
                             "keep": self.keep}
        payload = b""
        if isinstance(self.batch, TokenBatch):
            h["tokens"] = tokens_to_header(self.batch)
        elif isinstance(self.batch, HiddenStates):
            h["hidden"], payload = hidden_meta(self.batch), self.batch.data
            h["nbytes"] = len(payload)
        if self.batch is None:  # from a peer's kept outputs, or this host's own (pull None)
            h["pull"] = {"request_ids": list(self.pull_ids)}
            if self.pull is not None:
                h["pull"].update(address=self.pull.address, token=self.pull.token)
        return h, payload

    @classmethod
    def from_header(cls, h: Mapping[str, Any], payload: bytes) -> "Run":
        start, stop = _int(h, "start", 0, 1 << 16), _int(h, "stop", 1, 1 << 16)
        if start >= stop:
            raise ProtocolError(f"run: layers [{start}, {stop}) is empty")
        batch: TokenBatch | HiddenStates | None = None
        pull: Peer | None = None
        pull_ids: tuple[str, ...] = ()
        if "tokens" in h:
            batch = tokens_from_header(h["tokens"])
        elif "hidden" in h:
            batch = hidden_from(h["hidden"], payload)
        elif isinstance(h.get("pull"), Mapping):
            p = h["pull"]
            if p.get("address") is not None:
                token = p.get("token")
                pull = Peer(_str(p, "address"), token if isinstance(token, str) else None)
            pull_ids = _ids(p.get("request_ids"))
        else:
            raise ProtocolError("run: give tokens, hidden states or a peer to pull them from")
        return cls(_str(h, "model"), start, stop, batch, pull, pull_ids, bool(h.get("keep")))


@dataclass(frozen=True, slots=True)
class Take(_Named):
    TAG = "take"
    model: Name
    request_ids: RequestIds


@dataclass(frozen=True, slots=True)
class Release(_Named):
    TAG = "release"
    model: Name
    request_ids: RequestIds


@dataclass(frozen=True, slots=True)
class Counters(_Named):
    """Ask for the host's LayerCounters."""

    TAG = "counters"


@dataclass(frozen=True, slots=True)
class Lend(_Named):
    """An emulated target's iteration for its ZigZag partner (BlitzScale 5.2, Fig. 16): the
    partner instance `model` runs layers [from_layer, layers) of an iteration of full-speed
    time `work_s` after its activation's hop (`transfer_s`), if that ends
    within `alone_s`, when the target alone would end it (seconds from now)."""

    TAG = "lend"
    model: Name
    from_layer: LayerIndex
    layers: LayerIndex
    work_s: Seconds
    transfer_s: Seconds
    alone_s: Seconds


@dataclass(frozen=True, slots=True)
class Lent:
    """A `lend`'s reply: lent (the partner's part ends `after_s` from the request's
    arrival), or not and why."""

    lent: bool
    after_s: float = 0.0
    why: str = ""

    def to_fields(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, h: Mapping[str, Any]) -> "Lent":
        return cls(bool(h.get("lent")), _seconds(h.get("after_s", 0.0), "after_s"), str(h.get("why", ""))[:MAX_NAME])


@dataclass(slots=True)
class LayerCounters:
    """What an agent's layer host has done: activation bytes in and out (one hop each),
    batches and layer-passes run, compute seconds."""

    bytes_in: int = 0
    bytes_out: int = 0
    batches: int = 0
    layer_passes: int = 0  # sum over batches of the layers run
    compute_s: float = 0.0

    def to_fields(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, h: Mapping[str, Any]) -> "LayerCounters":
        return cls(_int(h, "bytes_in"), _int(h, "bytes_out"), _int(h, "batches"), _int(h, "layer_passes"),
                   float(h.get("compute_s", 0.0)))


@dataclass(frozen=True, slots=True)
class RunResult:
    """A `run`'s reply: next tokens (a last range), hidden states, or kept here."""

    output: NextTokens | HiddenStates | None
    compute_s: float = 0.0
    pulled_bytes: int = 0  # activation bytes taken from the pull peer for this run

    def to_fields(self) -> tuple[dict[str, Any], bytes]:
        h: dict[str, Any] = {"compute_s": self.compute_s, "pulled_bytes": self.pulled_bytes}
        if isinstance(self.output, NextTokens):
            h["next"] = {"request_ids": list(self.output.request_ids), "token_ids": list(self.output.token_ids)}
            return h, b""
        if isinstance(self.output, HiddenStates):
            h["hidden"] = hidden_meta(self.output)
            h["nbytes"] = len(self.output.data)
            return h, self.output.data
        h["kept"] = True
        return h, b""

    @classmethod
    def from_fields(cls, h: Mapping[str, Any], payload: bytes) -> "RunResult":
        output: NextTokens | HiddenStates | None = None
        if isinstance(h.get("next"), Mapping):
            ids = _ids(h["next"].get("request_ids"))
            output = NextTokens(ids, _ints(h["next"].get("token_ids"), "token_ids", len(ids)))
        elif "hidden" in h:
            output = hidden_from(h["hidden"], payload)
        return cls(output, float(h.get("compute_s", 0.0)), int(h.get("pulled_bytes", 0)))




class LayerCallFailed(RuntimeError):
    """A layer host answered a request with ok=false; the message is its reason."""


class LayerConnection:
    """One connection to an agent's layer port: requests answered in order, one at a time
    (the caller's lock; a layer host runs one forward pass at a time anyway)."""

    def __init__(self, reader: "asyncio.StreamReader", writer: "asyncio.StreamWriter") -> None:
        self.reader, self.writer = reader, writer
        self.lock = asyncio.Lock()
        self._next = 0
        self.bytes_sent = 0  # payload bytes (activations) this side sent
        self.bytes_received = 0

    @classmethod
    async def open(cls, peer: Peer, timeout_s: float = 10.0) -> "LayerConnection":
        host, _, port = peer.address.rpartition(":")
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port), limit=STREAM_LIMIT),
                                                timeout_s)
        writer.write(framing.encode_frame({"t": "auth", "token": peer.token}))
        return cls(reader, writer)

    async def call(self, header: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """Send one request (its `id` is set here) and return the reply's (fields, payload);
        LayerCallFailed when the host refused it, ConnectionError when the link is gone."""
        async with self.lock:
            self._next += 1
            header = {**header, "id": self._next}
            if payload:
                header["nbytes"] = len(payload)
            self.writer.write(framing.encode_frame(header))
            if payload:
                self.writer.write(payload)
                self.bytes_sent += len(payload)
            await self.writer.drain()
            got = await framing.read_frame(self.reader, TYPE_KEY, payloads=True)
            if got is None:
                raise ConnectionError("the layer host closed the connection")
            reply, data = got
            self.bytes_received += len(data)
            if reply.get("re") != self._next:
                raise ProtocolError(f"reply to {reply.get('re')!r}, expected {self._next}")
            if not reply.get("ok"):
                raise LayerCallFailed(str(reply.get("error", "refused")))
            return reply, data

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


def reply_frame(mid: Any, fields: Mapping[str, Any], payload: bytes = b"") -> bytes:
    header = {"t": "reply", "re": mid, "ok": True, **fields}
    if payload:
        header["nbytes"] = len(payload)
    return framing.encode_frame(header) + payload


def failure_frame(mid: Any, error: str) -> bytes:
    return framing.encode_frame({"t": "reply", "re": mid, "ok": False, "error": error})
