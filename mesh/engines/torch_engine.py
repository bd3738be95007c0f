"""A whole model instance on the layer-range engine (mesh.engines.torch_layers), behind
the engine protocol (mesh.engines.engine_api.Engine).

It holds all the layers, so the node runtime can drive it like any engine: one iteration
per `step()`, prefill-only or decode-only, by the batching rule every engine follows
(`mesh.policy.batching.prefill_take`). Its `layers` are the TorchLayerEngine underneath,
whose `share()` gives any range of them to a live-scaling partner (BlitzScale 5.2).
Text comes from the folder's tokenizer.json where the `tokenizers` package is installed
(else every text delta is empty and stop strings cannot match); end-of-sequence is the
config's eos_token_id.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mesh.engines.detokenize import Detokenizer, StopMatcher
from mesh.engines.engine_api import (
    DTYPE_BYTES,
    EngineError,
    EngineRequest,
    FinishReason,
    NextTokens,
    RequestOutput,
    Sampling,
    StepResult,
    TokenBatch,
    checked_request,
    engine_limits,
    step_result,
)
from mesh.engines.torch_layers import LlamaShape, TorchLayerEngine
from mesh.policy.batching import IterationKind, prefill_take


@dataclass(slots=True)
class _Req:
    request_id: str
    prompt: list[int]
    sampling: Sampling
    max_tokens: int
    detok: Detokenizer | None
    stop: StopMatcher | None
    generated: list[int] = field(default_factory=list)


def _parameters(s: LlamaShape) -> int:
    attn = s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim * s.hidden_size
    layer = attn + 3 * s.hidden_size * s.intermediate_size + 2 * s.hidden_size
    head = 0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size
    return s.vocab_size * s.hidden_size + s.num_layers * layer + s.hidden_size + head


class TorchEngine:
    """One instance of a Llama-family model from a Hugging Face folder, on CPU or CUDA."""

    runs_layer_ranges = False  # the instance runs whole iterations; `layers` runs ranges
    blocks_event_loop = True  # step() computes in place: the node yields after each one

    def __init__(self, model_path: str | Path, *, model_name: str | None = None, context_window: int | None = None,
                 prefill_token_budget: int | None = None, max_num_seqs: int = 64, kv_capacity_bytes: int | None = None,
                 device: str | None = None, dtype: str | None = None, ignore_eos: bool = False) -> None:
        self.path = Path(model_path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise EngineError(f"{self.path} has no config.json; give a Hugging Face model folder")
        self.config = json.loads(config_path.read_text())
        self.shape = LlamaShape.from_config(self.config)
        self.model_name = model_name or self.path.name
        limits = engine_limits(self.model_name, int(self.config.get("max_position_embeddings") or 2048),
                               context_window, prefill_token_budget, max_num_seqs,
                               "a prompt is prefilled in one iteration")
        self.context_window = limits.context_window
        self.prefill_token_budget = limits.prefill_token_budget
        self.max_batch = limits.max_num_seqs
        self.device, self.dtype = device, dtype
        compute = dtype or ("bfloat16" if _cuda(device) else "float32")  # TorchLayerEngine's choice
        self.kv_bytes_per_token = 2 * self.shape.num_layers * self.shape.num_kv_heads * self.shape.head_dim \
            * DTYPE_BYTES[compute]
        self.weight_bytes = _parameters(self.shape) * DTYPE_BYTES[compute]
        self.kv_capacity_bytes = kv_capacity_bytes if kv_capacity_bytes is not None else 0
        self.ignore_eos = ignore_eos
        self.layers: TorchLayerEngine | None = None
        self._tokenizer: Any = None
        self._waiting: dict[str, _Req] = {}
        self._running: dict[str, _Req] = {}

    # --- memory operations ---------------------------------------------------------------

    async def load(self) -> None:
        """Read the weights (in a thread: the event loop goes on) and the tokenizer."""
        self.layers = await asyncio.to_thread(TorchLayerEngine.from_folder, self.path, device=self.device,
                                              dtype=self.dtype, model_name=self.model_name)
        self.kv_bytes_per_token = self.layers.kv_bytes_per_token
        self.weight_bytes = self.layers.weight_bytes
        tokenizer_file = self.path / "tokenizer.json"
        if tokenizer_file.is_file():
            try:
                from tokenizers import Tokenizer
            except ImportError:
                Tokenizer = None
            if Tokenizer is not None:
                self._tokenizer = Tokenizer.from_file(str(tokenizer_file))

    async def unload(self) -> None:
        for rid in list(self._waiting) + list(self._running):
            self.abort(rid)
        self.layers = None
        self.kv_capacity_bytes = 0

    async def resize_kv(self, capacity_bytes: int) -> None:
        """The KV bound; the cache grows per request as tokens come, so nothing moves."""
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise EngineError(f"KV capacity must be a non-negative number of bytes, got {capacity_bytes!r}")
        self.kv_capacity_bytes = capacity_bytes

    # --- tokens ---------------------------------------------------------------------------

    def encode_prompt(self, text: str) -> list[int]:
        if self._tokenizer is None:
            raise EngineError(f"{self.model_name} has no tokenizer here (tokenizer.json and the tokenizers package); "
                              "send prompt_token_ids")
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True) if self._tokenizer else ""

    # --- requests -------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        if self.layers is None:
            raise EngineError(f"{self.model_name} is not loaded; await load() before adding requests")
        ids = checked_request(request, model_name=self.model_name, context_window=self.context_window,
                              vocab_size=self.shape.vocab_size, running=self._waiting.keys() | self._running.keys())
        sp = request.sampling
        stops = tuple(s for s in sp.stop if s)
        self._waiting[request.request_id] = _Req(
            request.request_id, ids, sp, min(sp.max_tokens, self.context_window - len(ids)),
            Detokenizer(self.decode) if self._tokenizer else None, StopMatcher(stops) if stops else None)

    def abort(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        if self._running.pop(request_id, None) is not None and self.layers is not None:
            self.layers.release(request_id)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def kv_bytes_in_use(self) -> int:
        return self.layers.kv_bytes_in_use() if self.layers is not None else 0

    async def step(self) -> StepResult:
        """One iteration, by the batching rule (module docstring). Computes in place."""
        layers = self.layers
        if layers is None:
            raise EngineError(f"{self.model_name} is not loaded; await load() first")
        take = prefill_take((len(r.prompt) for r in self._waiting.values()), self.prefill_token_budget,
                            self.max_batch - len(self._running)) if self._waiting else 0
        if take:
            batch = list(itertools.islice(self._waiting.values(), take))
            for r in batch:
                del self._waiting[r.request_id]
                self._running[r.request_id] = r
            kind = IterationKind.PREFILL
            x = TokenBatch(tuple(r.request_id for r in batch), (0,) * len(batch), tuple(tuple(r.prompt) for r in batch))
        elif self._running:
            batch = list(self._running.values())
            kind = IterationKind.DECODE
            x = TokenBatch(tuple(r.request_id for r in batch),
                           tuple(len(r.prompt) + len(r.generated) - 1 for r in batch),
                           tuple((r.generated[-1],) for r in batch))
        else:
            raise EngineError(f"{self.model_name} has no requests; call step() only while has_work()")
        out = layers.run_layers(x, {r.request_id: r.sampling for r in batch})
        assert isinstance(out, NextTokens)
        outputs: list[RequestOutput] = []
        for r, token in zip(batch, out.token_ids):
            outputs.append((r.request_id, token, *self._emit(r, token)))
        return step_result(kind, outputs)

    def _emit(self, r: _Req, token: int) -> tuple[str, FinishReason | None]:
        """The text delta of a request's new token and its finish reason, if it ended."""
        r.generated.append(token)
        delta = r.detok.push(token) if r.detok else ""
        text = r.stop.feed(delta) if r.stop else delta
        reason = None
        if r.stop and r.stop.stopped:
            reason = FinishReason.STOP
        elif token in self.shape.eos_token_ids and not (self.ignore_eos or r.sampling.ignore_eos):
            reason = FinishReason.STOP
        elif len(r.generated) >= r.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            if r.detok and not (r.stop and r.stop.stopped):
                tail = r.detok.flush()
                text += (r.stop.feed(tail) + r.stop.flush()) if r.stop else tail
            del self._running[r.request_id]
            self.layers.release(r.request_id)  # type: ignore[union-attr]
        return text, reason


def _cuda(device: str | None) -> bool:
    """Would TorchLayerEngine pick CUDA for `device` (None: CUDA where torch sees a GPU)?"""
    if device is not None:
        return device.startswith("cuda")
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
