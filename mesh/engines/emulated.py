"""An emulated engine: the simulated engine on the wall clock, with tokens to stream.

Emulated nodes (`mesh serve --emulate DEVICE:N,...`, mesh.engines.emulation) are real node
agents whose instances compute nothing: each iteration sleeps what the model's profile says
on the node's device (mesh.engines.simulated.SimulatedEngine, the replay's engine, noise
included), so the control plane, the dispatcher and the node's own scheduling run for real
at the scale of the paper's testbed on a small machine (what llm-d's vLLM simulator is for).

What a real engine adds, and how it is made up here:
- Tokenization needs no tokenizer: one token per UTF-8 byte of the prompt (ids 0-255; a
  chat is "role: content\\n" per message). It over-counts a BPE tokenizer about 4x on
  English text; load tests send token ids (OpenAI's `prompt` as a list of ints), which
  are taken as they are.
- Generated ids are a function of the request and the token's position (`GENERATED_BASE`
  upwards), each detokenized to a short word, so a stream is the same every run.
- An emulated model never stops on its own: a request produces `max_tokens` tokens, fewer
  only where the context window ends (`output_len` of a replay's request wins).
- The wall clock is not virtual time: a sleep ends late by the event loop's lag, and the
  node's own work between two iterations (scheduling, streaming) takes time that a replay's
  does not. A node's emulated engines share a `WallPace` that makes that up: back-to-back
  iterations end when the profile says, counted from the first one's start, so the node
  keeps the profile's pace (and its agent does not learn the host's lag into its times).
- Layer ranges (BlitzScale 5.2, lambdaScale 4.3): an emulated engine can be given a
  contiguous range [start, stop) of the model's layers (`set_layer_range`); an iteration
  then takes the profile's time times the range's fraction of the layers
  (mesh.policy.live_scaling.layer_range_s), and the hidden states it would hand on (a range
  that stops before the last layer) or take in (one that starts after the first) are
  counted in `activation_bytes` (hidden size x tokens x 2 bytes a hop).
- Live scaling (mesh.control.load_timing, the twin's rules): an engine given its
  `layer_steps` (seconds after its load starts, layers usable from then) is loaded once its
  first layer is in and serves with the layers it holds, as the target of ZigZag: until
  its last layer, an iteration runs the layers it holds and offers the rest to its partner
  (`ask_partner`, mesh.node.lending: the partner's node lends its time), else runs each
  layer once it is in (mesh.policy.live_scaling.solo_finish, what shadow validation
  predicts from `layer_arrivals`); once whole, it recomputes the KV cache of the requests
  whose layers the partner ran. Requests of an iteration that took longer than its
  full-speed time are in `waited_for_layers`.
"""
from __future__ import annotations

import asyncio
import math
import zlib
from typing import Any, Awaitable, Callable, Mapping, Sequence

from mesh.engines.engine_api import EngineError, EngineRequest, FinishReason, LayerRange, StepResult
from mesh.engines.simulated import SimulatedEngine
from mesh.policy.live_scaling import (
    LayerArrivals,
    ZigZagRequest,
    ZigZagState,
    activation_bytes,
    activation_s,
    layer_range_s,
    recompute_s,
    recompute_tokens,
    solo_finish,
    target_next,
)

GENERATED_BASE = 256  # generated ids start above the byte ids of prompts
WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "mesh", "token", "emulated", "node", "model", "cloud", "serve",
         "fast", "slow", "batch", "queue")


def byte_ids(text: str) -> list[int]:
    """The emulated tokenization: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def chat_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """A chat as one text, "role: content" a line, then the assistant's turn."""
    lines = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: their texts
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        lines.append(f"{m.get('role', 'user')}: {content or ''}")
    return "\n".join(lines) + "\nassistant:"


def generated_id(request_id: str, position: int) -> int:
    """The id of a request's `position`-th generated token (deterministic)."""
    return GENERATED_BASE + (zlib.crc32(f"{request_id}:{position}".encode()) % len(WORDS))


def token_text(token_id: int) -> str:
    """A token's text: a generated id's word with a leading space; a byte id its character."""
    if token_id >= GENERATED_BASE:
        return " " + WORDS[(token_id - GENERATED_BASE) % len(WORDS)]
    return chr(token_id) if 32 <= token_id < 127 else " "


