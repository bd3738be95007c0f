"""A live pair: a loading instance and a full instance of one model serving together while
the loading one's weights arrive (BlitzScale 5.2), on two agents' layer hosts.

The full instance (the source, BlitzScale's overloaded inst.0) holds the whole model; the
loading one (the target, inst.1) receives it block by block by multicast and runs the
layers it holds. From the scale-out on, new streams go to the pair (the protocol's step 1:
requests are redirected to the new instance), and the two sides follow ZigZag, ILP-free
(Fig. 16), by mesh.policy.live_scaling's rules:

- the target forwards the front stream of its queue through the layers it holds
  (`target_next`; its priority is `zigzag_order`), keeping the activations on its agent;
- the source serves first come first served: its own streams' step, or, when the pair's
  earliest stream came first, pulls it with its activation (`source_pull`) straight from the
  target's agent and runs the rest; a stream the target can start is left to it
  (`left_to_target`).

A stream's split (T layers on the target, S = L - T on the source) is set where its prefill
was pulled and kept for its decode steps, so each layer's KV cache lives on one agent; a
stream pulled before any layer ran on the target is the source's own. Once the target holds
the whole model, the mode switch (λScale 4.4): the pair's streams are spread evenly over the
two (`switch_assignment`), each recomputing its KV cache from prompt and tokens so far (a
prefill whose output is the stream's next token), and both serve as full instances.

`live=False` is stop-the-world: the source serves everything until the target's last block
is in, then the target serves as a full instance too.

This side only decides and sends; the agents compute (mesh.node.layer_host). Time comes from
the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

from mesh.engines.engine_api import NextTokens, TokenBatch
from mesh.framing import ProtocolError
from mesh.policy.live_scaling import (
    ZigZagRequest,
    ZigZagState,
    left_to_target,
    source_pull,
    switch_assignment,
    target_next,
)
from mesh.wire.layers import LayerCallFailed, LayerConnection, ModelState, Peer, Release, Run, RunResult, Status

log = logging.getLogger(__name__)

SOURCE, TARGET = "source", "target"
POLL_S = 0.02  # how often an idle side looks again (layers arrive, streams come)


@dataclass(eq=False)
class Stream:
    """One request: its prompt, the tokens so far, where it runs, and when its tokens came."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrived_s: float
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    home: str = SOURCE  # SOURCE or TARGET: a full instance's own stream; "pair": split across both
    split: int | None = None  # T: layers [0, T) on the target, for a pair stream past its prefill
    at_layer: int = 0  # the target's progress on the stream's current step (activations kept there)
    in_kv: int = 0  # tokens the stream's KV holds (its next position)
    was_split: bool = False  # some step of it ran on both sides (activations crossed)
    error: str | None = None  # why it ended without its tokens (an agent refused or was lost)
    busy: bool = False  # a side is running it now
    ready_s: float = 0.0  # when its current step became ready (FCFS)

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.tokens) >= self.max_tokens

    def step_tokens(self) -> tuple[int, tuple[int, ...]]:
        """(position, token ids) of its next step: with no KV cache, a prefill of the prompt
        and the tokens so far (a recompute after a move, λScale 4.4); else its last token."""
        if self.in_kv == 0:
            return 0, self.prompt + tuple(self.tokens)
        return self.in_kv, (self.tokens[-1],)


@dataclass
class PairCounters:
    pulls: int = 0
    target_runs: int = 0
    layer_passes_target: int = 0
    switched_s: float | None = None
    recomputed: int = 0
    failed: int = 0


