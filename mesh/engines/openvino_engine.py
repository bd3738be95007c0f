"""The real CPU engine: OpenVINO GenAI's ContinuousBatchingPipeline in "vLLM mode".

One `OpenVINOEngine` is one model instance. The pipeline runs with
`SchedulerConfig.dynamic_split_fuse=False`, so every `pipe.step()` is either prefill-only or
decode-only, as the engine protocol requires; `step()` is exactly one `pipe.step()`.
`max_num_batched_tokens` is the protocol's `prefill_token_budget` and is never below the
context window, because a prompt longer than it breaks the pipeline for good (it is
refused before it gets there).

Blocking: `pipe.step()` holds the Python GIL for the whole iteration, and `step()` calls it
directly even though it is `async def`. That is deliberate: engines live in a node agent
process whose event loop does nothing else while an iteration runs (the node computes one
iteration at a time). Because `step()` never yields, the engine says so
(`blocks_event_loop = True`) and the node runtime yields to its event loop after each of
its iterations; otherwise a busy node never let its loop run, and requests arriving while
it had work waited until it went idle. As with the simulated engine (which sleeps through
its iteration), requests that arrive during an iteration join a later one.
`load()` builds the pipeline in a worker thread: OpenVINO releases the GIL while it reads
and compiles the model, so the agent keeps serving its other instances meanwhile.

KV memory (what can and cannot be resized): OpenVINO cannot resize a KV cache after the
pipeline is built. The pipeline is built with `cache_size=0, num_kv_blocks=0`, so its cache
grows on demand (copying into a larger buffer) and never shrinks. `resize_kv(capacity)`
records the bound that Mesh's memory subsystem enforces at admission (Mesh, not the
engine, keeps the running requests' KV demand under the bound); it costs microseconds.
Memory the cache already took is returned only when the pipeline is rebuilt: on
`unload()`, or in `resize_kv` when `release_on_shrink=True`, the engine is idle and the new
bound is below what the cache holds (a rebuild costs a full load, about 4.5 s for the demo
model on 2 cores). `kv_bytes_allocated()` reports the cache's real size, so the runtime
can count max(bound, allocated) for this instance.

KV accounting: `kv_bytes_in_use()` counts the blocks the live requests hold: a request
with P prompt tokens and G generated tokens has K/V for P + G - 1 tokens (the newest token
is computed at the next step), rounded up to whole 32-token blocks. This matches the
pipeline's metrics (`cache_usage` x `cache_size_in_bytes`) after a step, but is exact at
once: the metrics are percentages taken while the step is scheduled, so they still count
a request cancelled (aborted, or ended by a stop string) just before the step. The pipeline
frees a cancelled request's blocks at its next step; an idle engine takes that step at once.
`kv_bytes_per_token` comes from the model shape and the cache precision (u8 keys per
channel and u8 values per token on CPU, see mesh.perf.roofline.kv_bytes_per_token): 13,680 bytes for the demo
model; `load()` checks it against the size of a real block.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from mesh.engines.chat import PromptEncoder
from mesh.engines.detokenize import Detokenizer, StopMatcher, resume_text
from mesh.engines.engine_api import (
    EngineError,
    EngineRequest,
    FinishReason,
    RequestOutput,
    Sampling,
    StepResult,
    TokenLogprob,
    checked_request,
    engine_limits,
    step_result,
)
from mesh.engines.openvino_adapters import BASE, AdapterTurns, key_of, slot_adapter
from mesh.modelfiles.shape import ModelShape, shape_from_config, shape_from_gguf
from mesh.perf.roofline import kv_bytes_per_token
from mesh.policy.batching import IterationKind

log = logging.getLogger(__name__)

CPU_KV_BLOCK_SIZE = 32  # tokens per KV block in OpenVINO's CPU plugin (2026.4)
# Plugin properties under which recomputing a request's prompt + produced tokens in one prefill
# gives the KV values that decoding them token by token gave, so a moved greedy stream goes on
# exactly as it would have. With the CPU defaults it need not: bf16 compute, the dynamic int8
# quantization of activations against compressed weights (which a 1-token decode and a
# many-token prefill apply differently) and u8 keys quantized per 32-token block each change
# the values. Measured on the demo model (2-core EPYC with AVX-512 BF16; 14 moves after 0-40
# tokens of two prompts; scripts/exact_moves_check.py): diverged with the defaults 11/14, f16
# KV 11/14, f16 KV in f32 12/14, f16 KV without dynamic quantization 7/14, these three
# settings 0/14; they make a 420-token prefill and a batch-8 decode step about 2.2x slower.
EXACT_RECOMPUTE: dict[str, Any] = {"KV_CACHE_PRECISION": "f16", "INFERENCE_PRECISION_HINT": "f32",
                                   "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
EXPORT_HINT = (
    "Export it to OpenVINO IR first: `pip install -e .[export]`, then "
    "`optimum-cli export openvino --model {path} --task text-generation-with-past OUT_DIR`, "
    "and register OUT_DIR (or pass a GGUF file)."
)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model the pipeline can load: a GGUF file or an OpenVINO IR folder."""

    path: Path
    kind: str  # "gguf" or "ir"
    shape: ModelShape
    vocab_size: int | None
    weight_bytes: int