class WallPace:
    """One node's emulated iterations at the profile's pace on the wall clock: an iteration
    that starts within `catch_up_s` of the end the previous one was due (back to back, the
    node's lag and own work between them) ends `seconds` after that due end, not after its
    own late start; one that starts later (the node was idle) runs its full time from now."""

    def __init__(self, catch_up_s: float = 0.05) -> None:
        self.catch_up_s = catch_up_s
        self.due: float | None = None  # when the last iteration was due to end
        self.lent_until = -math.inf  # the node's time lent to a live partner (`reserve`) ends then

    async def sleep(self, seconds: float) -> None:
        """One iteration; one that would start while the node's time is lent starts after it."""
        now = asyncio.get_running_loop().time()
        start = max(now, self.lent_until)
        late = start - self.due if self.due is not None else math.inf
        self.due = (self.due if 0.0 <= late <= self.catch_up_s else start) + seconds
        await asyncio.sleep(max(0.0, self.due - now))

    def free_at(self, now: float) -> float:
        """When the node's iteration in flight and its lent time end: now if neither."""
        return max(now, self.lent_until, self.due if self.due is not None else now)

    def reserve(self, until: float) -> None:
        """The node's time up to `until` is lent (a ZigZag partner runs another instance's
        layers, mesh.node.lending): its next iteration starts after it."""
        self.lent_until = max(self.lent_until, until)


