"""The control side of a multicast: runs a plan (mesh.policy.multicast) across node agents.

`multicast(...)` opens one control connection per participating agent, sends `start`,
waits for every `ready`, sends `go`, and then follows the agents' events. It knows what
every node holds from the `have` events, so when a node fails (its control connection
closes, or a sender reports `peer_failed`) or a block arrives corrupt, it drops the failed
node and re-plans the rest with `repair` from what the live nodes hold at that moment:
the failed node's downstream receivers get their blocks from someone else. The re-plan goes
to every live agent as `replan` with a new epoch. A corrupt block is retried this way a few
times, then the multicast fails with an error naming the block.

Times are the event loop's (loop.time()), relative to `go`.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from mesh.policy.multicast import InvalidPlan, Plan, repair, validate
from mesh.tasks import cancel_all
from mesh.weights.blocks import Manifest
from mesh.weights.frames import STREAM_LIMIT, ProtocolError, read_message, send

MAX_CORRUPT_RETRIES = 3
_ids = itertools.count()


class MulticastError(RuntimeError):
    """The multicast could not complete (naming the node or block at fault)."""


@dataclass
class MulticastResult:
    transfer: str
    plan: str
    completion_s: dict[str, float]  # per live target: every block received and verified
    saved_s: dict[str, float] = field(default_factory=dict)  # per target: file written
    dropped: list[str] = field(default_factory=list)  # failed nodes, in order
    replans: int = 0
    corrupt: list[dict[str, Any]] = field(default_factory=list)  # corrupt-block events
    outputs: dict[str, str] = field(default_factory=dict)
    arrivals: list[tuple[float, str, int, str]] = field(default_factory=list)  # (s, node, block, sender)

    @property
    def total_s(self) -> float:
        return max(self.completion_s.values(), default=0.0)


Observer = Callable[[str, dict[str, Any]], None]


async def multicast(
    agents: Mapping[str, tuple[str, int]],
    manifest: Manifest,
    plan: Plan,
    source_paths: Mapping[str, str],
    output_paths: Mapping[str, str] | None = None,
    *,
    transfer_id: str | None = None,
    faults: Mapping[str, Mapping[str, Any]] | None = None,
    observer: Observer | None = None,
    lookahead: int = 0,
    timeout_s: float = 300.0,
    token: str | None = None,
) -> MulticastResult:
    """Run `plan` to deliver the model described by `manifest`.

    agents: node name -> (host, port) of its agent, for every node of the plan.
    source_paths: for each source node, the packed model file it reads into memory.
    output_paths: for targets that should write the received file (atomically).
    faults: per node, test hooks passed in `start` ({"corrupt_blocks": [k]}).
    observer: called with (node, event) for every agent event (tests kill nodes from it).
    lookahead: how many later sends a node may make first while the block of its next send
      has not arrived (0: the plan's order exactly).
    token: the agents' weights token (MESH_WEIGHTS_TOKEN), sent in each `start`; None: the
      agents run without one.
    """
    validate(plan)
    if plan.blocks != manifest.count:
        raise MulticastError(f"plan {plan.name!r} has {plan.blocks} blocks, the manifest of {manifest.model} "
                             f"{manifest.count}")
    missing = [n for n in plan.nodes if n not in agents]
    if missing:
        raise MulticastError(f"no agent address for node {missing[0]!r}")
    for src, holding in plan.holdings.items():
        if holding and src not in source_paths:
            raise MulticastError(f"source {src!r} has no model file (source_paths)")
    run = _Run(transfer_id or f"mc{next(_ids)}", dict(agents), manifest, plan, dict(output_paths or {}),
               observer)
    try:
        return await asyncio.wait_for(run.execute(dict(source_paths), dict(faults or {}), lookahead, token),
                                      timeout_s)
    except asyncio.TimeoutError:
        left = sorted(set(run.live_targets()) - set(run.result.completion_s))
        raise MulticastError(f"transfer {run.id}: timed out after {timeout_s} s; incomplete: {left}") from None
    finally:
        await run.close()


class _Run:
    def __init__(self, tid: str, agents: dict[str, tuple[str, int]], manifest: Manifest, plan: Plan,
                 outputs: dict[str, str], observer: Observer | None) -> None:
        self.id, self.agents, self.manifest, self.plan = tid, agents, manifest, plan
        self.outputs, self.observer = outputs, observer
        self.nodes = list(plan.nodes)
        self.held = {n: set(plan.holdings.get(n, ())) for n in self.nodes}
        self.dead: list[str] = []
        self.writers: dict[str, asyncio.StreamWriter] = {}
        self.readers: dict[str, asyncio.Task] = {}
        self.events: asyncio.Queue[tuple[str, dict[str, Any] | None]] = asyncio.Queue()
        self.result = MulticastResult(tid, plan.name, {})
        self.corrupt_count: dict[tuple[str, int], int] = {}
        self.epoch = 0
        self.t0 = 0.0

    def live_targets(self) -> list[str]:
        return [t for t in self.plan.targets if t not in self.dead]

    async def execute(self, source_paths: dict[str, str], faults: dict[str, Mapping[str, Any]],
                      lookahead: int, token: str | None) -> MulticastResult:
        loop = asyncio.get_running_loop()
        opened = await asyncio.gather(*(self._open(n) for n in self.nodes), return_exceptions=True)
        for outcome in opened:  # every open has ended, so close() reaches the connections that did open
            if isinstance(outcome, BaseException):
                raise outcome
        peers = {n: list(a) for n, a in self.agents.items() if n in self.nodes}
        base = {"type": "start", "transfer": self.id, "manifest": self.manifest.to_dict(),
                "plan": self.plan.to_dict(), "peers": peers, "lookahead": lookahead}
        for n in self.nodes:  # the token first, in a small frame: agents read no more before it (mesh.framing)
            await send(self.writers[n], {"type": "auth", **({"token": token} if token else {})})
        for n in self.nodes:
            await send(self.writers[n], {**base, "node": n, "source_path": source_paths.get(n),
                                         "output_path": self.outputs.get(n), "faults": dict(faults.get(n, {}))})
        ready: set[str] = set()
        while len(ready) < len(self.nodes):
            node, ev = await self.events.get()
            if ev is None:
                raise MulticastError(f"transfer {self.id}: agent {node!r} closed before it was ready")
            if ev["type"] == "error":
                raise MulticastError(f"transfer {self.id}: agent {node!r}: {ev['reason']}")
            if ev["type"] == "ready":
                ready.add(node)
        self.t0 = loop.time()
        for n in self.nodes:
            await send(self.writers[n], {"type": "go", "transfer": self.id})
        while not self._done():
            node, ev = await self.events.get()
            now = loop.time() - self.t0
            if self.observer is not None and ev is not None:
                self.observer(node, ev)
            if ev is None:  # agents close only after `end`: anything earlier is a failure
                if node not in self.dead:
                    await self._drop(node, "its agent closed the connection")
                continue
            kind = ev["type"]
            if kind == "have":
                self.held[node].add(int(ev["block"]))
                self.result.arrivals.append((now, node, int(ev["block"]), str(ev.get("sender"))))
            elif kind == "complete":
                self.result.completion_s[node] = now
            elif kind == "saved":
                self.result.saved_s[node] = now
                self.result.outputs[node] = ev["path"]
            elif kind == "peer_failed":
                if ev["peer"] not in self.dead:
                    await self._drop(ev["peer"], f"{node} could not send to it: {ev['reason']}")
            elif kind == "corrupt":
                self.result.corrupt.append({"node": node, **ev})
                key = (node, int(ev["block"]))
                self.corrupt_count[key] = self.corrupt_count.get(key, 0) + 1
                if self.corrupt_count[key] > MAX_CORRUPT_RETRIES:
                    raise MulticastError(f"transfer {self.id}: block {key[1]} reached {node!r} corrupt "
                                         f"{self.corrupt_count[key]} times: {ev['reason']}")
                await self._replan()
            elif kind == "error":
                raise MulticastError(f"transfer {self.id}: agent {node!r}: {ev['reason']}")
        for n in self.nodes:
            if n not in self.dead:
                with contextlib.suppress(ConnectionError):
                    await send(self.writers[n], {"type": "end", "transfer": self.id})
        return self.result

    def _finished(self, node: str) -> bool:
        return node not in self.plan.targets or (
            node in self.result.completion_s and (node not in self.outputs or node in self.result.saved_s))

    def _done(self) -> bool:
        return all(self._finished(t) for t in self.live_targets())

    async def _drop(self, node: str, why: str) -> None:
        self.dead.append(node)
        self.result.dropped.append(node)
        w = self.writers.get(node)
        if w is not None:
            w.close()
        if node in self.plan.targets:
            self.result.completion_s.pop(node, None)
        await self._replan()

    async def _replan(self) -> None:
        live = [n for n in self.nodes if n not in self.dead]
        todo = [t for t in self.live_targets() if len(self.held[t]) < self.plan.blocks]
        try:
            plan = repair({n: self.held[n] for n in live}, todo, self.plan.blocks, name=f"{self.plan.name}+repair")
        except InvalidPlan as exc:
            raise MulticastError(f"transfer {self.id}: cannot complete after losing {self.dead}: {exc}") from exc
        self.epoch += 1
        self.result.replans += 1
        msg = {"type": "replan", "transfer": self.id, "epoch": self.epoch, "plan": plan.to_dict(), "dead": self.dead}
        for n in live:
            with contextlib.suppress(ConnectionError):
                await send(self.writers[n], msg)

    async def _open(self, node: str) -> None:
        host, port = self.agents[node]
        try:
            reader, writer = await asyncio.open_connection(host, port, limit=STREAM_LIMIT)
        except OSError as exc:
            raise MulticastError(f"cannot reach the agent of {node!r} at {host}:{port}: {exc}") from exc
        self.writers[node] = writer
        self.readers[node] = asyncio.create_task(self._read(node, reader))

    async def _read(self, node: str, reader: asyncio.StreamReader) -> None:
        try:
            while (msg := await read_message(reader)) is not None:
                await self.events.put((node, msg[0]))
        except (ConnectionError, asyncio.IncompleteReadError, ProtocolError):
            pass
        await self.events.put((node, None))

    async def close(self) -> None:
        for w in self.writers.values():
            w.close()
        await cancel_all(self.readers.values())