def resolve_model(path: str | Path) -> ModelSource:
    """Identify a model path, read its shape; EngineError says what to do with anything else."""
    p = Path(path).expanduser()
    if not p.exists():
        raise EngineError(f"model path {p} does not exist; pass a GGUF file or an OpenVINO IR folder")
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(4) != b"GGUF":
                raise EngineError(f"{p} is not a GGUF file; pass a GGUF file or an OpenVINO IR folder")
        try:
            shape = shape_from_gguf(p)
        except ValueError as exc:
            raise EngineError(f"cannot read the model shape from {p}: {exc}") from exc
        from mesh.modelfiles.gguf import read_gguf_metadata  # cheap: the header only

        meta = read_gguf_metadata(p)
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = meta.get(f"{shape.architecture}.vocab_size") or (tokens.count if tokens else None)
        return ModelSource(p, "gguf", shape, int(vocab) if vocab else None, p.stat().st_size)
    if (p / "openvino_model.xml").is_file():
        missing = [n for n in ("openvino_model.bin", "openvino_tokenizer.xml", "openvino_detokenizer.xml",
                               "config.json") if not (p / n).is_file()]
        if missing:
            raise EngineError(f"OpenVINO IR folder {p} lacks {', '.join(missing)}; export it again with "
                              "optimum-cli (it writes the tokenizer and config.json too)")
        shape = shape_from_config(p / "config.json")
        import json

        vocab = json.loads((p / "config.json").read_text()).get("vocab_size")
        return ModelSource(p, "ir", shape, vocab, (p / "openvino_model.bin").stat().st_size)
    if (p / "config.json").is_file():
        raise EngineError(f"{p} is a Hugging Face model folder, which OpenVINO cannot run directly. "
                          + EXPORT_HINT.format(path=p))
    raise EngineError(f"{p} is neither a GGUF file nor an OpenVINO IR folder (no openvino_model.xml)")