class LivePair:
    def __init__(self, model: str, layers: int, source: Peer, target: Peer, *, live: bool = True,
                 on_token: Callable[[Stream, int], None] | None = None) -> None:
        """`layers`: the model's decoder layers; `source`, `target`: the two agents' layer ports."""
        self.model, self.layers, self.live = model, layers, live
        self.peers = {SOURCE: source, TARGET: target}
        self.chunk = max(1, layers // 8)  # layers a target run advances a prefill
        self.conns: dict[str, LayerConnection] = {}
        self.streams: list[Stream] = []
        self.counters = PairCounters()
        self.on_token = on_token
        self.target_ready = 0  # layers the target holds (its usable prefix)
        self.target_full = False
        self.scaling = False  # the scale-out has begun: new streams go to the pair
        self.switching = False  # the mode switch waits for the runs in flight
        self._wake = asyncio.Event()
        self._workers: list[asyncio.Task] = []
        self._arrivals = 0

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        for side, peer in self.peers.items():
            self.conns[side] = await LayerConnection.open(peer)
        self._workers = [asyncio.create_task(self._serve(SOURCE)), asyncio.create_task(self._serve(TARGET)),
                         asyncio.create_task(self._watch_target())]

    async def close(self) -> None:
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        for conn in self.conns.values():
            await conn.close()

    def begin_scale_out(self) -> None:
        """The target's multicast has begun: new streams go to the pair from now on."""
        self.scaling = True
        self._wake.set()

    def submit(self, stream: Stream) -> None:
        now = asyncio.get_running_loop().time()
        stream.ready_s = now
        if self.target_full:
            stream.home = min((SOURCE, TARGET), key=lambda s: sum(1 for x in self.live_streams() if x.home == s))
        elif self.scaling and self.live:
            stream.home = "pair"
        else:
            stream.home = SOURCE
        self.streams.append(stream)
        self._wake.set()

    def live_streams(self) -> list[Stream]:
        return [s for s in self.streams if not s.done]

    # --- the target's layers -------------------------------------------------------------------
    async def _watch_target(self) -> None:
        while not self.target_full:
            state = ModelState.from_fields((await self.conns[TARGET].call(Status(self.model).to_header(0)))[0])
            if state.ready != self.target_ready:
                self.target_ready = state.ready
                self._wake.set()
            if state.ready >= self.layers and state.head:
                await self._switch()
                return
            await asyncio.sleep(POLL_S)

    async def _switch(self) -> None:
        """λScale 4.4: the pair's streams spread over both, each recomputing its KV cache."""
        self.switching = True
        while any(s.busy for s in self.streams):
            await asyncio.sleep(POLL_S / 4)
        pair = [s for s in self.live_streams() if s.home == "pair"]
        plan = switch_assignment([(s.request_id, TARGET if s.split else SOURCE) for s in pair], [SOURCE, TARGET])
        by_id = {s.request_id: s for s in pair}
        for side, ids in plan.items():
            for rid in ids:
                s = by_id[rid]
                await self._release(s)
                s.home, s.split, s.at_layer, s.in_kv = side, None, 0, 0  # its next step recomputes
                self.counters.recomputed += 1
        self.target_full, self.switching = True, False
        self.counters.switched_s = asyncio.get_running_loop().time()
        self._wake.set()

    async def _release(self, s: Stream) -> None:
        for side in (SOURCE, TARGET):
            await self.conns[side].call(Release(self.model, (s.request_id,)).to_header(0))

    # --- the two sides -------------------------------------------------------------------------
    async def _serve(self, side: str) -> None:
        while True:
            work = self._next_work(side)
            if work is None:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), POLL_S)
                except asyncio.TimeoutError:
                    pass
                continue
            run, streams = work
            for s in streams:
                s.busy = True
            try:
                reply, payload = await self.conns[side].call(*run.to_header(0))
                self._finish(side, run, streams, RunResult.from_fields(reply, payload))
            except (LayerCallFailed, ProtocolError, ConnectionError, OSError) as exc:
                log.warning("%s refused %s: %s", side, [s.request_id for s in streams], exc)
                for s in streams:  # they end with the reason, never silently
                    s.error = f"the {side} agent could not run layers [{run.start}, {run.stop}): {exc}"
                    self.counters.failed += 1
            finally:
                for s in streams:
                    s.busy = False
                self._wake.set()

    def _next_work(self, side: str) -> tuple[Run, list[Stream]] | None:
        """What `side` runs next, first come first served: its own streams' step (their
        prefills first) or its ZigZag part, whichever became ready first. The source pulls
        when its own streams are not the earlier work (BlitzScale Fig. 16, line 5: it pulls
        when it has no pending work of its own)."""
        if self.switching:
            return None
        free = [s for s in self.live_streams() if not s.busy]
        own = [s for s in free if s.home == side] if side == SOURCE or self.target_full else []
        own = [s for s in own if s.in_kv == 0] or own
        zig = self._zigzag(side, [s for s in free if s.home == "pair"])
        if own and (zig is None or min(s.ready_s for s in own) <= min(s.ready_s for s in zig[1])):
            return self._whole(own), own
        return zig

    def _whole(self, streams: list[Stream]) -> Run:
        positions, ids = zip(*(s.step_tokens() for s in streams))
        return Run(self.model, 0, self.layers, TokenBatch(tuple(s.request_id for s in streams), positions, ids))

    def _zigzag(self, side: str, pair: list[Stream]) -> tuple[Run, list[Stream]] | None:
        """The ZigZag part of `side` (BlitzScale 5.2, Fig. 16) over the pair's free streams.
        A stream in decode may be pulled only once the target ran its split (its KV there).
        The target batches its front stream with the others at the same point, at most half
        the pair's streams, so the source has a batch to finish while the target runs the
        next one (the overlap of Fig. 15b)."""
        if not pair:
            return None
        order = {s.request_id: i for i, s in enumerate(sorted(pair, key=lambda s: s.ready_s))}
        by_id = {s.request_id: s for s in pair}
        if side == TARGET:
            loaded = min(self.target_ready, self.layers - 1)  # the source runs at least the last layer
            queue = tuple(ZigZagRequest(s.request_id, order[s.request_id], s.at_layer) for s in pair
                          if s.at_layer < (loaded if s.split is None else s.split))
            pick = target_next(ZigZagState(self.layers, loaded, queue))
            if pick is None:
                return None
            front = by_id[pick.request_id]
            # a prefill goes one chunk of layers a run, so an idle source can pull it between
            # runs (Fig. 16 forwards one layer at a time; a chunk keeps the calls few)
            stop = min(loaded, front.at_layer + self.chunk) if front.split is None else front.split
            group = [s for s in sorted(pair, key=lambda s: s.ready_s) if s.at_layer == front.at_layer
                     and s.split == front.split]
            group = [front] + [s for s in group if s is not front][:max(0, (len(pair) + 1) // 2 - 1)]
            ids = tuple(s.request_id for s in group)
            if front.at_layer == 0:
                positions, tokens = zip(*(s.step_tokens() for s in group))
                return Run(self.model, 0, stop, TokenBatch(ids, positions, tokens), keep=True), group
            # back to a stream once more layers are in: from what the target kept (Fig. 15b)
            return Run(self.model, front.at_layer, stop, None, None, ids, keep=True), group
        ready = [s for s in pair if s.split is None or s.at_layer == s.split]
        queue = tuple(r for r in (ZigZagRequest(s.request_id, order[s.request_id], s.at_layer) for s in ready)
                      if not left_to_target(r, self.target_ready))
        queue_streams = [s for s in ready if s.request_id in {r.request_id for r in queue}]
        pull = source_pull(ZigZagState(self.layers, self.target_ready, queue, None, source_idle=True))
        if pull is None:
            return None
        front = by_id[pull.request_id]
        group = [s for s in queue_streams if s.at_layer == front.at_layer]
        if front.at_layer == 0:  # nothing ran on the target: the source runs it whole, as its own
            for s in group:
                s.home = SOURCE
            return self._whole(group), group
        ids = tuple(s.request_id for s in group)
        return Run(self.model, front.at_layer, self.layers, None, self.peers[TARGET], ids), group

    def _finish(self, side: str, run: Run, streams: list[Stream], result: RunResult) -> None:
        now = asyncio.get_running_loop().time()
        if side == TARGET and run.keep:
            self.counters.target_runs += 1
            self.counters.layer_passes_target += run.stop - run.start
            for s in streams:
                s.at_layer = run.stop
            return
        if run.pull is not None:
            self.counters.pulls += 1
        assert isinstance(result.output, NextTokens)
        got = dict(zip(result.output.request_ids, result.output.token_ids))
        for s in streams:
            position, ids = s.step_tokens()
            s.in_kv = position + len(ids)
            if s.home == "pair" and s.split is None:
                s.split = run.start  # its prefill was pulled here: its split for life
            s.was_split = s.was_split or run.start > 0
            s.at_layer = 0
            s.tokens.append(got[s.request_id])
            s.token_times.append(now)
            s.ready_s = now
            if self.on_token is not None:
                self.on_token(s, got[s.request_id])
            if s.done:
                asyncio.get_running_loop().create_task(self._release_quietly(s))

    async def _release_quietly(self, s: Stream) -> None:
        try:
            await self._release(s)
        except (ConnectionError, OSError) as exc:
            log.warning("releasing %s: %s", s.request_id, exc)
