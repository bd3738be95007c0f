"""A node agent's layer host: runs decoder layer ranges of the models it holds, whole or
still arriving, and passes activations to and from other agents (BlitzScale 5.2, λScale 4.3).

It listens on a port of its own (`--layers-listen`) and speaks mesh.wire.layers. A model is
opened from a layer-ordered file on this node (mesh.modelfiles.layer_order), or from the
blocks of a multicast to this node as they arrive: the agent's weights receiver hands every
verified block in (`on_block`), and the engine (mesh.engines.torch_layers) loads each layer
once the blocks before its end are in, so the model runs its first layers before its last
block is here.

A `run` with `keep` holds its output hidden states here, by request, for a peer's `take`:
the new instance's queue of BlitzScale Fig. 16, from which the partner pulls; a `run` with
`pull` takes its input from that peer first, agent to agent. One forward pass runs at a
time (a node computes one iteration at a time, LLM-Mesh 5.1), in a thread, so the port keeps
answering; every activation byte in and out is counted (`LayerCounters`).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from mesh.engines.engine_api import DTYPE_BYTES, EngineError, HiddenStates
from mesh.framing import ConnectionGate, ProtocolError, read_first_frame, read_frame
from mesh.modelfiles.layer_order import LayerFileError, header_length, read_layout
from mesh.weights.blocks import Manifest
from mesh.wire.layers import (
    STREAM_LIMIT,
    TYPE_KEY,
    LayerCallFailed,
    LayerConnection,
    LayerCounters,
    Lend,
    Lent,
    ModelState,
    Open,
    Peer,
    Release,
    Run,
    RunResult,
    Status,
    Take,
    failure_frame,
    hidden_from,
    hidden_meta,
    reply_frame,
)

log = logging.getLogger(__name__)
LAYERS_PREFIX = "MESH_AGENT_LAYERS "  # the agent prints this + "host:port" once its layer port listens


@dataclass
class _Arriving:
    """Blocks of a multicast to this node, kept until the model's engine takes them."""

    manifest: Manifest
    blocks: dict[int, bytes] = field(default_factory=dict)


@dataclass
class _Model:
    engine: Any  # a TorchLayerEngine
    kept: dict[str, HiddenStates] = field(default_factory=dict)  # outputs waiting for a peer's take
    fed: set[int] = field(default_factory=set)  # blocks handed to a receiving engine


def _split(hidden: HiddenStates) -> dict[str, HiddenStates]:
    """One HiddenStates per request of a batch (rows are request after request)."""
    row = hidden.hidden_size * DTYPE_BYTES[hidden.dtype]
    out, offset = {}, 0
    for rid, pos, n in zip(hidden.request_ids, hidden.positions, hidden.token_counts):
        out[rid] = HiddenStates(hidden.layer, (rid,), (pos,), (n,), hidden.hidden_size, hidden.dtype,
                                hidden.data[offset:offset + n * row])
        offset += n * row
    return out


def _join(parts: list[HiddenStates]) -> HiddenStates:
    layers = {p.layer for p in parts}
    if len(layers) != 1:
        raise EngineError(f"the requests taken stand at different layers {sorted(layers)}; take them separately")
    first = parts[0]
    return HiddenStates(first.layer, tuple(r for p in parts for r in p.request_ids),
                        tuple(x for p in parts for x in p.positions), tuple(n for p in parts for n in p.token_counts),
                        first.hidden_size, first.dtype, b"".join(p.data for p in parts))