@dataclass(slots=True)
class _Live:
    """A request the pipeline holds. The handle must stay referenced: dropping it cancels."""

    request_id: str
    handle: Any  # openvino_genai GenerationHandle
    prompt_len: int
    detok: Detokenizer
    stop: StopMatcher | None
    generated: int = 0
    logprobs: bool = False  # the request asked for its tokens' log probabilities
    logprob: TokenLogprob | None = None  # the newest token's (OpenVINO gives no alternatives)

    @property
    def kv_tokens(self) -> int:
        return self.prompt_len + self.generated - 1 if self.generated else 0

    def read(self) -> list[Any] | None:
        """The request's new outputs this step (None if it has nothing to read)."""
        handle = self.handle
        return list(handle.read().values()) if handle.can_read() else None

    def collect(self, outputs: list[Any] | None) -> tuple[int | None, str, FinishReason | None]:
        """What one request got this step: (token, text delta, finish reason)."""
        import openvino_genai as ov_genai

        handle = self.handle
        if outputs is None:
            status = handle.get_status()
            if status in (ov_genai.GenerationStatus.IGNORED, ov_genai.GenerationStatus.CANCEL):
                return None, "", FinishReason.ABORT  # the pipeline gave up on it (no cache)
            return None, "", None
        token, text, reason = None, "", None
        for output in outputs:  # one sequence: num_return_sequences=1
            if self.logprobs:
                self.logprob = (TokenLogprob(float(output.generated_log_probs[-1]))
                                if len(output.generated_log_probs) else None)
            for token in output.generated_ids:
                self.generated += 1
                delta = self.detok.push(token)
                text += self.stop.feed(delta) if self.stop else delta
            if output.finish_reason == ov_genai.GenerationFinishReason.STOP:
                reason = FinishReason.STOP
            elif output.finish_reason == ov_genai.GenerationFinishReason.LENGTH:
                reason = FinishReason.LENGTH
        if self.stop and self.stop.stopped:
            return token, text, FinishReason.STOP  # our stop string: the pipeline is cancelled
        if reason is None and handle.get_status() == ov_genai.GenerationStatus.FINISHED:
            reason = FinishReason.STOP
        if reason is not None:
            tail = self.detok.flush()
            text += (self.stop.feed(tail) + self.stop.flush()) if self.stop else tail
        return token, text, reason


