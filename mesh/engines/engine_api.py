"""The engine protocol: what a node runtime needs from an inference engine.

One engine object is one model instance on one node. The node runtime (mesh.node.runtime)
drives it one iteration at a time, by the compute subsystem's choice (LLM-Mesh 5.1):
`step()` runs exactly one iteration (prefill-only or decode-only, never mixed) and returns
the tokens it produced. Memory operations (load, unload, KV resize) are awaited by the
runtime when the reservation station starts them (LLM-Mesh 6.3).

Every engine follows the same batching rule, so the compute subsystem can predict it
(`mesh.policy.batching.prefill_take` is that rule, the one implementation the simulated
engine and the compute subsystem share): if requests wait for prefill and fewer than `max_batch` requests run,
the next iteration prefills waiting requests in arrival order while their prompt tokens
fit `prefill_token_budget` (at least one) and the running ones stay within `max_batch`;
otherwise it decodes one token for every running request. A request whose last token
came in an iteration leaves the batch in that iteration. (OpenVINO's scheduler in vLLM
mode does exactly this; tests/test_batching_rule.py runs a scripted workload on both
engines and compares every step's kind and batch size.)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Container, Iterable, Protocol, Sequence, runtime_checkable

from mesh.policy.batching import IterationKind

log = logging.getLogger("engines")


class FinishReason(str, Enum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the runtime or the client


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling parameters, passed through to the engine (OpenAI request fields)."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # run to max_tokens (vLLM's extension; benchmarks and live replays)


@dataclass(slots=True)
class EngineRequest:
    """A request as an engine sees it.

    `prompt_token_ids` is the tokenized prompt (chat template already applied) for real
    engines (a resumed request's: its prompt, then the `resumed` tokens it produced); the simulated engine needs only `prompt_len` and `output_len`, the number of
    tokens the simulated model will produce (taken from a trace; real engines ignore it).
    """

    request_id: str
    prompt_len: int
    sampling: Sampling = field(default_factory=Sampling)
    prompt_token_ids: Sequence[int] | None = None
    output_len: int | None = None
    # A request resumed here with its progress (moved, evicted, its node lost): the last
    # `resumed` of prompt_token_ids are output it produced and streamed elsewhere. A real
    # engine replays them through its detokenizer and stop matcher (detokenize.resume_text),
    # so the text they held back (an incomplete character, the start of a stop string) is
    # not lost and a stop string counts from the request's start.
    resumed: int = 0


@dataclass(slots=True)
class StepResult:
    """What one iteration produced.

    `request_ids` are the requests that received one new token each, in batch order;
    `token_ids` and `texts` run parallel to it (None where an engine has no token ids or
    text, as the simulated engine). `finished` maps the requests that ended in this
    iteration to their reason; their last token is in `request_ids` too.
    """

    kind: IterationKind
    request_ids: Sequence[str]
    token_ids: Sequence[int] | None = None
    texts: Sequence[str] | None = None
    finished: dict[str, FinishReason] = field(default_factory=dict)


RequestOutput = tuple[str, int | None, str, FinishReason | None]
"""What one request got in an iteration: (request id, its new token or None, the text delta,
the finish reason if it ended)."""


def step_result(kind: IterationKind, outputs: Iterable[RequestOutput]) -> StepResult:
    """The StepResult of an iteration from its per-request outputs, in batch order: a request
    with a token joins `request_ids` (with its token and text); one with a reason is in
    `finished` (a request may end without a new token, e.g. aborted by the engine)."""
    request_ids: list[str] = []
    token_ids: list[int] = []
    texts: list[str] = []
    finished: dict[str, FinishReason] = {}
    for request_id, token, text, reason in outputs:
        if token is not None:
            request_ids.append(request_id)
            token_ids.append(token)
            texts.append(text)
        if reason is not None:
            finished[request_id] = reason
    return StepResult(kind, request_ids, token_ids, texts, finished)


class EngineError(RuntimeError):
    """An engine refused or failed an operation; the message says what and what to do."""


DEFAULT_CONTEXT_CAP = 4096  # default window when a model allows more: a long window makes L_min and budgets huge


@dataclass(frozen=True, slots=True)
class EngineLimits:
    context_window: int
    prefill_token_budget: int
    max_num_seqs: int


def engine_limits(model_name: str, trained_window: int, context_window: int | None,
                  prefill_token_budget: int | None, max_num_seqs: int, budget_reason: str) -> EngineLimits:
    """An engine's window, prefill token budget and batch limit, checked the same way for
    every engine. `budget_reason` says why the engine needs a budget of at least the window."""
    window = int(context_window or min(trained_window, DEFAULT_CONTEXT_CAP))
    if window < 2:
        raise EngineError(f"context_window must be at least 2 tokens, got {window}")
    if window > trained_window:
        log.warning("%s: context_window %d exceeds the model's trained window %d",
                                             model_name, window, trained_window)
    budget = int(prefill_token_budget or window)
    if budget < window:
        raise EngineError(f"prefill_token_budget {budget} is below context_window {window}; {budget_reason}, so "
                          "raise the budget or lower the context window")
    if max_num_seqs < 1:
        raise EngineError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    return EngineLimits(window, budget, max_num_seqs)


def checked_prompt_ids(request: EngineRequest, *, model_name: str, context_window: int,
                       vocab_size: int | None) -> list[int]:
    """A real engine's prompt check, before anything reaches the engine: token ids present,
    matching `prompt_len`, leaving room for one output token, inside the vocabulary."""
    ids = request.prompt_token_ids
    if ids is None:
        raise EngineError(f"request {request.request_id!r} has no prompt_token_ids; tokenize it "
                          "with encode_prompt() or encode_chat() first")
    ids = [int(t) for t in ids]
    if not ids:
        raise EngineError(f"request {request.request_id!r} has an empty prompt; send at least one token")
    if request.prompt_len != len(ids):
        raise EngineError(f"request {request.request_id!r} says prompt_len={request.prompt_len} but "
                          f"carries {len(ids)} token ids; set prompt_len to len(prompt_token_ids)")
    if len(ids) + 1 > context_window:
        raise EngineError(
            f"prompt of {len(ids)} tokens leaves no room for output in {model_name}'s "
            f"context window of {context_window} tokens; shorten the prompt to at most "
            f"{context_window - 1} tokens or use an instance with a larger window")
    if vocab_size:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise EngineError(f"token id {bad} is outside {model_name}'s vocabulary of {vocab_size}; "
                              "tokenize with this model's tokenizer")
    return ids


def checked_request(request: EngineRequest, *, model_name: str, context_window: int,
                    vocab_size: int | None, running: Container[str]) -> list[int]:
    """`checked_prompt_ids`, an id none of the `running` requests has, and sampling a real
    engine can run: max_tokens >= 1, temperature >= 0, 0 < top_p <= 1. Returns the
    prompt's token ids."""
    if request.request_id in running:
        raise EngineError(f"request id {request.request_id!r} is already running on {model_name}; use unique ids")
    ids = checked_prompt_ids(request, model_name=model_name, context_window=context_window, vocab_size=vocab_size)
    sampling = request.sampling
    if sampling.max_tokens < 1:
        raise EngineError(f"max_tokens must be at least 1, got {sampling.max_tokens}")
    if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
        raise EngineError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature={sampling.temperature}, "
                          f"top_p={sampling.top_p}")
    return ids


@runtime_checkable
class Engine(Protocol):
    """One model instance on one node."""

    model_name: str
    kv_bytes_per_token: int  # C in LLM-Mesh Eq. 2
    weight_bytes: int  # memory the weights hold from load to unload
    context_window: int  # longest prompt + output the instance accepts
    prefill_token_budget: int  # max prompt tokens one prefill iteration takes
    max_batch: int  # most requests the instance holds at once (more would break the batching rule)

    async def load(self) -> None:
        """Bring weights into the node's memory (a memory operation; takes time)."""

    async def unload(self) -> None:
        """Release weights and KV cache (a memory operation)."""

    async def resize_kv(self, capacity_bytes: int) -> None:
        """Set the KV cache bound to `capacity_bytes` (a memory operation; takes time)."""

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request for prefill. Raises EngineError if it cannot fit the context window."""

    async def step(self) -> StepResult:
        """Run exactly one iteration. Only called when `has_work()` is true."""

    def abort(self, request_id: str) -> None:
        """Drop a request; it produces nothing more. Unknown ids are ignored."""

    def has_work(self) -> bool:
        """True while any request waits for prefill or is decoding."""

    def kv_bytes_in_use(self) -> int:
        """KV cache bytes the running requests hold now."""
