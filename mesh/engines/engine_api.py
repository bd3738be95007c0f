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
from typing import Container, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from mesh.policy.batching import IterationKind

log = logging.getLogger(__name__)


MAX_TOP_LOGPROBS = 20  # most alternatives per token a request may ask for (vLLM's default max_logprobs)


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
    logprobs: bool = False  # give each produced token's log probability (of the model's distribution)
    top_logprobs: int = 0  # with logprobs: also the k most likely tokens at each position (TokenLogprob.top)
    presence_penalty: float = 0.0  # OpenAI's: subtracted from a token's logit once it occurred
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per occurrence
    repetition_penalty: float = 1.0  # vLLM's / Hugging Face's multiplicative penalty; 1 is none
    json_schema: str | None = None  # structured output: the answer is JSON valid under this schema (its text)
    # A LoRA adapter on the instance's model (mesh.modelfiles.lora): its weights file as the node
    # sees it (adapter_model.safetensors), and its PEFT scale (lora_alpha / r); None: the base.
    adapter: str | None = None
    adapter_scale: float = 1.0

    def features(self) -> frozenset[str]:
        """The request fields beyond plain sampling that this request uses, by their OpenAI
        names: an engine kind must honour each (mesh.modelfiles.formats.ENGINE_FEATURES)."""
        used = {"logprobs"} if self.logprobs else set()
        if self.top_logprobs > 0:
            used.add("top_logprobs")
        used |= {name for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                         ("repetition_penalty", 1.0)) if getattr(self, name) != off}
        if self.json_schema is not None:
            used.add("response_format")
        if self.adapter is not None:
            used.add("adapter")
        return frozenset(used)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A produced token's log probability under the model's own distribution (before
    temperature, top_p and penalties) and, where the request asked for them
    (Sampling.top_logprobs), the most likely tokens at its position: (the token's own text,
    its log probability), most likely first."""

    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(slots=True)
class EngineRequest:
    """A request as an engine sees it.

    `prompt_token_ids` is the tokenized prompt (chat template already applied) for real
    engines (a resumed request's: its prompt, then the `resumed` tokens it produced); the simulated engine needs only
    `prompt_len` and `output_len`, the number of tokens the simulated model will produce (taken from a trace; real
    engines ignore it).
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

    def token_ids(self) -> Sequence[int]:
        """`prompt_token_ids`; EngineError if the request was never tokenized."""
        if self.prompt_token_ids is None:
            raise EngineError(f"request {self.request_id!r} has no prompt_token_ids")
        return self.prompt_token_ids


@dataclass(slots=True)
class StepResult:
    """What one iteration produced.

    `request_ids` are the requests that received one new token each, in batch order;
    `token_ids`, `texts` and `logprobs` run parallel to it (None where an engine has no
    token ids or text, as the simulated engine; a logprob is None for a request that did
    not ask for it, Sampling.logprobs). `finished` maps the requests that ended in this
    iteration to their reason; their last token is in `request_ids` too.
    """

    kind: IterationKind
    request_ids: Sequence[str]
    token_ids: Sequence[int] | None = None
    texts: Sequence[str] | None = None
    finished: dict[str, FinishReason] = field(default_factory=dict)
    logprobs: Sequence[TokenLogprob | None] | None = None


RequestOutput = tuple[str, int | None, str, FinishReason | None] | tuple[str, int | None, str, FinishReason | None,
                                                                         TokenLogprob | None]
"""What one request got in an iteration: (request id, its new token or None, the text delta,
the finish reason if it ended[, the new token's log probability if it was asked for])."""


def step_result(kind: IterationKind, outputs: Iterable[RequestOutput]) -> StepResult:
    """The StepResult of an iteration from its per-request outputs, in batch order: a request
    with a token joins `request_ids` (with its token and text); one with a reason is in
    `finished` (a request may end without a new token, e.g. aborted by the engine)."""
    request_ids: list[str] = []
    token_ids: list[int] = []
    texts: list[str] = []
    logprobs: list[TokenLogprob | None] = []
    finished: dict[str, FinishReason] = {}
    for output in outputs:
        request_id, token, text, reason = output[:4]
        if token is not None:
            request_ids.append(request_id)
            token_ids.append(token)
            texts.append(text)
            logprobs.append(output[4] if len(output) > 4 else None)
        if reason is not None:
            finished[request_id] = reason
    return StepResult(kind, request_ids, token_ids, texts, finished,
                      logprobs if any(lp is not None for lp in logprobs) else None)


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


# --- Layer ranges (BlitzScale 5.2, λScale 4.3) ---------------------------------------------
# An engine that can run a contiguous range [start, stop) of a model's decoder layers takes
# token ids (its range starts at layer 0: it embeds them) or the hidden states a previous
# range produced, and gives hidden states (to the next range) or next tokens (its range ends
# at the last layer: it norms, projects and samples). It keeps the KV cache of its own layers
# only. An engine that cannot (OpenVINO compiles whole models; vLLM; the simulated engine)
# has `runs_layer_ranges = False`, and no scheduler asks it.

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class LayerRange:
    """Decoder layers [start, stop) of a model with `num_layers` layers."""

    start: int
    stop: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.num_layers:
            raise EngineError(f"layer range [{self.start}, {self.stop}) is not a non-empty range inside the model's "
                              f"{self.num_layers} layers; use 0 <= start < stop <= {self.num_layers}")

    @classmethod
    def whole(cls, num_layers: int) -> "LayerRange":
        return cls(0, num_layers, num_layers)

    @property
    def count(self) -> int:
        return self.stop - self.start

    @property
    def first(self) -> bool:
        """The range embeds token ids (it starts at layer 0)."""
        return self.start == 0

    @property
    def last(self) -> bool:
        """The range ends the model: final norm, LM head, sampling."""
        return self.stop == self.num_layers


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Token ids into a first range: for each request, its tokens at positions
    `positions[i]`, `positions[i] + 1`, ... (a prefill starts at 0; a decode step sends one
    token at the request's current length)."""

    request_ids: tuple[str, ...]
    positions: tuple[int, ...]
    token_ids: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not len(self.request_ids) == len(self.positions) == len(self.token_ids):
            raise EngineError(f"token batch: {len(self.request_ids)} request ids, {len(self.positions)} positions and "
                              f"{len(self.token_ids)} token lists; give one of each per request")
        if any(not ids for ids in self.token_ids):
            raise EngineError("token batch: a request has no tokens; send at least one per request")

    @property
    def token_counts(self) -> tuple[int, ...]:
        return tuple(len(ids) for ids in self.token_ids)


@dataclass(frozen=True, slots=True)
class HiddenStates:
    """Activations crossing a layer boundary: the input of layer `layer` for every token of
    a batch, requests one after another (request i holds `token_counts[i]` rows starting at
    position `positions[i]`). `data` is the C-contiguous tensor of shape (tokens,
    hidden_size) in `dtype`, as bytes, so it can be framed over a connection as it is."""

    layer: int
    request_ids: tuple[str, ...]
    positions: tuple[int, ...]
    token_counts: tuple[int, ...]
    hidden_size: int
    dtype: str
    data: bytes

    def __post_init__(self) -> None:
        if not len(self.request_ids) == len(self.positions) == len(self.token_counts):
            raise EngineError(f"hidden states: {len(self.request_ids)} request ids, {len(self.positions)} positions "
                              f"and {len(self.token_counts)} token counts; give one of each per request")
        if self.dtype not in DTYPE_BYTES:
            raise EngineError(f"hidden states in {self.dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
        if any(n < 1 for n in self.token_counts) or any(p < 0 for p in self.positions):
            raise EngineError("hidden states: every request needs at least one token at a position >= 0")
        if len(self.data) != self.nbytes:
            raise EngineError(f"hidden states carry {len(self.data)} B, but {self.tokens} tokens x {self.hidden_size} "
                              f"x {self.dtype} make {self.nbytes} B")

    @property
    def tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.tokens, self.hidden_size)

    @property
    def nbytes(self) -> int:
        """hidden size x tokens x dtype bytes: what one hop of this batch costs on the network."""
        return self.tokens * self.hidden_size * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class NextTokens:
    """What a last range gives: one sampled token per request, in batch order."""

    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]


@runtime_checkable
class LayerRangeEngine(Protocol):
    """An engine running decoder layers `layer_range` of a model (see the section above)."""

    runs_layer_ranges: bool  # True
    layer_range: LayerRange
    hidden_size: int

    def layers_ready(self) -> int:
        """How many layers of the range, from its start, hold their weights (all of them
        once loaded; fewer while the blocks of a layer-ordered file still arrive)."""

    def run_layers(self, batch: TokenBatch | HiddenStates, sampling: Mapping[str, Sampling] | None = None,
                   stop: int | None = None) -> HiddenStates | NextTokens:
        """One forward pass of layers [start, stop) over a batch (the whole range: stop
        None; a loading instance runs the layers it holds, BlitzScale 5.2). `sampling` for
        a last range (greedy for requests it does not name). Each request's position must
        equal the tokens each of those layers holds in its KV cache for it (0: a new request)."""

    def release(self, request_id: str) -> None:
        """Free a request's KV cache (it ended or was aborted). Unknown ids are ignored."""


def can_run_layers(engine: object) -> bool:
    """Can the scheduler give `engine` a layer range? Only an engine that says so."""
    return bool(getattr(engine, "runs_layer_ranges", False)) and isinstance(engine, LayerRangeEngine)