class OpenVINOEngine:
    """One model instance on OpenVINO GenAI (CPU), implementing mesh.engines.engine_api.Engine."""

    blocks_event_loop = True  # step() computes in place: the node yields after each one
    runs_layer_ranges = False  # OpenVINO compiles the whole model (engine_api, layer ranges)

    def __init__(
        self,
        model_path: str | Path,
        *,
        model_name: str | None = None,
        context_window: int | None = None,
        prefill_token_budget: int | None = None,
        max_num_seqs: int = 64,
        device: str = "CPU",
        properties: Mapping[str, Any] | None = None,
        kv_capacity_bytes: int | None = None,
        release_on_shrink: bool = False,
        ignore_eos: bool = False,
        cache_root: str | Path | None = None,
        use_node_cache: bool = True,
    ) -> None:
        """Describe an instance; nothing is loaded until `load()`.

        context_window: longest prompt + output; defaults to the model's trained window,
            capped at 4096 (a long window makes Mesh's minimum KV demand L_min and the
            prefill budget large; pass a larger value to use more).
        prefill_token_budget: `max_num_batched_tokens`; defaults to, and must be at least,
            the context window (a longer prompt would break the pipeline).
        max_num_seqs: most requests one iteration batches.
        kv_capacity_bytes: the KV bound recorded at start (see `resize_kv`).
        ignore_eos: generate exactly max_tokens (stop strings still apply), for calibration
            and benchmarks that need known output lengths; never for serving.
        cache_root: the node's cache of prepared models and compiled blobs
            (mesh.engines.node_cache; default `<data dir>/compiled`).
        use_node_cache: load a GGUF from its prepared form when the node has one (False:
            always from the GGUF, as a node that never prepared it).
        """
        self.source = resolve_model(model_path)
        shape = self.source.shape
        self.model_name = model_name or self.source.path.stem
        limits = engine_limits(self.model_name, shape.context_length, context_window, prefill_token_budget,
                               max_num_seqs, "OpenVINO in vLLM mode breaks on a prompt longer than its budget")
        self.context_window, self.prefill_token_budget = limits.context_window, limits.prefill_token_budget
        self.max_num_seqs = max_num_seqs
        self.max_batch = max_num_seqs  # mesh.engines.engine_api name
        self.device = device
        self.properties = dict(properties or {})
        self.block_size = CPU_KV_BLOCK_SIZE
        self.key_precision, self.value_precision = kv_precisions(device, self.properties)
        self.kv_bytes_per_token = kv_bytes_per_token(shape, self.key_precision, self.value_precision,
                                                     self.block_size)
        self.weight_bytes = self.source.weight_bytes
        self.kv_capacity_bytes = kv_capacity_bytes
        self.release_on_shrink = release_on_shrink
        self.ignore_eos = ignore_eos
        self.cache_root = Path(cache_root) if cache_root is not None else None
        self.use_node_cache = use_node_cache
        self.loaded_from: str | None = None  # "gguf", "prepared" or "ir" once built
        self.blob_cache: Path | None = None  # the CACHE_DIR the last build used, if any
        self._pipe: Any = None
        self._encoder: PromptEncoder | None = None
        self._standalone_encoder: PromptEncoder | None = None
        self._tokenizer: Any = None
        self._decoded: dict[tuple[int, ...], str] = {}  # this step's batch-decoded windows
        self._live: dict[str, _Live] = {}  # insertion order = arrival order
        self._ids = itertools.count()
        self.runs_adapters = False  # the pipeline has the LoRA slot (mesh.engines.openvino_adapters)
        self._turns = AdapterTurns()

    # ---- memory operations -------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._pipe is not None

    async def load(self) -> None:
        """Build the pipeline (reads and compiles the model) and run one warm-up token.

        The build runs in a worker thread (OpenVINO releases the GIL there). The warm-up
        moves the first inference's one-time cost out of the first request's TTFT and
        checks kv_bytes_per_token against the cache's real block size.
        """
        if self._pipe is not None:
            return
        built: list[Any] = []  # not the thread's return value: asyncio's future would keep
        await asyncio.to_thread(lambda: built.append(self._build()))  # it alive past unload()
        self.install(built.pop())
        self.warm_up()

    def load_blocking(self) -> None:
        """`load()` in the calling thread, in its stages (benchmarks time each one)."""
        if self._pipe is None:
            self.install(self.build_pipeline(self.build_tokenizer()))
            self.warm_up()

    def install(self, pipe: Any) -> None:
        """Take a built pipeline (and its tokenizer) as this engine's."""
        self._pipe = pipe
        self._turns.current = BASE  # a new pipeline runs no adapter (its slot is zero)
        self._tokenizer = pipe.get_tokenizer()
        self._encoder = PromptEncoder(self._tokenizer)

    async def unload(self) -> None:
        """Release the pipeline, its weights and KV cache. Running requests are aborted."""
        self.drop_requests()
        self._pipe = None
        self._encoder = None
        self._tokenizer = None

    async def resize_kv(self, capacity_bytes: int) -> None:
        """Record the KV bound Mesh enforces for this instance (see the module docstring).

        The cache grows on demand and cannot shrink in place: this records the bound
        (microseconds). With `release_on_shrink`, an idle engine whose cache holds more
        than the new bound is rebuilt to return the memory (costs a load).
        """
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise EngineError(f"KV capacity must be a non-negative number of bytes, got {capacity_bytes!r}")
        self.kv_capacity_bytes = capacity_bytes
        if (self.release_on_shrink and self._pipe is not None and not self._live
                and self.kv_bytes_allocated() > capacity_bytes):
            await self.unload()
            await self.load()

    def _build(self) -> Any:
        return self.build_pipeline(self.build_tokenizer())

    def _prepared(self) -> Any:
        """The node's prepared form of a GGUF source (mesh.engines.node_cache), or None."""
        if self.source.kind != "gguf" or not self.use_node_cache:
            return None
        from mesh.engines.node_cache import find_prepared

        return find_prepared(self.source.path, self.cache_root)

    def build_tokenizer(self) -> Any:
        """The model's tokenizer: from the prepared tokenizer IR when the node has it
        (about 0.1 s), else from the model (1.3-2.6 s from the demo GGUF's metadata)."""
        import openvino_genai as ov_genai

        prepared = self._prepared()
        try:
            return ov_genai.Tokenizer(str(prepared.path if prepared is not None else self.source.path))
        except RuntimeError as exc:
            raise EngineError(f"OpenVINO could not build the tokenizer of {self.source.path}: {exc}") from exc

    def build_pipeline(self, tokenizer: Any) -> Any:
        """Read, convert (a GGUF with no prepared form) and compile the model: the pipeline.

        The tokenizer is passed in, so the pipeline does not build its own a second time.
        CACHE_DIR is set only where this OpenVINO imports its own blobs (mesh.engines.node_cache)."""
        import openvino_genai as ov_genai

        from mesh.engines import node_cache

        prepared = self._prepared()
        path = prepared.path if prepared is not None else self.source.path
        properties = dict(self.properties)
        slot = slot_adapter(path) if path.is_dir() else None  # an IR folder with Hugging Face's names
        self.blob_cache = None
        if self.use_node_cache and "CACHE_DIR" not in properties:
            support = node_cache.blob_support(self.cache_root, self.device)
            if support is not None and support.works:
                self.blob_cache = node_cache.blob_cache_dir(self.cache_root, self.device, properties,
                                                            extra=self._compile_knobs(slot is not None))
                properties["CACHE_DIR"] = str(self.blob_cache)
        if slot is not None:
            properties["adapters"] = ov_genai.AdapterConfig([slot])
        config = ov_genai.SchedulerConfig()
        config.dynamic_split_fuse = False  # vLLM mode: a step is prefill-only or decode-only
        config.max_num_batched_tokens = self.prefill_token_budget
        config.max_num_seqs = self.max_num_seqs
        config.cache_size = 0  # 0 and 0: the KV cache grows on demand
        config.num_kv_blocks = 0
        config.enable_prefix_caching = False  # finished requests free their blocks at once
        try:
            pipe = ov_genai.ContinuousBatchingPipeline(str(path), tokenizer, config, self.device, **properties)
        except RuntimeError as exc:
            raise EngineError(f"OpenVINO could not load {path} on {self.device}: {exc}") from exc
        self.loaded_from = "prepared" if prepared is not None else self.source.kind
        self.runs_adapters = slot is not None
        return pipe

    def _compile_knobs(self, lora_slot: bool) -> dict[str, Any]:
        """What besides the properties could change the compiled model: the scheduler's
        sizes (the pipeline may specialise on them), the model file's identity and the LoRA
        slot (its graph differs)."""
        from mesh.engines.node_cache import SourceIdentity

        ident = SourceIdentity.of(self.source.path) if self.source.path.is_file() else None
        knobs = {"max_num_batched_tokens": self.prefill_token_budget, "max_num_seqs": self.max_num_seqs,
                 "source": ident.key() if ident else str(self.source.path)}
        return {**knobs, "lora_slot": True} if lora_slot else knobs

    def warm_up(self) -> None:
        """One 1-token request: the first inference's one-time cost (and the KV cache's first
        allocation, which grows on demand) is paid here, not in the first request's TTFT."""
        import numpy as np
        import openvino as ov

        config = generation_config(Sampling(max_tokens=1), 1, 0, self.ignore_eos)
        handle = self._pipe.add_request(next(self._ids), ov.Tensor(np.array([[0]], dtype=np.int64)), config)
        while self._pipe.has_non_finished_requests():
            self._pipe.step()
        del handle
        metrics = self._pipe.get_metrics()
        block_bytes = round(metrics.cache_size_in_bytes * metrics.cache_usage / 100)  # one block in use
        expected = self.kv_bytes_per_token * self.block_size
        if block_bytes and block_bytes != expected:
            log.warning("%s: KV block holds %d bytes, the shape formula gave %d; using the measured size",
                        self.model_name, block_bytes, expected)
            self.kv_bytes_per_token = math.ceil(block_bytes / self.block_size)
        self._pipe.step()  # lets the pipeline free the warm-up's block

    # ---- requests ------------------------------------------------------------------------

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a plain prompt (no chat template)."""
        return self._prompt_encoder().encode_prompt(prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of chat messages with the model's template and the assistant prompt."""
        return self._prompt_encoder().encode_chat(messages)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._prompt_encoder().decode(token_ids)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request for prefill; it starts at the next step.

        Needs `prompt_token_ids` (use encode_prompt / encode_chat). Refuses (EngineError)
        a prompt that leaves no room for one output token in the context window, and clamps
        `max_tokens` so that prompt + max_tokens <= context_window; a request cut there
        finishes with reason `length`. Stop strings are matched on the decoded text by the
        engine, so each step still yields exactly one token per running request.
        """
        if self._pipe is None:
            raise EngineError(f"{self.model_name} is not loaded; await load() before adding requests")
        key = key_of(request.sampling)
        if key != BASE and not self.runs_adapters:
            raise EngineError(f"{self.model_name} cannot run LoRA adapters: its model is not an OpenVINO IR folder "
                              "with a Llama-style config.json (a GGUF's weights have no names adapters match)")
        checked_request(request, model_name=self.model_name, context_window=self.context_window,
                        vocab_size=self.source.vocab_size, running=set(self._live) | set(self._turns.waiting_ids()))
        if self._turns.must_wait(key, busy=bool(self._live) or self._pipe.has_non_finished_requests()):
            self._turns.waiting.append(request)  # its adapter's turn comes (mesh.engines.openvino_adapters)
            return
        self._turns.switch(self._pipe, key, self.model_name)
        self._start(request)

    def _start(self, request: EngineRequest) -> None:
        """Hand a checked request to the pipeline (its adapter applied)."""
        rid = request.request_id
        ids = list(request.token_ids())
        sampling = request.sampling
        max_tokens = min(sampling.max_tokens, self.context_window - len(ids))  # fits the window
        pipe_id = next(self._ids)
        config = generation_config(sampling, max_tokens, pipe_id, self.ignore_eos)
        import numpy as np
        import openvino as ov

        handle = self._pipe.add_request(pipe_id, ov.Tensor(np.asarray([ids], dtype=np.int64)), config)
        stops = tuple(s for s in sampling.stop if s)
        live = _Live(rid, handle, len(ids), Detokenizer(self._stream_decode), StopMatcher(stops) if stops else None,
                     logprobs=sampling.logprobs)
        if request.resumed:
            resume_text(live.detok, live.stop, ids[len(ids) - request.resumed:])
        self._live[rid] = live

    # ---- iterations -----------------------------------------------------------------------

    async def step(self) -> StepResult:
        """Run exactly one pipeline iteration. Blocks (and holds the GIL) while it runs."""
        return self.step_blocking()

    def step_blocking(self) -> StepResult:
        """`step()` without the coroutine wrapper, for benchmarks and synchronous callers."""
        if self._pipe is None:
            raise EngineError(f"{self.model_name} is not loaded; await load() first")
        if not self._live and self._turns.waiting:  # the last turn ended: the next adapter's
            key, turn = self._turns.next_turn()
            self._turns.switch(self._pipe, key, self.model_name)
            for request in turn:
                self._start(request)
        if not self._live:
            raise EngineError(f"{self.model_name} has no requests; call step() only while has_work()")
        waiting = {rid for rid, r in self._live.items() if r.generated == 0}
        try:
            self._pipe.step()
        except RuntimeError as exc:  # e.g. a grammar its structured output compiler refused: the pipeline is broken
            raise EngineError(f"{self.model_name}: OpenVINO's pipeline step failed: {str(exc)[-300:]}") from exc
        outputs: list[RequestOutput] = []
        prefilled = cancelled = False
        reads = {rid: live.read() for rid, live in self._live.items()}
        self._predecode(reads)
        for rid, live in list(self._live.items()):
            token, text, reason = live.collect(reads[rid])
            outputs.append((rid, token, text, reason, live.logprob) if live.logprobs else (rid, token, text, reason))
            if token is not None or reason is not None:
                prefilled |= rid in waiting
            if reason is not None:
                cancelled |= self._finish(rid)
        if cancelled and not self._live:
            self._pipe.step()  # empty step: the pipeline frees cancelled requests' blocks now
        return step_result(IterationKind.PREFILL if prefilled else IterationKind.DECODE, outputs)

    def _predecode(self, reads: Mapping[str, list[Any] | None]) -> None:
        """Decode, in one tokenizer call, the token windows every Detokenizer.push of this
        step will ask for (its prefix window and its window with the new token). A decode
        call costs about 0.1 ms whatever the batch, and push makes two per token, which
        was about 5% of a step's time at batch 16; push then finds its text here."""
        decoded = self._decoded
        decoded.clear()
        windows: list[list[int]] = []
        for rid, outputs in reads.items():
            new = [t for out in outputs or () for t in out.generated_ids]
            if not new:
                continue
            token = new[0]  # one per step; push decodes any further ones itself
            d = self._live[rid].detok
            for window in (d.ids[d.prefix_offset:d.read_offset], d.ids[d.prefix_offset:] + [token]):
                key = tuple(window)
                if key not in decoded:
                    decoded[key] = ""
                    if window:
                        windows.append(window)
        if len(windows) > 1:
            for window, text in zip(windows, self._tokenizer.decode(windows, skip_special_tokens=True)):
                decoded[tuple(window)] = text
        elif windows:
            decoded[tuple(windows[0])] = self._encoder.decode(windows[0])

    def _stream_decode(self, token_ids: Sequence[int]) -> str:
        """The Detokenizers' decode: this step's batch-decoded text, else one decode call."""
        text = self._decoded.get(tuple(token_ids))
        return text if text is not None else self._encoder.decode(token_ids)

    def _finish(self, request_id: str) -> bool:
        """Forget a finished request; cancel it in the pipeline if only Mesh saw it end
        (a stop string). Returns whether it was cancelled."""
        import openvino_genai as ov_genai

        live = self._live.pop(request_id)
        if live.handle.get_status() != ov_genai.GenerationStatus.RUNNING:
            return False
        live.handle.cancel()
        return True

    def abort(self, request_id: str) -> None:
        """Drop a request: it produces nothing more and its KV blocks go back to the cache.

        The pipeline frees a cancelled request's blocks at its next step; if no other
        request runs, that (empty, sub-millisecond) step is taken here.
        """
        if self._turns.drop(request_id):
            return
        live = self._live.pop(request_id, None)
        if live is None:
            return
        live.handle.cancel()
        del live
        if not self._live and self._pipe is not None:
            self._pipe.step()

    def drop_requests(self) -> None:
        """Abort every request (the pipeline stays built: mesh.engines.parking)."""
        self._turns.waiting.clear()
        for request_id in list(self._live):
            self.abort(request_id)

    def has_work(self) -> bool:
        return bool(self._live) or bool(self._turns.waiting)

    # ---- memory reports -------------------------------------------------------------------

    def kv_bytes_in_use(self) -> int:
        """KV bytes the live requests hold now, in whole blocks (see the module docstring)."""
        return kv_bytes_held((r.kv_tokens for r in self._live.values()), self.block_size, self.kv_bytes_per_token)

    def kv_bytes_allocated(self) -> int:
        """Bytes the pipeline's KV cache holds (grows on demand, never shrinks; 0 if unloaded)."""
        return int(self._pipe.get_metrics().cache_size_in_bytes) if self._pipe is not None else 0

    def pipeline_metrics(self) -> Any:
        """OpenVINO's PipelineMetrics of the last step (requests, cache usage, cache bytes)."""
        if self._pipe is None:
            raise EngineError(f"{self.model_name} is not loaded")
        return self._pipe.get_metrics()

    def _prompt_encoder(self) -> PromptEncoder:
        if self._encoder is not None:
            return self._encoder
        if self._standalone_encoder is None:  # tokenizing before load: the model's tokenizer alone
            self._standalone_encoder = standalone_encoder(str(self.source.path))
        return self._standalone_encoder


