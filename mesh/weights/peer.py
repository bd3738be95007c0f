"""The node agent's weight transport: receives, verifies, forwards and sends model blocks.

    MESH_WEIGHTS_TOKEN=... python -m mesh.weights.peer --port P [--host H] [--link-mbps L]

prints `READY <host> <port>` once it listens. With a token (`WeightAgent(token=...)`; the
command reads it from the environment variable MESH_WEIGHTS_TOKEN, never from argv, where
`ps` would show it), the first frame of every connection, control or data, must carry
`"token"` equal to it; anything else is answered with an `error` frame ("weights token
missing" / "weights token wrong") and closed before any block is accepted. The agent puts
its own token in the first frame of the data connections it opens to its peers, so all the
agents of a multicast share one token. Unset: no token (a trusted network).

Authentication comes first (mesh.framing): the first frame of a connection may be at most
4 KiB and must arrive within 5 s, and only its header is read before the token is checked.
A coordinator therefore opens each control connection with `auth {token}` (its `start`,
which holds the manifest and plan, can be larger); a data connection's first `block` header
carries the token. A block's payload may be no larger than its block in the transfer's
manifest (at most framing.MAX_PAYLOAD_BYTES for a transfer that has ended here), refused
from the header, before any of it is read. At most framing.MAX_UNAUTHENTICATED connections
wait for their first frame at once; more are closed on arrival.

A coordinator opens one control connection per multicast ("transfer") and sends `start`
(the manifest, the plan, the peers' addresses, a source file or an output path); the agent
answers `ready` once it holds its blocks (a source reads and verifies its file into host
memory), and starts sending on `go`.

- Sends follow the plan: the node's transfers in round order, one at a time (the one-port
  model), each as soon as the block is here: a forwarder passes a block on when it has it,
  never waiting for the whole model (BlitzScale 5.1; the plan's rounds are not synchronised
  across nodes, they only order each node's sends).
- Every received block is checked against the manifest's sha256 before it is kept or
  forwarded; a mismatch is reported as a `corrupt` event naming the block and the sender.
- Events go back on the control connection: `have` per block, `complete`, `saved` (the file
  written atomically), `peer_failed` (a send failed: the peer is dropped from this
  transfer), `corrupt`.
- `replan` replaces the node's remaining sends (the coordinator re-planned around a failed
  node); a send in progress finishes first. A block that arrives twice is ignored.
- `--link-mbps` paces the node's uplink (all transfers share it) to emulate a per-node NIC
  of that many megabits per second on loopback (see Pacer).

Several transfers can run at once; each has its own id, state and connections. Time comes
only from the event loop.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from mesh import native_heap
from mesh.framing import ConnectionGate, read_payload, skip_payload
from mesh.policy.multicast import Plan
from mesh.tasks import cancel_all
from mesh.weights.blocks import CorruptBlock, Manifest, load_blocks, verify, write_atomic
from mesh.weights.frames import STREAM_LIMIT, ProtocolError, frame, read_first, read_header, read_message, send

CHUNK = 1 << 20  # sends go out in chunks of this size (paced per chunk)
TOKEN_ENV = "MESH_WEIGHTS_TOKEN"  # where the agent commands read the weights token


def token_from_env() -> str | None:
    """The weights token from MESH_WEIGHTS_TOKEN; None when unset or empty (no token)."""
    return os.environ.get(TOKEN_ENV) or None


def token_refusal(expected: str | None, header: dict[str, Any]) -> str | None:
    """Why a connection whose first frame is `header` is refused (None: accepted)."""
    if expected is None:
        return None
    given = header.get("token")
    if given is None:
        return "weights token missing: this agent requires a token in the first frame of every connection"
    if not hmac.compare_digest(str(given).encode(), expected.encode()):
        return "weights token wrong: the first frame's token does not match this agent's"
    return None


class Pacer:
    """The node's uplink, a NIC of `rate` bytes per second shared by all its transfers.

    A block takes the link from when the link is free and the block is here (`ready_at`) for
    size / rate seconds; its chunks leave when the link would have carried them, and the
    receiver is told when the last byte got there (`link_done_at`), which is when it holds
    the block as far as its own link is concerned. So the emulated NICs keep their pace when
    a process is scheduled late (late chunks go at once), and are never faster. The times
    are CLOCK_MONOTONIC (loop.time()), common to all agents on one machine: pacing is a
    loopback emulation."""

    def __init__(self, rate_bytes_per_s: float | None) -> None:
        if rate_bytes_per_s is not None and not rate_bytes_per_s > 0:
            raise ValueError(f"link rate must be > 0, got {rate_bytes_per_s}")
        self.rate = rate_bytes_per_s
        self._free = -math.inf  # when the link finishes what it was given

    def reserve(self, nbytes: int, ready_at: float) -> float:
        """Book the link for `nbytes`; returns when they start going out."""
        assert self.rate is not None
        start = max(self._free, ready_at)
        self._free = start + nbytes / self.rate
        return start

    async def until(self, t: float) -> None:
        delay = t - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)


@dataclass(eq=False)
class _Transfer:
    id: str
    node: str
    manifest: Manifest
    peers: dict[str, tuple[str, int]]
    control: asyncio.StreamWriter
    output: str | None
    blocks: dict[int, bytes] = field(default_factory=dict)
    sends: list[tuple[int, str] | None] = field(default_factory=list)  # None: done
    pos: int = 0  # sends before this index are done
    lookahead: int = 0
    epoch: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dead: set[str] = field(default_factory=set)
    conns: dict[str, asyncio.StreamWriter] = field(default_factory=dict)
    verifying: set[int] = field(default_factory=set)
    corrupt_once: set[int] = field(default_factory=set)  # test hook: flip a byte when sending
    tasks: set[asyncio.Task] = field(default_factory=set)
    sender: asyncio.Task | None = None
    complete: bool = False
    go_at: float = 0.0  # loop time of `go`
    arrived: dict[int, float] = field(default_factory=dict)  # block -> when it got here (paced: by the link)


def _block_bound(st: _Transfer, header: dict[str, Any]) -> int:
    """The most payload bytes a `block` header may announce: its block's size in the
    transfer's manifest (a block that does not exist there: a protocol error)."""
    k = header.get("block")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < st.manifest.count:
        raise ProtocolError(f"block {k!r} is not a block of transfer {st.id!r} ({st.manifest.count} blocks)")
    return st.manifest.blocks[k].size