class EmulatedEngine(SimulatedEngine):
    """A SimulatedEngine whose iterations also give each request a token id and its text."""

    loaded_from = "emulated"  # what the agent reports as the load's source
    runs_layer_ranges = True

    def __init__(self, *args: Any, pace: WallPace | None = None, num_layers: int = 32, hidden_size: int = 4096,
                 layer_steps: Sequence[tuple[float, int]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pace = pace  # the node's (shared by its engines); None: each iteration sleeps its time
        self._position: dict[str, int] = {}  # request -> tokens generated so far
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.layer_range = LayerRange.whole(num_layers)
        self.activation_bytes = 0  # hidden states handed on or taken in, all iterations
        self._tokens = 0  # the tokens of the iteration about to run
        self._batch: list[str] = []  # the requests of the iteration about to run
        self.layer_steps = tuple(layer_steps) if layer_steps else None  # live: layers over the load
        if self.layer_steps is not None and self.layer_steps[-1][1] != num_layers:
            raise EngineError(f"the load's layer steps end on {self.layer_steps[-1][1]} layers, the model has "
                              f"{num_layers}")
        self.layer_arrivals: LayerArrivals | None = None  # live: usable layers on the loop's clock, once loading
        self.waited_for_layers: set[str] = set()  # requests of iterations that waited for layers
        # live, as the target of ZigZag (mesh.node.lending.PartnerLink): asks the partner to run
        # layers [k, L) of an iteration (k, L, work s, activation hop s, alone s) and returns
        # when that ends (seconds from now), or None
        self.ask_partner: Callable[[int, int, float, float, float], Awaitable[float | None]] | None = None
        self.link_bytes_per_s = 25e9  # the activation's link to the partner
        self._pulled: set[str] = set()  # requests whose layers the partner ran (their KV is there)
        self.recompute_tokens = 0  # KV recomputed once whole

    async def load(self) -> None:
        """Loaded after `load_s`; live (`layer_steps`), once the first layer is in."""
        if self.layer_steps is None:
            return await super().load()
        start = asyncio.get_running_loop().time()
        self.layer_arrivals = LayerArrivals(self.num_layers, tuple((start + s, n) for s, n in self.layer_steps))
        await asyncio.sleep(self.layer_steps[0][0])

    def set_layer_range(self, start: int, stop: int) -> None:
        """Run layers [start, stop) from the next iteration on."""
        self.layer_range = LayerRange(start, stop, self.num_layers)  # EngineError when it is not inside

    def layers_ready(self) -> int:
        """Layers of its range it can run (all: an emulated engine loads whole)."""
        return self.layer_range.count

    def range_s(self, seconds: float) -> float:
        """An iteration of the whole model's `seconds`, over the engine's layer range."""
        return layer_range_s(seconds, self.layer_range.start, self.layer_range.stop, self.num_layers)

    async def _prefill(self, take: int, switched: bool) -> StepResult:
        self._batch = list(self._pending)[:take]
        self._tokens = sum(self._pending[r][0] for r in self._batch)
        return await super()._prefill(take, switched)

    async def _decode(self, switched: bool) -> StepResult:
        self._batch = list(self._running)
        self._tokens = len(self._running)
        return await super()._decode(switched)

    async def _pause(self, seconds: float) -> None:
        start, stop = self.layer_range.start, self.layer_range.stop
        hops = (start > 0) + (stop < self.num_layers)
        self.activation_bytes += hops * activation_bytes(self.hidden_size, self._tokens)
        seconds = self.range_s(seconds)
        arrivals = self.layer_arrivals
        if arrivals is not None and asyncio.get_running_loop().time() < arrivals.full_s:
            return await self._live(seconds, arrivals)
        if self.ask_partner is not None:  # a full instance now: the partner link is done with
            await self._drop_partner()
        if self._pulled:  # the switch (lambdaScale 4.4): the KV of the layers the partner ran is not here
            seconds += self._recompute_s()
        if self.pace is None:
            await super()._pause(seconds)
        else:
            await self.pace.sleep(seconds)

    async def _live(self, work_s: float, arrivals: LayerArrivals) -> None:
        """One iteration before its last layer, as the target of ZigZag (BlitzScale 5.2, Fig.
        16, the twin's WeightsEngine._zigzag on the wall clock): it runs the layers it holds
        (`target_next`) and, whenever it would wait for one, and at its start, offers the
        rest to its partner (`ask_partner`: the partner's agent decides by `source_pull` and
        `lend_helps`); without one, it runs each layer once it is in (`solo_finish`)."""
        loop = asyncio.get_running_loop()
        if self.pace is not None and self.pace.lent_until > loop.time():  # the node's lent time first
            await asyncio.sleep(self.pace.lent_until - loop.time())
        start = loop.time()
        layers, done = arrivals.layers, 0
        hop = activation_s(self.hidden_size, max(1, self._tokens), self.link_bytes_per_s)
        while done < layers:
            t = loop.time()
            if self.ask_partner is not None:
                alone_s = solo_finish(t, work_s, arrivals, done) - t
                after = await self.ask_partner(done, layers, work_s, hop, alone_s)
                if after is not None:
                    self._pulled.update(self._batch)
                    if done:
                        self.activation_bytes += activation_bytes(self.hidden_size, max(1, self._tokens))
                    await asyncio.sleep(max(0.0, t + after - loop.time()))
                    break
            t = loop.time()
            held = arrivals.held_at(t)
            state = ZigZagState(layers, held, (ZigZagRequest("iteration", 0, done),))
            if target_next(state) is not None:  # the layers it holds, one after the other
                await asyncio.sleep(work_s * (held - done) / layers)
                done = held
            else:
                await asyncio.sleep(max(0.0, arrivals.layer_at(done) - t))
        if loop.time() > start + work_s + hop + 1e-3:
            self.waited_for_layers.update(self._batch)
        if self.pace is not None:
            self.pace.due = loop.time()

    def _recompute_s(self) -> float:
        """The KV recomputation, once whole, of its running requests whose iterations its
        partner finished (prompt + tokens so far, as prefills; the twin's WeightsEngine._switch)."""
        tokens = [recompute_tokens(entry[0], self._rounds - entry[2] + 1)
                  for rid, entry in self._running.items() if rid in self._pulled]
        self._pulled.clear()
        self.recompute_tokens += sum(tokens)
        return recompute_s(self.times.prefill_s, tokens, self.prefill_token_budget)

    async def _drop_partner(self) -> None:
        link, self.ask_partner = self.ask_partner, None
        close = getattr(link, "close", None)
        if close is not None:
            await close()

    async def unload(self) -> None:
        await self._drop_partner()
        await super().unload()

    def zigzag_idle(self) -> bool:
        """No request of its own waits for prefill (BlitzScale Fig. 16, line 5): a partner may pull."""
        return not self._pending

    def encode_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            raise EngineError("the prompt must be a string or a list of token ids")
        return byte_ids(prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return byte_ids(chat_text(messages))

    def add_request(self, request: EngineRequest) -> None:
        super().add_request(request)
        if request.output_len is None:  # no end of its own: it ran to max_tokens or the window
            prompt, target, _reason = self._pending[request.request_id]
            self._pending[request.request_id] = (prompt, target, FinishReason.LENGTH)
        self._position[request.request_id] = 0

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._position.pop(request_id, None)
        self.waited_for_layers.discard(request_id)

    async def step(self) -> StepResult:
        result = await super().step()
        ids = []
        for rid in result.request_ids:
            position = self._position.get(rid, 0)
            ids.append(generated_id(rid, position))
            self._position[rid] = position + 1
        for rid in result.finished:
            self._position.pop(rid, None)
        return StepResult(result.kind, result.request_ids, ids, [token_text(t) for t in ids], result.finished)