def generation_config(sampling: Sampling, max_tokens: int, seed: int, ignore_eos: bool = False) -> Any:
    """OpenVINO's GenerationConfig of a request: its sampling (OpenAI semantics, penalties, the
    chosen token's log probability and a JSON schema's structured output included),
    `max_tokens`, and `seed` where the request gives none; `ignore_eos` generates exactly
    max_tokens."""
    import openvino_genai as ov_genai

    if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
        raise EngineError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature="
                          f"{sampling.temperature}, top_p={sampling.top_p}")
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = max_tokens
    config.num_return_sequences = 1
    config.ignore_eos = ignore_eos or sampling.ignore_eos
    config.logprobs = 1 if sampling.logprobs else 0  # the chosen token's, of the model's own distribution
    config.presence_penalty = sampling.presence_penalty
    config.frequency_penalty = sampling.frequency_penalty
    config.repetition_penalty = sampling.repetition_penalty
    if sampling.json_schema is not None:  # checked by the service (mesh.service.json_schema): a schema the grammar
        config.structured_output_config = ov_genai.StructuredOutputConfig(json_schema=sampling.json_schema)
    if sampling.temperature == 0:
        config.do_sample = False  # greedy
    else:
        config.do_sample = True
        config.temperature = sampling.temperature
        config.top_p = sampling.top_p
        config.top_k = 0  # OpenAI semantics: no top-k cut
        config.rng_seed = sampling.seed if sampling.seed is not None else seed
    return config