def _sends(plan: Plan, node: str) -> list[tuple[int, str]]:
    return [(t.block, t.receiver) for t in plan.sends(node)]


def inside(root: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Is `path` inside `root`, both resolved (symlinks followed: a link that leads out is out)?"""
    try:
        return Path(path).resolve().is_relative_to(Path(root).resolve())
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop
        return False


class WeightAgent:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, link_bytes_per_s: float | None = None,
                 token: str | None = None, source_roots: Sequence[str | os.PathLike] | None = None) -> None:
        """`source_roots`: the folders a transfer's `source_path` must be inside (resolved;
        None: anywhere, for the standalone transport). Node agents and the service's origin
        give theirs, so a token holder cannot have any other file of the machine read and sent."""
        self.host, self.port = host, port
        self.token = token or None  # required in the first frame of every connection (None: none)
        self.source_roots = None if source_roots is None else [Path(r) for r in source_roots]
        self.pacer = Pacer(link_bytes_per_s)
        self.transfers: dict[str, _Transfer] = {}
        self._server: asyncio.Server | None = None
        # Called with a received file's path once it is written (a node agent prepares it
        # for its engine then, off the request path).
        self.on_saved: Callable[[str], None] | None = None
        # Called with (the transfer's output path, its manifest, the block's index, its bytes) as
        # each verified block arrives, so a layer host runs a model's layers before the file is
        # whole (BlitzScale 5.2, mesh.node.layer_host).
        self.on_block: Callable[[str, Manifest, int, bytes], None] | None = None
        self._gate = ConnectionGate()  # connections waiting for their first frame

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._on_connection, self.host, self.port, limit=STREAM_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def serve_forever(self) -> None:
        assert self._server is not None, "start() first"
        async with self._server:
            await self._server.serve_forever()

    async def close(self) -> None:
        for st in list(self.transfers.values()):
            await self._forget(st)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # --- connections -------------------------------------------------------------------
    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._gate.enter():  # too many connections not yet authenticated
            writer.close()
            return
        try:
            try:  # authentication first: a small header, soon; no payload read before the token is checked
                first = await read_first(reader)
            finally:
                self._gate.leave()
            if first is None:
                return
            refusal = token_refusal(self.token, first)
            if refusal is not None:
                with contextlib.suppress(ConnectionError):
                    await send(writer, {"type": "error", "transfer": first.get("transfer"),
                                        "node": first.get("node"), "reason": refusal})
                print(f"weights agent {self.port}: refused a {first['type']!r} connection: {refusal}",
                      file=sys.stderr)
                return
            if first["type"] == "auth":  # the token alone; the connection's message follows
                first = await read_header(reader)
                if first is None:
                    return
            if first["type"] == "block":
                await self._data(reader, first)
            else:
                await self._control(reader, writer, first)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the peer went away; a partial block is dropped
        except ProtocolError as exc:
            print(f"weights agent {self.port}: {exc}", file=sys.stderr)
        finally:
            writer.close()

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, header: dict[str,
                                                                                                      Any]) -> None:
        st: _Transfer | None = None
        try:
            while True:
                kind = header["type"]
                if kind == "hello":
                    await send(writer, {"type": "hello", "port": self.port})
                elif kind == "start":
                    if st is not None:
                        raise ProtocolError("one transfer per control connection")
                    st = await self._start(header, writer)
                elif st is None:
                    raise ProtocolError(f"{kind!r} before start")
                elif kind == "go":
                    st.go_at = asyncio.get_running_loop().time()
                    st.sender = asyncio.create_task(self._send_loop(st))
                elif kind == "replan":
                    st.sends = _sends(Plan.from_dict(header["plan"]), st.node)
                    st.pos, st.epoch = 0, int(header["epoch"])
                    st.dead |= set(header.get("dead", ()))
                    st.wake.set()
                elif kind == "end":
                    return
                else:
                    raise ProtocolError(f"unknown control message {kind!r}")
                msg = await read_message(reader)
                if msg is None:
                    return
                header = msg[0]
        finally:
            if st is not None:
                await self._forget(st)

    async def _start(self, h: dict[str, Any], control: asyncio.StreamWriter) -> _Transfer | None:
        tid, node = str(h["transfer"]), str(h["node"])
        try:
            if tid in self.transfers:
                raise ProtocolError(f"transfer {tid!r} is already running here")
            manifest = Manifest.from_dict(h["manifest"])
            plan = Plan.from_dict(h["plan"])
            if plan.blocks != manifest.count:
                raise ProtocolError(f"plan has {plan.blocks} blocks, manifest {manifest.count}")
            st = _Transfer(tid, node, manifest, {n: (a[0], int(a[1])) for n, a in h["peers"].items()},
                           control, h.get("output_path"))
            st.sends = _sends(plan, node)
            st.lookahead = max(0, int(h.get("lookahead", 0)))
            st.corrupt_once = set(h.get("faults", {}).get("corrupt_blocks", ()))
            if h.get("source_path"):
                source = str(h["source_path"])
                if self.source_roots is not None and not any(inside(r, source) for r in self.source_roots):
                    raise OSError(f"source path {source} is outside this node's folders")
                st.blocks = dict(enumerate(await asyncio.to_thread(load_blocks, source, manifest)))
        except (CorruptBlock, OSError) as exc:  # its text names paths, sizes, hashes: logged here, not sent
            print(f"weights agent {self.port}: transfer {tid!r}: {exc}", file=sys.stderr)
            why = (f"the source file does not match the manifest: {exc.public}" if isinstance(exc, CorruptBlock)
                   else "the source file cannot be read")
            await send(control, {"type": "error", "transfer": tid, "node": node, "reason": f"{why} (the node's log "
                                 "has the detail)"})
            raise ProtocolError(f"transfer {tid!r}: the source file cannot be read") from exc
        except (ProtocolError, KeyError, ValueError, TypeError) as exc:
            await send(control, {"type": "error", "transfer": tid, "node": node, "reason": str(exc)})
            raise ProtocolError(f"transfer {tid!r}: {exc}") from exc
        self.transfers[tid] = st
        await send(control, {"type": "ready", "transfer": tid, "node": node, "holds": len(st.blocks)})
        return st

    async def _forget(self, st: _Transfer) -> None:
        if self.transfers.get(st.id) is st:
            del self.transfers[st.id]
        await cancel_all([st.sender, *st.tasks])
        for w in st.conns.values():
            w.close()
        st.conns.clear()
        st.blocks.clear()
        await asyncio.to_thread(native_heap.release)  # the model's blocks go back to the system

    async def _event(self, st: _Transfer, header: dict[str, Any]) -> None:
        with contextlib.suppress(ConnectionError):
            await send(st.control, {**header, "transfer": st.id, "node": st.node})

    # --- receiving -----------------------------------------------------------------------
    async def _data(self, reader: asyncio.StreamReader, header: dict[str, Any] | None) -> None:
        while header is not None:
            if header["type"] != "block":
                raise ProtocolError(f"unexpected {header['type']!r} on a data connection")
            st = self.transfers.get(str(header["transfer"]))
            if st is None:  # the transfer ended here: drop the block, unbuffered
                await skip_payload(reader, header)
            else:
                payload = await read_payload(reader, header, _block_bound(st, header))
                task = asyncio.create_task(self._accept(st, int(header["block"]), str(header.get("sender")), payload,
                                                        header.get("link_done_at")))
                st.tasks.add(task)
                task.add_done_callback(st.tasks.discard)
            header = await read_header(reader)

    async def _accept(self, st: _Transfer, k: int, sender: str, payload: bytes, link_done_at: float | None) -> None:
        if k in st.blocks or k in st.verifying:
            return  # a duplicate (plans overlapped around a re-plan)
        st.verifying.add(k)
        try:
            await asyncio.to_thread(verify, st.manifest, k, payload)
        except CorruptBlock as exc:
            await self._event(st, {"type": "corrupt", "block": k, "sender": sender, "reason": str(exc)})
            return
        finally:
            st.verifying.discard(k)
        st.blocks[k] = payload
        now = asyncio.get_running_loop().time()
        st.arrived[k] = now if link_done_at is None else min(now, float(link_done_at))
        st.wake.set()
        if self.on_block is not None and st.output:
            self.on_block(st.output, st.manifest, k, payload)
        await self._event(st, {"type": "have", "block": k, "sender": sender, "at": st.arrived[k] - st.go_at})
        if len(st.blocks) == st.manifest.count and not st.complete:
            st.complete = True
            await self._event(st, {"type": "complete"})
            if st.output:
                try:
                    path = await asyncio.to_thread(write_atomic, st.output, st.manifest, st.blocks)
                except OSError as exc:
                    await self._event(st, {"type": "error", "reason": f"writing {st.output}: {exc}"})
                else:
                    await self._event(st, {"type": "saved", "path": str(path)})
                    if self.on_saved is not None:
                        self.on_saved(str(path))

    # --- sending -------------------------------------------------------------------------
    def _next_send(self, st: _Transfer) -> int | None:
        """Index of the next send to make: the first pending one, or, when its block is not
        here yet, the first of the next `lookahead` pending sends whose block is."""
        while st.pos < len(st.sends) and (st.sends[st.pos] is None or st.sends[st.pos][1] in st.dead):
            st.pos += 1
        seen = 0
        for i in range(st.pos, len(st.sends)):
            item = st.sends[i]
            if item is None or item[1] in st.dead:
                continue
            if item[0] in st.blocks:
                return i
            seen += 1
            if seen > st.lookahead:
                break
        return None

    async def _send_loop(self, st: _Transfer) -> None:
        while True:
            st.wake.clear()
            i = self._next_send(st)
            if i is None:
                await st.wake.wait()  # a block arrives, or a re-plan gives more work
                continue
            block, peer = st.sends[i]
            epoch = st.epoch
            try:
                await self._send_block(st, peer, block)
            except (OSError, asyncio.IncompleteReadError) as exc:
                st.dead.add(peer)
                bad = st.conns.pop(peer, None)
                if bad is not None:
                    bad.close()
                await self._event(st, {"type": "peer_failed", "peer": peer, "block": block, "reason": repr(exc)})
            if st.epoch == epoch:
                st.sends[i] = None

    async def _send_block(self, st: _Transfer, peer: str, block: int) -> None:
        w = st.conns.get(peer)
        header: dict[str, Any] = {"type": "block", "transfer": st.id, "block": block, "sender": st.node}
        if w is None or w.is_closing():
            host, port = st.peers[peer]
            _, w = await asyncio.open_connection(host, port, limit=STREAM_LIMIT)
            w.transport.set_write_buffer_limits(high=CHUNK)
            st.conns[peer] = w
            if self.token is not None:
                header["token"] = self.token  # the first frame of a data connection
        data = st.blocks[block]
        if block in st.corrupt_once:
            st.corrupt_once.discard(block)
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        header["nbytes"] = len(data)
        view = memoryview(data)
        if self.pacer.rate is None:
            w.write(frame(header))
            for off in range(0, len(data), CHUNK):  # chunks keep the transport's buffer small
                w.write(view[off:off + CHUNK])
                await w.drain()
            return
        start = self.pacer.reserve(len(data), max(st.go_at, st.arrived.get(block, st.go_at)))
        header["link_done_at"] = start + len(data) / self.pacer.rate
        w.write(frame(header))
        for off in range(0, len(data), CHUNK):
            chunk = view[off:off + CHUNK]
            await self.pacer.until(start + (off + len(chunk)) / self.pacer.rate)
            w.write(chunk)
            await w.drain()


async def _serve(host: str, port: int, link_bytes_per_s: float | None, token: str | None) -> None:
    agent = WeightAgent(host, port, link_bytes_per_s, token=token)
    await agent.start()
    print(f"READY {host} {agent.port}", flush=True)
    await agent.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mesh.weights.peer", description=__doc__.split("\n\n")[0],
                                epilog=f"The token comes from the environment variable {TOKEN_ENV} (unset: none).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed on the READY line)")
    p.add_argument("--link-mbps", type=float, default=None, help="pace this node's uplink to this many Mbit/s")
    a = p.parse_args(argv)
    os.umask(0o077)  # the files it writes are this user's only
    if a.link_mbps is not None and not a.link_mbps > 0:
        p.error("--link-mbps must be > 0")
    rate = a.link_mbps * 1e6 / 8 if a.link_mbps else None
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(a.host, a.port, rate, token_from_env()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