class LayerHost:
    def __init__(self, token: str | None = None, roots: tuple[Path, ...] = (),
                 make_engine: Callable[..., Any] | None = None,
                 lender: Callable[[Lend], Lent] | None = None) -> None:
        """`roots`: folders whose files `open` may read (the agent's model folders and its
        weights folder). `make_engine`: the engine class (default mesh.engines.torch_layers).
        `lender`: answers `lend` (an emulating node's ZigZag, mesh.node.lending)."""
        self.lender = lender
        self.token = token or None
        self.roots = tuple(Path(r).resolve() for r in roots)
        self.models: dict[str, _Model] = {}
        self.by_path: dict[str, str] = {}  # a multicast's output path -> the model opened from it
        self.arriving: dict[str, _Arriving] = {}  # output path -> blocks so far
        self.counters = LayerCounters()
        self._engine_cls = make_engine
        self._compute = asyncio.Lock()
        self._peers: dict[str, LayerConnection] = {}
        self._gate = ConnectionGate()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Import the engine (torch: seconds, off the loop), then listen: a host that answers
        can run layers at once, and a model's first block is not held up by the import."""
        await asyncio.to_thread(self._engine)
        self._server = await asyncio.start_server(self._connection, host, port, limit=STREAM_LIMIT)
        bound = self._server.sockets[0].getsockname()
        return f"{bound[0]}:{bound[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for conn in self._peers.values():
            await conn.close()
        for task in list(self._tasks):
            task.cancel()

    def _engine(self) -> Any:
        """The engine class (imported by `start`)."""
        if self._engine_cls is None:
            from mesh.engines.torch_layers import TorchLayerEngine  # torch is imported on first use
            self._engine_cls = TorchLayerEngine
        return self._engine_cls

    # --- blocks as they arrive ---------------------------------------------------------------
    def on_block(self, output: str, manifest: Manifest, index: int, data: bytes) -> None:
        """The weights receiver's hook: a verified block of a transfer to `output`."""
        arriving = self.arriving.setdefault(output, _Arriving(manifest))
        arriving.blocks[index] = data
        name = self.by_path.get(output)
        if name is not None:
            self._spawn(self._feed(name, output))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _feed(self, name: str, output: str) -> None:
        """Hand the model's engine the blocks that arrived for it (the engine is made once
        block 0, which holds the file's header, is here)."""
        async with self._compute:
            model, arriving = self.models.get(name), self.arriving.get(output)
            if arriving is None:
                return
            if model is None:
                first = arriving.blocks.get(0)
                if first is None:
                    return
                try:
                    if len(first) < header_length(first):
                        raise LayerFileError("block 0 does not hold the whole header; cut blocks at layer boundaries")
                    layout = read_layout(first)
                except LayerFileError as exc:
                    log.warning("%s: %s", name, exc)
                    return
                spans = [(b.offset, b.size) for b in arriving.manifest.blocks]
                model = self.models[name] = _Model(self._engine().receiving(layout, spans, model_name=name))
            for index in sorted(set(arriving.blocks) - model.fed):
                await asyncio.to_thread(model.engine.receive_block, index, arriving.blocks[index])
                model.fed.add(index)
            if len(model.fed) == arriving.manifest.count:
                self.arriving.pop(output, None)  # the engine holds what it needs

    # --- connections -------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._gate.enter():
            writer.close()
            return
        try:
            try:
                first = await read_first_frame(reader, TYPE_KEY)
            finally:
                self._gate.leave()
            if first is None or first.get("t") != "auth" or not self._token_ok(first.get("token")):
                writer.write(failure_frame(None, "auth first, with the agent's token ($MESH_AGENT_TOKEN)"))
                return
            while True:
                got = await read_frame(reader, TYPE_KEY, payloads=True)
                if got is None:
                    return
                header, payload = got
                mid = header.get("id")
                try:
                    fields, out = await self._handle(header, payload)
                except (EngineError, ProtocolError, LayerCallFailed, LayerFileError, ConnectionError, OSError) as exc:
                    writer.write(failure_frame(mid, str(exc)))
                else:
                    writer.write(reply_frame(mid, fields, out))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ProtocolError):
            pass
        finally:
            writer.close()

    def _token_ok(self, given: Any) -> bool:
        if self.token is None:
            return True
        return isinstance(given, str) and hmac.compare_digest(given.encode(), self.token.encode())

    async def _handle(self, h: Mapping[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        kind = h.get("t")
        if kind == "run":
            return await self._run(Run.from_header(h, payload))
        if kind == "take":
            m = Take.from_header(h)
            hidden = self._take(m.model, m.request_ids)
            self.counters.bytes_out += hidden.nbytes
            return {"hidden": hidden_meta(hidden)}, hidden.data
        if kind == "open":
            return self._state(await self._open(Open.from_header(h))), b""
        if kind == "status":
            return self._state(Status.from_header(h).model), b""
        if kind == "release":
            m = Release.from_header(h)
            model = self.models.get(m.model)  # a model not open (yet) holds nothing
            for rid in m.request_ids if model is not None else ():
                model.engine.release(rid)
                model.kept.pop(rid, None)
            return {}, b""
        if kind == "counters":
            return self.counters.to_fields(), b""
        if kind == "lend":
            if self.lender is None:
                raise ProtocolError("this node lends no time: it does not emulate")
            return self.lender(Lend.from_header(h)).to_fields(), b""
        raise ProtocolError(f"unknown layer message {kind!r}")

    def _model(self, name: str) -> _Model:
        model = self.models.get(name)
        if model is None:
            raise EngineError(f"model {name!r} is not open on this node's layer host; open it first")
        return model

    def _state(self, name: str) -> dict[str, Any]:
        model = self.models.get(name)
        if model is None:  # opened from a multicast whose block 0 is not here yet: nothing runs
            return ModelState(0, 0, False).to_fields()
        engine = model.engine
        return ModelState(engine.layer_range.num_layers, engine.layers_ready(), engine.head_ready()).to_fields()

    async def _open(self, m: Open) -> str:
        if m.model in self.models or self.by_path.get(m.path) == m.model:
            return m.model
        path = Path(m.path).resolve()
        if self.roots and not any(path.is_relative_to(r) for r in self.roots):
            raise EngineError(f"{m.path} is outside this node's model folders; open a model this node holds")
        if path.is_file() or path.is_dir():
            async with self._compute:
                engine = await asyncio.to_thread(self._engine().from_folder, path, model_name=m.model)
            self.models[m.model] = _Model(engine)
        else:  # a multicast to this node writes it there: run its layers as its blocks come
            self.by_path[m.path] = m.model
            await self._feed(m.model, m.path)
        return m.model

    def _take(self, name: str, request_ids: tuple[str, ...]) -> HiddenStates:
        model = self._model(name)
        missing = [r for r in request_ids if r not in model.kept]
        if missing:
            raise EngineError(f"no kept hidden states for {missing} on this node; run them with keep first")
        return _join([model.kept.pop(r) for r in request_ids])

    async def _pull(self, peer: Peer, name: str, request_ids: tuple[str, ...]) -> HiddenStates:
        conn = self._peers.get(peer.address)
        if conn is None or conn.writer.is_closing():
            conn = self._peers[peer.address] = await LayerConnection.open(peer)
        reply, data = await conn.call(Take(name, request_ids).to_header(0))
        hidden = hidden_from(reply["hidden"], data)
        self.counters.bytes_in += hidden.nbytes
        return hidden

    async def _run(self, m: Run) -> tuple[dict[str, Any], bytes]:
        model = self._model(m.model)
        pulled = 0
        batch = m.batch
        if batch is None and m.pull is None:  # what this host kept: no hop
            batch = self._take(m.model, m.pull_ids)
        elif batch is None:
            batch = await self._pull(m.pull, m.model, m.pull_ids)
            pulled = batch.nbytes
        elif isinstance(batch, HiddenStates):
            self.counters.bytes_in += batch.nbytes
        engine = model.engine
        if isinstance(batch, HiddenStates) and batch.layer != m.start:
            raise EngineError(f"hidden states for layer {batch.layer} sent to run from layer {m.start}")
        loop = asyncio.get_running_loop()
        async with self._compute:
            began = loop.time()
            out = await asyncio.to_thread(engine.run_layers, batch, None, m.stop)
            spent = loop.time() - began
        self.counters.batches += 1
        self.counters.layer_passes += m.stop - m.start
        self.counters.compute_s += spent
        if isinstance(out, HiddenStates) and m.keep:
            model.kept.update(_split(out))
            return RunResult(None, spent, pulled).to_fields()
        if isinstance(out, HiddenStates):
            self.counters.bytes_out += out.nbytes
        return RunResult(out, spent, pulled).to_fields()
