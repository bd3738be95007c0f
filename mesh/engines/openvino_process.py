"""`OpenVINOProcessEngine`: one OpenVINO instance computing in its own worker process
(mesh.engines.openvino_worker), implementing mesh.engines.engine_api.Engine.

Why: OpenVINO's `step()` holds the Python GIL for the whole iteration (tens of
milliseconds to seconds). In the node agent's process that stalls its event loop, so
every call from the cluster dispatcher (admit, validate, take back, ping) waited for the
iteration in flight: 0.23-0.26 s per admission on average and up to 3.8 s in a live
replay (docs/evaluation.md). In a worker the agent answers at once while the instance
computes, and `step()` is awaited.

What stays here: the model's shape, the request checks (an unloaded `OpenVINOEngine`, the
"front"; its tokenizer is built only if `encode_*` is called here: a node agent tokenizes
in a process of its own instead, mesh.node.tokenizers), the live requests and the
KV figures of the last step (the protocol's reports are synchronous). Requests added or
aborted are sent without waiting; the worker applies them in order before the next step,
and a step's token for a request aborted meanwhile is dropped here (worker_process.WorkerRequests).
Unloading ends the worker process, which frees the weights and the KV cache at once, unless
the node parks it (mesh.engines.parking): then the worker drops its requests and waits, built and
warm, for the next load of the same model with the same settings on the node.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from mesh.engines.engine_api import EngineError, EngineRequest, StepResult, checked_request
from mesh.engines.node_cache import SourceIdentity
from mesh.engines.openvino_engine import OpenVINOEngine, kv_bytes_held
from mesh.engines.parking import ParkingLot
from mesh.engines.worker_process import WorkerConnection, WorkerRequests, wait, worker_env

_log_ids = itertools.count()


class OpenVINOProcessEngine:
    """The same arguments and behaviour as OpenVINOEngine; the pipeline runs in a worker."""

    blocks_event_loop = False  # step() awaits the worker
    runs_layer_ranges = False  # OpenVINO compiles the whole model (engine_api, layer ranges)

    def __init__(self, model_path: str | Path, *, model_name: str | None = None, context_window: int | None = None,
                 prefill_token_budget: int | None = None, max_num_seqs: int = 64, device: str = "CPU",
                 properties: Mapping[str, Any] | None = None, kv_capacity_bytes: int | None = None,
                 ignore_eos: bool = False, log_dir: str | Path | None = None,
                 on_loaded: Callable[[BaseException | None], None] | None = None,
                 cache_root: str | Path | None = None, use_node_cache: bool = True,
                 parking: ParkingLot | None = None) -> None:
        """log_dir: where the worker's output goes (default: Mesh's data folder, logs/).
        on_loaded: called once the pipeline is built and warmed up (None) or failed (the
        exception). cache_root, use_node_cache: the node's cache of prepared models
        (OpenVINOEngine; mesh.engines.node_cache). parking: the node's parked workers; a load
        adopts one built with the same settings, an unload parks its worker there."""
        self._kwargs = dict(model_path=str(model_path), model_name=model_name, context_window=context_window,
                            prefill_token_budget=prefill_token_budget, max_num_seqs=max_num_seqs, device=device,
                            properties=dict(properties or {}), kv_capacity_bytes=kv_capacity_bytes,
                            ignore_eos=ignore_eos, cache_root=None if cache_root is None else str(cache_root),
                            use_node_cache=use_node_cache)
        self.front = OpenVINOEngine(**self._kwargs)  # reads the shape; loads nothing here
        f = self.front
        self.source, self.model_name = f.source, f.model_name
        self.context_window, self.prefill_token_budget = f.context_window, f.prefill_token_budget
        self.max_num_seqs = self.max_batch = f.max_num_seqs
        self.device, self.block_size = f.device, f.block_size
        self.kv_bytes_per_token, self.weight_bytes = f.kv_bytes_per_token, f.weight_bytes
        self.vocab_size = f.source.vocab_size  # None: the model file does not say
        self.kv_capacity_bytes = kv_capacity_bytes
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.on_loaded = on_loaded
        self.parking = parking
        # A build of this very worker under way on the node (mesh.node.park_ahead): the load
        # waits for it and adopts its worker instead of building a second one beside it.
        self.parked_soon: asyncio.Future[Any] | None = None
        self.park_evicts = True  # False: its worker is parked only where it fits beside those parked (a build ahead)
        self._conn: WorkerConnection | None = None
        self._stepping = False  # a step is in the worker (a watchdog's cancelled step leaves it so)
        self._loaded = False
        self._requests = WorkerRequests(self.model_name)
        self._kv_allocated = 0
        self.loaded_from: str | None = None

    @property
    def loaded(self) -> bool:
        return self._loaded

    @property
    def worker_pid(self) -> int | None:
        return self._conn.pid if self._conn is not None else None

    # ---- memory operations -------------------------------------------------------------
    async def load(self) -> None:
        """Start the worker and build the pipeline there (and its warm-up token)."""
        if self._loaded:
            return
        if self.parked_soon is not None:
            await asyncio.wait([self.parked_soon])  # neither its failure (the builder's) nor our cancellation passes
        if not await self._adopt_parked():
            conn = self._conn = WorkerConnection("mesh.engines.openvino_worker", sys.executable, worker_env(),
                                                 self._log_path(), name="OpenVINO")
            try:
                await wait(conn.call("init", kwargs=self._kwargs))
                facts = await wait(conn.call("load"))
                self._facts(facts)
                self.loaded_from = facts.get("loaded_from")  # "gguf", "prepared" or "ir" (mesh.engines.node_cache)
            except BaseException as exc:
                await self._close()
                if self.on_loaded is not None:
                    self.on_loaded(exc)
                raise
        self._loaded = True
        if self.on_loaded is not None:
            self.on_loaded(None)

    async def unload(self) -> None:
        """End the worker, or park it (see the module docstring). Running requests are dropped."""
        self._requests.clear()
        self._loaded = False
        self._kv_allocated = 0
        if not await self._park():
            await self._close()

    def _park_key(self) -> tuple[Any, ...]:
        """What a parked worker must have been built with to serve this instance: every
        argument but the KV bound (resized on adoption), and the model file as it is now."""
        kw = {k: v for k, v in self._kwargs.items() if k != "kv_capacity_bytes"}
        path = Path(self._kwargs["model_path"])
        ident = SourceIdentity.of(path).key() if path.is_file() else str(path)
        return (ident, repr(sorted(kw.items())))

    async def _adopt_parked(self) -> bool:
        if self.parking is None:
            return False
        resize = {} if self.kv_capacity_bytes is None else {"op": "resize", "kv_bytes": self.kv_capacity_bytes}
        adopted = await self.parking.adopt(self._park_key(), **resize)
        if adopted is None:
            return False
        self._conn, facts = adopted
        self._facts(facts)
        self.loaded_from = "parked"
        return True

    async def _park(self) -> bool:
        """Hand the worker to the node's parking lot (ParkingLot.hand_over); False: end it."""
        if self.parking is None or not await self.parking.hand_over(
                self._park_key(), self.model_name, self._conn,
                lambda facts: self.weight_bytes + int(facts["kv_bytes_allocated"]), self._stepping,
                self.park_evicts):
            return False
        self._conn = None
        return True

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.shutdown(30)

    def kill_worker(self) -> None:
        """The engine hung (mesh.node.runtime's watchdog): kill its worker at once; the unload
        that follows has nothing left to wait for."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.kill()

    async def resize_kv(self, capacity_bytes: int) -> None:
        """Record the KV bound (OpenVINOEngine.resize_kv, in the worker)."""
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise EngineError(f"KV capacity must be a non-negative number of bytes, got {capacity_bytes!r}")
        self.kv_capacity_bytes = capacity_bytes
        if self._conn is not None:
            self._facts(await wait(self._conn.call("resize", kv_bytes=capacity_bytes)))

    def _facts(self, facts: Mapping[str, Any]) -> None:
        self.kv_bytes_per_token = int(facts["kv_bytes_per_token"])  # the warm-up measured it
        self._kv_allocated = int(facts["kv_bytes_allocated"])

    # ---- tokens (this process: the front's tokenizer, built on first use) ----------------
    def encode_prompt(self, prompt: str) -> list[int]:
        return self.front.encode_prompt(prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.front.encode_chat(messages)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.front.decode(token_ids)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (OpenVINOEngine.add_request's checks, here, before it is sent)."""
        if not self._loaded or self._conn is None:
            raise EngineError(f"{self.model_name} is not loaded; await load() before adding requests")
        ids = checked_request(request, model_name=self.model_name, context_window=self.context_window,
                              vocab_size=self.source.vocab_size, running=self._requests)
        self._requests.added(request.request_id, len(ids), self._conn.call("add", request=request))

    def abort(self, request_id: str) -> None:
        """Drop a request: it produces nothing more; the worker frees its KV blocks before
        the next step."""
        if self._requests.aborted(request_id) and self._conn is not None and self._conn.dead is None:
            self._conn.call("abort", rid=request_id)

    def has_work(self) -> bool:
        return bool(self._requests)

    async def step(self) -> StepResult:
        """One pipeline iteration in the worker, awaited."""
        if not self._loaded or self._conn is None:
            raise EngineError(f"{self.model_name} is not loaded; await load() first")
        refused = self._requests.refused()
        if refused is not None:
            return refused
        if not self._requests:
            raise EngineError(f"{self.model_name} has no requests; call step() only while has_work()")
        self._stepping = True
        result, self._kv_allocated = await wait(self._conn.call("step"))
        self._stepping = False
        return self._requests.apply(result)

    # ---- memory reports ----------------------------------------------------------------
    def kv_bytes_in_use(self) -> int:
        """KV bytes the live requests hold now (OpenVINOEngine.kv_bytes_in_use's rule)."""
        return kv_bytes_held((p + g - 1 if g else 0 for p, g in self._requests.live.values()), self.block_size,
                             self.kv_bytes_per_token)

    def kv_bytes_allocated(self) -> int:
        return self._kv_allocated

    # ---- the worker --------------------------------------------------------------------
    def _log_path(self) -> Path:
        if self.log_dir is None:
            from mesh.paths import data_dir

            self.log_dir = data_dir() / "logs"
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.model_name)[:60]
        return self.log_dir / f"openvino-{safe}-{os.getpid()}-{next(_log_ids)}.log"
