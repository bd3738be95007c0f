"""A simulated engine: iteration times from a performance model, optional seeded noise.

It follows the batching rule of mesh.engines.engine_api exactly, and produces `output_len` tokens
per request (from a trace), capped by max_tokens and the context window. Memory operations
take modeled time: a load `load_s`; a KV resize proportional to the bytes it changes
(mesh.perf.load_times.kv_resize_s: LLM-Mesh Figure 8 on an A100, 32 -> 64 GB in 1.9 s, 32 -> 16 GB in 0.3 s).
An iteration takes its grid time plus the profile's overheads for what ran before it
(mesh.policy.batching.extra_s: a prefill of a new token count, a decode right after a
prefill, a changed decode batch, and,
with a `core` shared by the engines of one node, an iteration after another engine's).
"""
from __future__ import annotations

import asyncio
import itertools
import random
from collections import defaultdict

from mesh.engines.engine_api import EngineError, EngineRequest, FinishReason, StepResult
from mesh.perf.load_times import kv_resize_s
from mesh.policy.batching import IterationKind, IterationTimes, extra_s, prefill_take

# Relative std-dev of a simulated iteration's time: `mesh replay --noise`'s default and what
# emulated nodes (mesh.engines.emulation) run with.
SIMULATED_NOISE = 0.05



class SharedCore:
    """The compute one node's simulated engines share: which engine stepped last."""

    def __init__(self) -> None:
        self.last: object | None = None


class SimulatedEngine:
    runs_layer_ranges = False  # a whole instance's iteration times (engine_api, layer ranges)

    def __init__(
        self,
        model_name: str,
        times: IterationTimes,
        *,
        kv_bytes_per_token: int,
        weight_bytes: int,
        context_window: int,
        prefill_token_budget: int | None = None,
        max_batch: int = 256,
        load_s: float = 0.0,
        noise: float = 0.0,
        seed: int = 0,
        core: SharedCore | None = None,
    ) -> None:
        self.model_name = model_name
        self.times = times
        self.kv_bytes_per_token = kv_bytes_per_token
        self.weight_bytes = weight_bytes
        self.context_window = context_window
        self.prefill_token_budget = prefill_token_budget or context_window
        self.max_batch = max_batch
        self.load_s = load_s
        self.noise = noise  # relative std-dev of a lognormal factor on every iteration
        self._rng = random.Random(seed)
        self._kv_capacity = 0
        self._pending: dict[str, tuple[int, int, FinishReason]] = {}  # id -> (prompt, target, reason)
        self._running: dict[str, tuple[int, int, int, FinishReason]] = {}  # id -> (prompt, target, first round, reason)
        self._finish_at: dict[int, list[str]] = defaultdict(list)  # decode round -> ids
        self._rounds = 0
        self._context = 0  # tokens held by running requests
        self.iterations = 0
        self.core = core
        self._last: tuple[IterationKind, int] | None = None  # previous iteration (kind, batch)
        self._shapes: set[int] = set()  # prompt-token totals prefilled so far
        self.loaded_from: str | None = None  # the cold start's tier, where a node says (mesh.replay.local_node)

    @property
    def kv_capacity_bytes(self) -> int:
        """The KV cache it holds now (what a parked instance keeps, beside its weights)."""
        return self._kv_capacity

    # -- memory operations ---------------------------------------------------------
    async def load(self) -> None:
        await asyncio.sleep(self.load_s)

    async def unload(self) -> None:
        self._kv_capacity = 0

    async def resize_kv(self, capacity_bytes: int) -> None:
        resize_s = kv_resize_s(self._kv_capacity, capacity_bytes)
        self._kv_capacity = capacity_bytes
        await asyncio.sleep(resize_s)

    # -- requests ------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        if request.prompt_len < 1 or request.prompt_len + 1 > self.context_window:
            raise EngineError(
                f"request {request.request_id}: prompt of {request.prompt_len} tokens does not fit "
                f"the context window of {self.context_window}; shorten the prompt"
            )
        cap = min(request.sampling.max_tokens, self.context_window - request.prompt_len)
        wanted = request.output_len if request.output_len is not None else cap
        target = max(1, min(wanted, cap))
        reason = FinishReason.STOP if wanted <= cap else FinishReason.LENGTH
        self._pending[request.request_id] = (request.prompt_len, target, reason)

    def abort(self, request_id: str) -> None:
        if self._pending.pop(request_id, None) is None:
            entry = self._running.pop(request_id, None)
            if entry is not None:
                self._context -= entry[0] + self._rounds - entry[2] + 1

    def has_work(self) -> bool:
        return bool(self._pending or self._running)

    def kv_bytes_in_use(self) -> int:
        return self._context * self.kv_bytes_per_token

    async def _pause(self, seconds: float) -> None:
        """An iteration's time passes (virtual time in a replay)."""
        await asyncio.sleep(seconds)

    def _jitter(self) -> float:
        return self._rng.lognormvariate(0.0, self.noise) if self.noise else 1.0

    async def step(self) -> StepResult:
        self.iterations += 1
        take = prefill_take((p for p, _, _ in self._pending.values()), self.prefill_token_budget,
                            self.max_batch - len(self._running)) if self._pending else 0
        switched = self.core is not None and self.core.last is not None and self.core.last is not self
        if self.core is not None:
            self.core.last = self
        result = await (self._prefill(take, switched) if take else self._decode(switched))
        self._last = (result.kind, len(result.request_ids))
        return result

    async def _prefill(self, take: int, switched: bool) -> StepResult:
        batch = list(itertools.islice(self._pending, take))
        tokens = sum(self._pending[rid][0] for rid in batch)
        extra = extra_s(self.times, IterationKind.PREFILL, take, self._last, switched, tokens not in self._shapes)
        self._shapes.add(tokens)
        await self._pause((self.times.prefill_s(tokens) + extra) * self._jitter())
        batch = [rid for rid in batch if rid in self._pending]  # aborted meanwhile: no token
        finished = {}
        for rid in batch:
            prompt, target, reason = self._pending.pop(rid)
            if target <= 1:
                finished[rid] = reason
                continue
            self._running[rid] = (prompt, target, self._rounds, reason)
            self._finish_at[self._rounds + target - 1].append(rid)
            self._context += prompt + 1
        return StepResult(IterationKind.PREFILL, batch, finished=finished)

    async def _decode(self, switched: bool) -> StepResult:
        n = len(self._running)
        extra = extra_s(self.times, IterationKind.DECODE, n, self._last, switched)
        await self._pause((self.times.decode_s(n, self._context / n) + extra) * self._jitter())
        served = list(self._running)  # without any aborted meanwhile
        self._rounds += 1
        self._context += len(served)
        finished = {}
        for rid in self._finish_at.pop(self._rounds, ()):
            entry = self._running.pop(rid, None)
            if entry is not None:  # not aborted meanwhile
                self._context -= entry[0] + entry[1]
                finished[rid] = entry[3]
        return StepResult(IterationKind.DECODE, served, finished=finished)