@functools.lru_cache(maxsize=32)
def standalone_encoder(path: str) -> PromptEncoder:
    """The model's tokenizer without its pipeline, built once per model file in a process:
    building it holds the GIL for seconds (2.6 s for the demo GGUF here), which would stall
    a node agent's event loop at every instance it starts. From the node's prepared
    tokenizer IR when there is one (mesh.engines.node_cache: about 0.1 s)."""
    import openvino_genai as ov_genai

    from mesh.engines.node_cache import tokenizer_path

    return PromptEncoder(ov_genai.Tokenizer(tokenizer_path(path)))


def kv_bytes_held(kv_tokens: Iterable[int], block_size: int, kv_bytes_per_token: int) -> int:
    """KV bytes of requests holding `kv_tokens` tokens each, in whole blocks. A request with
    P prompt and G >= 1 generated tokens holds P + G - 1 (its newest token's K/V is
    computed at the next step)."""
    return sum(math.ceil(t / block_size) for t in kv_tokens) * block_size * kv_bytes_per_token


def kv_precisions(device: str, properties: Mapping[str, Any]) -> tuple[str, str]:
    """Key and value cache element types the plugin will use: the properties', else its defaults."""
    both = properties.get("KV_CACHE_PRECISION")
    key = properties.get("KEY_CACHE_PRECISION", both)
    value = properties.get("VALUE_CACHE_PRECISION", both)
    if key is None or value is None:
        try:
            import openvino as ov

            core = ov.Core()
            key = key or core.get_property(device, "KEY_CACHE_PRECISION")
            value = value or core.get_property(device, "VALUE_CACHE_PRECISION")
        except Exception:  # noqa: BLE001 - a device without these properties: assume u8
            key, value = key or "u8", value or "u8"
    return _type_name(key), _type_name(value)


def _type_name(value: Any) -> str:
    name = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
    return {"uint8_t": "u8", "u8": "u8", "bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(name, name)
