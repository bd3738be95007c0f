"""The node agent process: one node's NodeRuntime and engine instances behind a connection.

`python -m mesh.agent --listen HOST:PORT --node-id ID --kind cpu --memory-bytes N` listens
(TCP; `--listen unix:/path` for a Unix socket), prints `MESH_AGENT_LISTENING host:port`
on stdout, and serves one control connection at a time (a new connection replaces the old
one, whose requests are aborted). The first message must be `hello` with the token from
$MESH_AGENT_TOKEN when that is set. Messages are in mesh.wire.agent_protocol.

Everything runs on one asyncio loop: the node's token-level loop (one engine iteration at a
time, LLM-Mesh 5.1) and the connection. Engines yield after each iteration, so admissions,
aborts and pings are handled between iterations; an iteration itself holds the GIL.
Admission (`admit`) is validate + admit in one step of the loop, so it is atomic with
respect to the node's state. Token outputs of one iteration go out as one `tokens` frame.

`--exit-with-parent`: exit when stdin closes (the embedded agent dies with `mesh serve`).
`--weights-listen HOST:PORT`: also receive models' weight blocks there, into `--weights-dir`
(mesh.weights.receiver), so `load` can start an engine from weights received over the network;
the weights port requires the token in the environment variable MESH_WEIGHTS_TOKEN when it is
set (never an argument: `ps` would show it).

Closed by default:
- An agent refuses to start listening on an address other than loopback (or a Unix socket)
  without $MESH_AGENT_TOKEN, and its weights port likewise without $MESH_WEIGHTS_TOKEN:
  anyone who can reach the port could otherwise load models and run requests.
- `load` opens only files inside the agent's model folders: its weights folder
  (`--weights-dir`, default DATA/received/NODE_ID) and each `--models-root DIR` (the
  embedded agents of `mesh serve` get the service's data folder, its --allowed-dir, its
  --profile-dir and the demo model cache). A path elsewhere, or a symlink leading out, is
  refused as bad_request; so is a `profile` (a calibration file) outside them.
- Every file it creates is its user's only: the agent sets umask 077 at start.
- An unexpected exception in a handler answers that message with `failed` and leaves the
  connection and every other request as they were.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import logging
import os
import signal
import shutil
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from mesh.engines.engine_api import EngineError, EngineRequest, Sampling
from mesh.node.emulation import ENGINE as EMULATED, Emulation, model_of_profile
from mesh.node.engine_host import iteration_times, make_engine
from mesh.node.learning import NodeLearning
from mesh.perf.model import PerformanceModel
from mesh.perf.profile import profile_to_dict
from mesh.perf.times import AdaptiveTimes
from mesh.wire.agent_protocol import (
    MAX_BATCH,
    MAX_BYTES,
    PROTOCOL_VERSION,
    READY_PREFIX,
    AdmitEntry,
    Code,
    DoneEvent,
    EvictedEvent,
    NodeEvent,
    InstanceEvent,
    InstanceSpec,
    Probe,
    Progress,
    ProtocolError,
    TokensEvent,
    encode_frame,
    mean_output_from,
    read_frame,
    read_hello,
    count_field,
    number_field,
    slo_from_dict,
    window,
)
from mesh.engines.background_prepare import NEXT_LOAD_S, BackgroundPreparer
from mesh.engines.worker_process import die_with_parent, worker_env
from mesh.engines.openvino_process import OpenVINOProcessEngine
from mesh.engines.parking import ParkingLot
from mesh.node.park_ahead import ParkAhead
from mesh.node.tokenizer_worker import DEFAULT_CACHE_BYTES
from mesh.node.tokenizers import TokenizerProcess, prompt_size
from mesh.framing import ConnectionGate, UndecodableFrame, is_message_id
from mesh.perf.speed import MachineSpeed
from mesh.policy.kv_demand import RunningMean
from mesh.policy.shadow import FailureCase
from mesh.policy.slo import DeadlineRule
from mesh.engines.simulated import SIMULATED_NOISE
from mesh.node.runtime import HUNG_MIN_S, InstancePlan, NodeRuntime, NodeSpec
from mesh.node.request import Outcome, ServedRequest
from mesh.weights.blocks import Manifest, holds
from mesh.weights.receiver import NodeWeightsReceiver, inside, parse_listen, received_path
from mesh.weights.peer import token_from_env

log = logging.getLogger("mesh.agent")

MEAN_OUTPUT_PRIOR = 128  # O_avg before an instance has finished any request (LLM-Mesh 6.1)
EXPECTED_LOAD_S = 5.0  # what shadow validation assumes while an instance loads
TOKENIZER_HOLDER = "tokenizers"  # the tokenizer worker's cache in the node's memory budget


class Reply(Exception):
    """Raised by a handler to answer ok=false with a code."""

    def __init__(self, code: Code, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code, self.extra = code, extra


class AgentServer:
    """Serves one node: its runtime, instances, and one control connection."""

    def __init__(self, spec: NodeSpec, token: str | None = None, cpu: dict[str, Any] | None = None,
                 weights: NodeWeightsReceiver | None = None, load_roots: Sequence[str | Path] = (),
                 deadlines: DeadlineRule = DeadlineRule.EQ1, emulation: Emulation | None = None,
                 park_bytes: int = 0, watchdog_min_s: float = HUNG_MIN_S, tokenizer_bytes: int = 0) -> None:
        """`load_roots`: folders whose files `load` may open, besides the weights receiver's.
        `park_bytes`: memory, beside the planned budget, for OpenVINO workers parked when their
        instance stops (mesh.engines.parking; 0: none parked).
        `deadlines`: when tokens after the first are due (mesh.policy.slo); the service's
        default is the paper's Eq. 1. `emulation`: this node emulates its device (`--emulate`):
        it runs emulated models only (mesh.node.emulation); without it, it refuses them.
        `watchdog_min_s`: the engine watchdog's floor (mesh.node.runtime.hung_bound_s): an
        iteration that runs past max(this, 20 x its predicted time) has hung.
        `tokenizer_bytes`: the tokenizer worker's cache at most (mesh.node.tokenizer_worker),
        reserved in the node's memory budget (a holder of its own, `TOKENIZER_HOLDER`), so
        instances are planned around it (0: nothing reserved, the worker's default bound)."""
        self.spec = spec
        self.emulation = emulation
        self.weights = weights  # receives model blocks over the network (None: not hosted)
        if weights is not None and spec.kind == "cpu":
            weights.on_saved = self._received
        self.load_roots = [Path(r) for r in load_roots] + ([Path(weights.root)] if weights is not None else [])
        if weights is not None:  # it sends, as a multicast's source, only files `load` may open
            weights.source_roots = self.load_roots
        self.token = token
        self.cpu = cpu or {}
        self.node = NodeRuntime(spec, on_evict=self._on_evict, record_iterations=True, deadlines=deadlines,
                                watchdog=True, hung_min_s=watchdog_min_s)  # a hung engine fails its instance;
        # its requests move
        self.node.on_loaded = self._ready
        self.node.on_hung = self._hung
        self.node.on_stepping = self._stepping
        self._node_sent: NodeEvent | None = None  # the last `node` event this connection was told
        self.times: dict[str, AdaptiveTimes] = {}  # instance id -> its iteration times
        self.learning = NodeLearning()  # the machine's speed and per-model times (issue 23)
        self._speed_probe: asyncio.Future | None = None
        self.specs: dict[str, InstanceSpec] = {}
        # Unloaded engines by (engine, path, window): a model's shape and tokenizer before
        # any instance of it runs here (`describe`, `tokenize` by path).
        self.fronts: dict[tuple[str, str, int | None], Any] = {}
        self._front_models: dict[tuple[str, str, int | None], str] = {}  # front key -> the model it was built for
        self._means: dict[str, RunningMean] = {}  # O_avg per model (_mean_output)
        self._gate = ConnectionGate()  # connections waiting for their hello
        # OpenVINO prompts are tokenized off this process's GIL; every prompt takes its turn there
        self.tokenizers = TokenizerProcess(tokenizer_bytes) if tokenizer_bytes > 0 else TokenizerProcess()
        if tokenizer_bytes > 0:
            station = self.node.memory.station
            issued = station.issue(TOKENIZER_HOLDER, tokenizer_bytes)
            if issued.op is None:
                raise ValueError(f"the tokenizer cache ({tokenizer_bytes} bytes) does not fit the node's memory "
                                 f"({spec.memory_bytes} bytes)")
            station.complete(issued.op.op_id)
        self.parking = ParkingLot(park_bytes)  # stopped OpenVINO instances, built and warm (issue 23)
        self.preparer = BackgroundPreparer()  # GGUFs loaded here are prepared once, for the next loads (issue 23)
        # models described here are built once before their first request and parked (issue 23)
        self.ahead = ParkAhead(self.parking, lambda spec: asyncio.to_thread(make_engine, spec, lambda _exc: None),
                               lambda: not self.node.instances and not self.specs)
        self._tokenizers_ready: dict[str, asyncio.Future] = {}  # loading OpenVINO instance -> its tokenizer's build
        self._tokenizer_builds: set[asyncio.Future] = set()  # models described here: their tokenizers' builds
        self._tokenizing: dict[str, asyncio.Task] = {}  # request id -> the task tokenizing it (abort cancels it)
        self._tokenize_aborted: dict[str, bool] = {}
        self.requests: dict[str, ServedRequest] = {}
        self.started_at = 0.0
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: list[dict[str, Any]] = []
        self._flush_scheduled = False
        self._stopped = asyncio.Event()
        self._handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
            "ping": self._ping, "hello": self._hello, "load": self._load, "unload": self._unload,
            "tokenize": self._tokenize, "admit": self._admit, "abort": self._abort,
            "stats": self._stats, "shutdown": self._shutdown, "weights_path": self._weights_path,
            "weights_drop": self._weights_drop, "validate": self._validate, "validate_group": self._validate_group,
            "validate_new": self._validate_new, "take_back": self._take_back, "describe": self._describe,
            "forget": self._forget,
        }

    # ---- lifecycle ---------------------------------------------------------------------
    async def serve(self, listen: str) -> str:
        """Start listening; return the address actually bound ("host:port" or "unix:path")."""
        loop = asyncio.get_running_loop()
        self.started_at = loop.time()
        if self.spec.kind == "cpu" and self.emulation is None:
            # OpenVINO's first import and CPU-plugin load hold the GIL for as long as the disk
            # takes to read its libraries: here, before the agent answers anyone, not inside a
            # first `load` whose heartbeat could then go unanswered
            await asyncio.to_thread(_warm_openvino)
        if self.spec.kind == "cpu":  # know the machine from its first minute (issue 23 item 4): 0.4-2 s,
            # in the background: a load before it ends starts from the prior's factors
            self._speed_probe = asyncio.ensure_future(self._probe_speed())
        self.node.start()
        if self.weights is not None:
            await self.weights.start()
        if listen.startswith("unix:"):
            path = listen[len("unix:"):]
            self._server = await asyncio.start_unix_server(self._connection, path, limit=2**20)
            return listen
        host, _, port = listen.rpartition(":")
        self._server = await asyncio.start_server(self._connection, host or "127.0.0.1", int(port), limit=2**20)
        bound = self._server.sockets[0].getsockname()
        return f"{bound[0]}:{bound[1]}"

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()

    async def close(self) -> None:
        self._server.close()
        if self._speed_probe is not None:
            self._speed_probe.cancel()
        if self.weights is not None:
            await self.weights.close()
        self._abort_all(f"node agent {self.spec.node_id} is shutting down")  # its requests end at once, before the workers do
        self._flush()
        await self.ahead.close()
        await self.tokenizers.close()
        await self.preparer.close()
        await self.parking.close()  # parks nothing after: the instances' workers end below
        await self.node.stop()
        for iid in list(self.node.instances):
            inst = self.node.instances[iid]
            try:
                await inst.engine.unload()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass

    # ---- the connection ------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if not self._gate.enter():  # too many connections not yet authenticated
            writer.close()
            return
        try:  # authentication first: a small hello, soon (mesh.framing)
            first = await read_hello(reader)
        except (ProtocolError, ConnectionError) as exc:
            log.warning("control connection from %s refused before hello: %s", peer, exc)
            writer.close()
            return
        finally:
            self._gate.leave()
        if first is None or first.get("t") != "hello" or not self._token_ok(first.get("token")):
            if first is not None and "id" in first:
                writer.write(encode_frame({"t": "reply", "re": first["id"], "ok": False, "code": Code.UNAUTHORIZED.value,
                                           "error": "hello first, with the agent token ($MESH_AGENT_TOKEN)"}))
            writer.close()
            return
        if self._writer is not None:  # a new control connection replaces the old one
            log.warning("a new control connection from %s replaces the current one", peer)
            self._abort_all("the control connection was replaced")
            self._flush()
            self._writer.close()
        self._writer = writer
        self._node_sent = None  # the new connection is told the node's state
        self._dispatch(first)
        try:
            while True:
                try:
                    message = await read_frame(reader)
                except UndecodableFrame as exc:  # a whole frame that is no message: answered, the rest goes on
                    log.warning("control connection from %s sent a message that does not decode: %s", peer, exc)
                    self._refuse(exc.message_id, exc)
                    continue
                if message is None:
                    break
                self._dispatch(message)
                if writer.transport.get_write_buffer_size() > 2**20:
                    await writer.drain()
        except (ProtocolError, ConnectionError) as exc:
            log.warning("control connection from %s failed: %s", peer, exc)
        except asyncio.CancelledError:  # the agent is shutting down
            pass
        finally:
            if self._writer is writer:
                self._writer = None
                self._abort_all("the control connection was lost")
            writer.close()

    def _token_ok(self, token: Any) -> bool:
        if not self.token:
            return True
        return isinstance(token, str) and hmac.compare_digest(token.encode(), self.token.encode())

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("t")
        mid = message.get("id")
        if mid is not None and not is_message_id(mid):  # no reply can name it: dropped
            log.warning("a %s message with a bad id %.80r (an integer in [0, 2^63) expected) is dropped", kind, mid)
            return
        handler = self._handlers.get(kind)
        try:
            if handler is None:
                raise Reply(Code.PROTOCOL, f"unknown message type {kind!r}")
            result = handler(message)
        except (Reply, ProtocolError) as exc:
            self._refuse(mid, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bug in one handler fails that call, not the connection
            self._failed(mid, kind, exc)
            return
        if asyncio.iscoroutine(result):
            asyncio.get_running_loop().create_task(self._finish_async(mid, result))
        elif mid is not None:
            self._send({"t": "reply", "re": mid, "ok": True, **(result or {})})

    def _refuse(self, mid: Any, exc: Exception) -> None:
        """Answer a message that was refused (Reply) or malformed (ProtocolError)."""
        if mid is None:
            return
        if isinstance(exc, Reply):
            self._send({"t": "reply", "re": mid, "ok": False, "code": exc.code.value, "error": str(exc), **exc.extra})
        else:
            self._send({"t": "reply", "re": mid, "ok": False, "code": Code.PROTOCOL.value, "error": str(exc)})

    async def _finish_async(self, mid: Any, coro: Any) -> None:
        try:
            result = await coro
        except (Reply, ProtocolError) as exc:
            self._refuse(mid, exc)
            return
        except Exception as exc:  # noqa: BLE001 - any failure is answered, never lost
            self._failed(mid, None, exc)
            return
        if mid is not None:
            self._send({"t": "reply", "re": mid, "ok": True, **(result or {})})

    def _failed(self, mid: Any, kind: Any, exc: Exception) -> None:
        """Answer a message whose handler raised unexpectedly: `failed`, with the exception."""
        log.exception("handler of %s failed", kind or "a message", exc_info=exc)
        if mid is not None:
            self._send({"t": "reply", "re": mid, "ok": False, "code": Code.FAILED.value,
                        "error": f"{type(exc).__name__}: {exc}"})

    def _send(self, message: dict[str, Any]) -> None:
        """Queue a message; everything queued in one loop turn goes out together."""
        if message.get("t") == "tokens" and self._outbox and self._outbox[-1].get("t") == "tokens":
            self._outbox[-1]["items"].extend(message["items"])
        else:
            self._outbox.append(message)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _node_state(self) -> NodeEvent:
        return NodeEvent(self.node.stepping, self.node.memory.station.budget)

    def _stepping(self, instance_id: str | None) -> None:
        """The node's loop started (an instance) or ended (None) an iteration: the service is
        told at the next flush, if the node's state changed by then (an instance that steps
        again right after its own iteration sends nothing). An engine that holds the loop
        while it steps (a real one) would delay that flush past its iteration: its start
        goes out now."""
        if self._writer is None or self._node_state() == self._node_sent:
            return
        inst = self.node.instances.get(instance_id or "")
        if inst is not None and getattr(inst.engine, "blocks_event_loop", False):
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._learn_times()
        state = self._node_state()
        if self._writer is not None and state != self._node_sent:
            self._node_sent = state  # after the frames (replies, tokens) of what changed it
            self._outbox.append(state.to_message())
        outbox, self._outbox = self._outbox, []
        if self._writer is None or not outbox:
            return
        frames = []
        for m in outbox:  # one message that cannot be encoded (a bug) must not take the others with it
            try:
                frames.append(encode_frame(m))
            except Exception:  # noqa: BLE001
                log.exception("cannot encode a %r message for the control service; dropped", m.get("t"))
        try:
            self._writer.write(b"".join(frames))
        except (ConnectionError, RuntimeError) as exc:
            log.warning("cannot write to the control connection: %s", exc)

    def _learn_times(self) -> None:
        records = self.node.iterations
        if not records:
            return
        for rec in records:
            times = self.times.get(rec.instance_id)
            if times is not None:
                times.observe(rec.kind, rec.predicted_s, rec.duration_s, rec.batch_size, rec.tokens)
        records.clear()

    # ---- handlers ------------------------------------------------------------------------
    def _ping(self, m: dict[str, Any]) -> dict[str, Any]:
        return {}

    def _hello(self, m: dict[str, Any]) -> dict[str, Any]:
        if m.get("protocol") not in (None, PROTOCOL_VERSION):
            raise Reply(Code.PROTOCOL, f"protocol {m.get('protocol')} is not supported; this agent speaks {PROTOCOL_VERSION}")
        return {"node_id": self.spec.node_id, "kind": self.spec.kind, "memory_bytes": self.spec.memory_bytes,
                "cpu": self.cpu, "pid": os.getpid(), "protocol": PROTOCOL_VERSION,
                "deadlines": self.node.deadlines.value,
                "emulate": self.emulation.device if self.emulation is not None else None,
                "weights": self.weights.info() if self.weights is not None else None,
                "instances": [self._instance_view(i) for i in self.node.instances.values()]}

    async def _load(self, m: dict[str, Any]) -> dict[str, Any]:
        spec = InstanceSpec.from_message(m)
        self._check_engine(spec.engine)
        if spec.engine != EMULATED:
            self._check_path(spec.path)
        if spec.instance_id in self.node.instances or spec.instance_id in self.specs:
            raise Reply(Code.BAD_REQUEST, f"instance {spec.instance_id} already exists on {self.spec.node_id}")
        slo = slo_from_dict(spec.slo)
        self.specs[spec.instance_id] = spec  # reserve the id while the engine is built
        try:
            try:
                engine = (self._emulated(spec) if spec.engine == EMULATED else
                          await asyncio.to_thread(make_engine, spec, lambda exc: self._loaded(spec.instance_id, exc)))
                if hasattr(engine, "parking"):  # OpenVINO and vLLM workers park when they stop (mesh.engines.parking)
                    engine.parking = self.parking
                if isinstance(engine, OpenVINOProcessEngine):  # its tokenizer is built while it loads
                    engine.parked_soon = self.ahead.pending(spec.model)  # or adopted from a build under way
                    tokenizer = asyncio.ensure_future(self.tokenizers.prepare(spec.path))
                    tokenizer.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure shows at tokenize
                    self._tokenizers_ready[spec.instance_id] = tokenizer
                times = self.learning.adopt(spec.model, self._times(spec, engine.weight_bytes))
            except EngineError as exc:
                raise Reply(Code.BAD_REQUEST, str(exc)) from exc
            issued = self.node.start_instance(spec.instance_id, spec.model, engine, times, slo,
                                              self._mean_output(spec.model, spec.mean_output),
                                              EXPECTED_LOAD_S if spec.expected_load_s is None else spec.expected_load_s)
            if not issued.accepted:
                raise Reply(Code.MEMORY, f"node {self.spec.node_id} memory budget is short by "
                            f"{issued.shortfall_bytes / 2**20:.0f} MiB to load {spec.model}",
                            shortfall_bytes=issued.shortfall_bytes)
        except BaseException:
            self.specs.pop(spec.instance_id, None)
            raise
        self.times[spec.instance_id] = times
        return {"weight_bytes": engine.weight_bytes, "kv_bytes_per_token": engine.kv_bytes_per_token,
                "context_window": engine.context_window}

    def _ready(self, instance_id: str) -> None:
        """The node runtime has the instance loaded (its engine loaded and its KV cache sized:
        it can be given requests now); an OpenVINO instance is reported ready once its
        tokenizer is built too. (The engine's own callback comes before the KV sizing: a
        `ready` sent then let the service's next call find the instance still loading.)"""
        tokenizer = self._tokenizers_ready.pop(instance_id, None)
        inst = self.node.instances.get(instance_id)
        source = str(getattr(inst.engine, "loaded_from", None) or "") if inst is not None else ""
        ready = InstanceEvent(instance_id, "ready", loaded_from=source).to_message()  # the service measures its load
        if tokenizer is None or tokenizer.done():
            self._send(ready)
        else:
            tokenizer.add_done_callback(lambda _f: self._send(ready))

    def _received(self, path: str) -> None:
        """A model's file arrived here (its first host copy, or a multicast for a scale-out):
        prepare it now, in the background, so that the first load here already reads the
        node's prepared IR (issue 23 item 1; a file that is not a GGUF, or is prepared, is
        left alone)."""
        try:
            self.preparer.schedule(path)
        except Exception as exc:  # noqa: BLE001 - preparation is an optimisation; the load reads the GGUF
            log.warning("cannot prepare received %s: %s", path, exc)

    def _loaded(self, instance_id: str, exc: BaseException | None) -> None:
        """The engine's load callback: a failure is reported here (success by `_ready`)."""
        if exc is None:
            spec = self.specs.get(instance_id)
            if spec is not None and spec.engine == "openvino":  # loaded: prepare its GGUF for the next loads,
                # which come no sooner than its instance stops (after models a first load still waits for)
                self.preparer.schedule(spec.path, asyncio.get_running_loop().time() + NEXT_LOAD_S)
            return
        self._tokenizers_ready.pop(instance_id, None)
        log.error("loading instance %s failed: %s", instance_id, exc)
        self._send(InstanceEvent(instance_id, "failed", f"{exc}").to_message())
        asyncio.get_running_loop().call_soon(self._drop_instance, instance_id)

    def _hung(self, instance_id: str, why: str) -> None:
        """The node's watchdog failed a hung instance (its requests went back as evictions,
        sent before this): the service forgets it and places new ones where needed."""
        self._send(InstanceEvent(instance_id, "failed", why).to_message())
        self.specs.pop(instance_id, None)
        self.times.pop(instance_id, None)

    def _drop_instance(self, instance_id: str) -> None:
        inst = self.node.instances.get(instance_id)
        if inst is None:
            return
        for rid in list(inst.requests):
            self.node.abort(rid, Outcome.FAILED, f"instance {instance_id} failed to load")
        self.node.stop_instance(instance_id)
        self.specs.pop(instance_id, None)
        self.times.pop(instance_id, None)

    def _unload(self, m: dict[str, Any]) -> dict[str, Any]:
        iid = str(m.get("instance_id"))
        inst = self.node.instances.get(iid)
        if inst is None:
            raise Reply(Code.NO_INSTANCE, f"no instance {iid} on {self.spec.node_id}")
        if inst.requests:
            raise Reply(Code.BUSY, f"instance {iid} still serves {len(inst.requests)} requests")
        self.node.stop_instance(iid)
        self.specs.pop(iid, None)
        self.times.pop(iid, None)
        return {}

    def _ready_instance(self, iid: Any) -> Any:
        inst = self.node.instances.get(str(iid))
        if inst is None:
            raise Reply(Code.NO_INSTANCE, f"no instance {iid} on {self.spec.node_id}")
        if not inst.loaded:
            raise Reply(Code.NOT_READY, f"instance {iid} is still loading")
        return inst

    async def _tokenize(self, m: dict[str, Any]) -> dict[str, Any]:
        """A prompt's ids with the tokenizer of an instance (`instance_id`) or, before any
        instance runs here, of the model at `path`. With a `request_id`, an `abort` of that
        request cancels it (its tokenizer job is dropped if it has not run); `tenant` takes
        its turn in the tokenizer's queue (mesh.node.tokenizers)."""
        rid = m.get("request_id")
        if rid is None:
            return await self._tokenize_now(m)
        rid = str(rid)
        self._tokenizing[rid] = asyncio.current_task()
        try:
            return await self._tokenize_now(m)
        except asyncio.CancelledError:
            if self._tokenize_aborted.pop(rid, False):
                raise Reply(Code.FAILED, f"tokenizing {rid} was aborted by the control service") from None
            raise
        finally:
            self._tokenizing.pop(rid, None)
            self._tokenize_aborted.pop(rid, None)

    async def _tokenize_now(self, m: dict[str, Any]) -> dict[str, Any]:
        iid = m.get("instance_id")
        if iid is not None:
            engine, spec = self._ready_instance(iid).engine, self.specs[str(iid)]
        else:
            engine = await self._front(m)
            spec = InstanceSpec("front", "model", str(m.get("path")), engine.context_window,
                                engine=str(m.get("engine") or "openvino"))
        messages, prompt, tenant = m.get("messages"), m.get("prompt"), str(m.get("tenant") or "")
        try:
            if spec.engine == "openvino":
                ids = await self.tokenizers.encode(spec.path, messages, prompt, tenant)
            elif spec.engine == EMULATED:  # no tokenizer to run (mesh.node.emulation)
                ids = engine.encode_chat(messages) if messages is not None else engine.encode_prompt(prompt)
            else:  # vLLM's, in its engine's worker: its turn in the node's queue, off this loop (tokenizers)
                ids = await self.tokenizers.run(
                    tenant, prompt_size(messages, prompt),
                    (lambda: engine.encode_chat(messages)) if messages is not None else
                    (lambda: engine.encode_prompt(prompt)))
        except EngineError as exc:
            raise Reply(Code.BAD_REQUEST, str(exc)) from exc
        return {"ids": ids}

    async def _describe(self, m: dict[str, Any]) -> dict[str, Any]:
        engine = await self._front(m)
        shape = {"weight_bytes": engine.weight_bytes, "kv_bytes_per_token": engine.kv_bytes_per_token,
                 "context_window": engine.context_window, "vocab_size": getattr(engine, "vocab_size", None)}
        if str(m.get("engine")) == EMULATED and self.emulation is not None:  # the dispatcher plans with it too
            shape["profile"] = profile_to_dict(self.emulation.profile(str(m.get("path"))))
        return shape

    async def _front(self, m: dict[str, Any]) -> Any:
        """The unloaded engine of the model at m's path (built once: it reads the model's
        shape and tokenizer, loads no weights)."""
        try:
            spec = InstanceSpec("front", str(m.get("model") or "model"), str(m.get("path")),
                                window(m.get("context_window")), engine=str(m.get("engine") or "openvino"))
            max_num_seqs = count_field(m.get("max_num_seqs") or 64, "max_num_seqs", 1, MAX_BATCH)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"bad {m.get('t')} message: {exc}") from exc
        self._check_engine(spec.engine)
        if spec.engine != EMULATED:
            self._check_path(spec.path)
        key = (spec.engine, spec.path, spec.context_window)
        self._front_models.setdefault(key, spec.model)  # whose front it is (forget)
        if key not in self.fronts:
            try:
                front = (self._emulated(spec) if spec.engine == EMULATED else
                         await asyncio.to_thread(make_engine, spec, lambda _exc: None))
            except EngineError as exc:
                raise Reply(Code.BAD_REQUEST, str(exc)) from exc
            if key not in self._front_models:  # its model was forgotten while it was made: nothing of it is kept
                getattr(front, "kill_worker", lambda: None)()
                raise Reply(Code.BAD_REQUEST, f"model {spec.model} was deleted while it was described")
            self.fronts[key] = front
            if isinstance(self.fronts[key], OpenVINOProcessEngine):
                # a model new to this node (described at registration, or at its first request):
                # its tokenizer is built now, in the background, not in its first requests' TTFT
                built = asyncio.ensure_future(self.tokenizers.prepare(spec.path))
                self._tokenizer_builds.add(built)  # a reference: the loop keeps only weak ones
                built.add_done_callback(self._tokenizer_builds.discard)
                built.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure shows at tokenize
                # and the instance a load would build is built now and parked (mesh.node.park_ahead)
                ahead = InstanceSpec(f"ahead-{spec.model}", spec.model, spec.path, spec.context_window,
                                     max_num_seqs=max_num_seqs,
                                     exact_moves=bool(m.get("exact_moves", False)))
                self.ahead.schedule(ahead, lambda: self._prepared_after(built, spec.path))
        return self.fronts[key]

    async def _prepared_after(self, tokenizer: asyncio.Future, path: str) -> None:
        """Until the model's tokenizer is built and its background preparation (the IR a
        build reads) has ended; not other models' preparations, which may take minutes."""
        await asyncio.wait([tokenizer])
        await self.preparer.wait(path)

    def _check_engine(self, engine: str) -> None:
        """An emulating node runs emulated models only, and only an emulating node runs them."""
        if engine == EMULATED and self.emulation is None:
            raise Reply(Code.BAD_REQUEST, f"node {self.spec.node_id} does not emulate: it runs no emulated models "
                        "(start its agent with --emulate DEVICE, or the service with mesh serve --emulate)")
        if engine != EMULATED and self.emulation is not None:
            raise Reply(Code.BAD_REQUEST, f"node {self.spec.node_id} emulates {self.emulation.device}: it runs "
                        f"emulated models only, not {engine} ones")

    def _emulated(self, spec: InstanceSpec) -> Any:
        """An emulated instance of the catalog model `spec.path` on this node's device."""
        assert self.emulation is not None
        return self.emulation.engine(spec.instance_id, spec.path, spec.model, spec.context_window,
                                     spec.max_num_seqs, spec.emulated_load_s)

    def _times(self, spec: InstanceSpec, weight_bytes: int) -> AdaptiveTimes:
        """The instance's predicted iteration times: an emulated model's from its catalog
        profile on this device (the profile its engine keeps), else mesh.node.engine_host'."""
        name = model_of_profile(spec.profile)
        if name is None:
            if spec.profile:  # a calibration file: read only from the agent's own folders, as models are
                self._check_path(spec.profile)
            return iteration_times(spec, weight_bytes)
        if self.emulation is None:
            raise EngineError(f"node {self.spec.node_id} does not emulate: it has no times for {spec.profile}")
        # An emulated engine keeps its profile's times (mesh.engines.emulated.WallPace), noise aside:
        # nothing to learn (what it would learn is this host's lag), so its validation plans
        # with the profile and the node's margin, as the replay's does.
        return AdaptiveTimes(PerformanceModel(self.emulation.profile(name)), alpha=0.0, prefill_alpha=0.0,
                             margin_after=EMULATED_NEVER_LEARNS)

    def _mean_output(self, model: str, state: tuple[float, int, float] | None, keep: bool = True) -> RunningMean:
        """O_avg of `model` on this node: one mean shared by its instances and plans (6.1),
        set to the control service's state where a message brings it (the service's counts
        every node's completions; this node's own are added here until the next one).
        `keep=False` (a plan validated, no instance here): a model new here is not kept (a
        deleted model's plan validated after its forget would keep its mean)."""
        mean = self._means.get(model)
        if mean is None:
            mean = RunningMean(MEAN_OUTPUT_PRIOR)
            if keep:
                self._means[model] = mean
        if state is not None:
            mean.prior, mean.count, mean.total = state
        return mean

    async def _probe_speed(self) -> None:
        """The speed probe, in a short-lived process of its own: its BLAS threads (which keep
        spinning after a GEMM) then never compete with this agent's event loop, which they
        did, here, long enough to miss a heartbeat."""
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mesh.node.speed_probe", stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL, env=worker_env(), preexec_fn=die_with_parent)
            out, _ = await asyncio.wait_for(proc.communicate(), 120)
            speed = json.loads(out)["speed"]
            self.learning.set_speed(MachineSpeed(**{**speed, "cores": tuple(speed.get("cores", ()))}))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the probe only sets a starting point
            log.warning("the speed probe failed (instances start from the prior): %s", exc)
        finally:
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()

    def _check_path(self, path: str) -> None:
        if not any(inside(root, path) for root in self.load_roots):
            roots = ", ".join(str(r) for r in self.load_roots) or "none"
            raise Reply(Code.BAD_REQUEST, f"{path} is outside this agent's model folders ({roots}); send the "
                        "model to the node (weights plane) or start the agent with --models-root DIR")

    def _admit(self, m: dict[str, Any]) -> dict[str, Any]:
        batch = m.get("requests")
        if not isinstance(batch, list):
            raise ProtocolError("admit needs a list 'requests'")
        refused: dict[str, str] = {}  # instance -> why an earlier request was refused this round
        return {"results": [self._admit_one(r, refused) for r in batch]}

    def _admit_one(self, r: dict[str, Any], refused: dict[str, str]) -> dict[str, Any]:
        try:
            entry = AdmitEntry.from_dict(r)
        except ProtocolError as exc:
            return {"ok": False, "code": Code.PROTOCOL.value, "reason": str(exc)}
        rid, iid, done, prompt_len = entry.request_id, entry.instance_id, entry.done, entry.prompt_len
        inst = self.node.instances.get(iid)
        if inst is None:
            return {"ok": False, "code": Code.NO_INSTANCE.value, "reason": f"no instance {iid} on {self.spec.node_id}"}
        if rid in self.requests:
            return {"ok": False, "code": Code.BAD_REQUEST.value, "reason": f"request {rid} is already running"}
        if iid in refused:  # an earlier request of this round was refused: keep arrival order
            return {"ok": False, "code": Code.REFUSED.value, "reason": refused[iid]}
        if inst.batch_size >= getattr(inst.engine, "max_batch", 1 << 30):
            refused[iid] = f"instance {iid} runs its maximum batch of {inst.batch_size}"
            return {"ok": False, "code": Code.BATCH_FULL.value, "reason": refused[iid]}
        req = ServedRequest(EngineRequest(rid, prompt_len, entry.sampling, entry.prompt_token_ids), inst.model,
                            _since(entry.age_s), inst.slo, on_output=self._on_output, on_done=self._on_done,
                            tokens_out=done, first_token_s=_since(entry.first_token_age_s), late_s=entry.late_s)
        if prompt_len + done + 1 > inst.engine.context_window:
            return {"ok": False, "code": Code.BAD_REQUEST.value,
                    "reason": f"prompt of {prompt_len + done} tokens exceeds the context window of {inst.engine.context_window}"}
        admission = self.node.validate(iid, req, compute=entry.compute)
        if not admission.ok:
            reason = admission.reason()
            if not _only_own_prefill_late(admission):
                # The node is full for this instance: later requests wait behind this one.
                # A request refused only because its own first token would be late does not
                # block the rest: one with more slack may still fit.
                refused[iid] = reason
            return {"ok": False, "code": Code.REFUSED.value, "reason": reason}
        try:
            self.node.admit(iid, req, admission)
        except EngineError as exc:
            return {"ok": False, "code": Code.BAD_REQUEST.value, "reason": str(exc)}
        self.requests[rid] = req
        return {"ok": True}

    # ---- the cluster dispatcher's verbs (mesh.control.cluster_node) -------------------------
    def _probe(self, r: Any, slo: Any) -> ServedRequest:
        """A request as validation sees it: its prompt length, output limit, age (time since
        it arrived, the ST of Eq. 1) and the tokens it already produced elsewhere."""
        probe = Probe.from_dict(r)
        req = ServedRequest(EngineRequest(probe.request_id, probe.prompt_len, Sampling(max_tokens=probe.max_tokens)),
                            "", _since(probe.age_s), slo, late_s=probe.late_s)
        req.tokens_out = probe.done
        req.first_token_s = _since(probe.first_token_age_s)
        return req

    @staticmethod
    def _verdict(admission: Any) -> dict[str, Any]:
        return {"admit": admission.ok, "reason": admission.reason()}

    def _validate(self, m: dict[str, Any]) -> dict[str, Any]:
        """Would the request meet its SLO on the instance, with the instances in `exclude`
        preempted first (shadow validation, 5.3, 6.4, 7.1)? Changes nothing."""
        inst = self._instance(m.get("instance_id"))
        exclude = [str(i) for i in m.get("exclude") or () if str(i) in self.node.instances]
        req = self._probe(m.get("request"), inst.slo)
        return self._verdict(self.node.validate(inst.instance_id, req, exclude=exclude))

    def _validate_group(self, m: dict[str, Any]) -> dict[str, Any]:
        inst = self._instance(m.get("instance_id"))
        reqs = [self._probe(r, inst.slo) for r in m.get("requests") or ()]
        return self._verdict(self.node.validate_group(inst.instance_id, reqs, [r.tokens_out for r in reqs]))

    def _validate_new(self, m: dict[str, Any]) -> dict[str, Any]:
        """Would a new instance of the planned model, started now with its cold start, serve
        all of `requests`? Times: the plan's profile, else the default for its weights."""
        try:
            p = m["plan"]
            slo = slo_from_dict(p["slo"])
            spec = InstanceSpec(str(p["instance_id"]), str(p["model"]), "",
                                count_field(p["context_window"], "context_window", 1),
                                profile=p.get("profile") if isinstance(p.get("profile"), str) else None)
            weight_bytes = count_field(p["weight_bytes"], "weight_bytes", 0, MAX_BYTES)
            times = self._times(spec, weight_bytes)
            plan = InstancePlan(spec.instance_id, spec.model, times, slo,
                                count_field(p["kv_bytes_per_token"], "kv_bytes_per_token", 0, MAX_BYTES), weight_bytes,
                                spec.context_window, spec.context_window,
                                count_field(p["max_batch"], "max_batch", 1, MAX_BATCH),
                                self._mean_output(spec.model, mean_output_from(p.get("mean_output")), keep=False),
                                number_field(p["expected_load_s"], "expected_load_s"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"bad validate_new plan: {exc}") from exc
        except EngineError as exc:
            raise Reply(Code.BAD_REQUEST, str(exc)) from exc
        reqs = [self._probe(r, slo) for r in m.get("requests") or ()]
        return self._verdict(self.node.validate_new(plan, reqs, [r.tokens_out for r in reqs]))

    async def _take_back(self, m: dict[str, Any]) -> dict[str, Any]:
        """Take a running request off this node, not ended, with its progress: the tokens
        it produced (all of them, also those it brought here) go back in the reply, so the
        dispatcher can resume it elsewhere (preemption 7.1). No `done` event follows. A
        request whose instance is in the middle of a prefill leaves when that iteration ends."""
        rid = str(m.get("request_id"))
        if rid not in self.requests:
            raise Reply(Code.NO_INSTANCE, f"request {rid} is not on {self.spec.node_id}")
        req = await self.node.take_back_after_prefill(rid, str(m.get("why") or "taken back by the control service"))
        if req is None:  # it ended while its instance finished the prefill
            raise Reply(Code.NO_INSTANCE, f"request {rid} ended on {self.spec.node_id} before it could be taken back")
        self.requests.pop(rid, None)
        return self._progress(req).to_dict()

    @staticmethod
    def _progress(req: ServedRequest) -> Progress:
        ids = req.engine_request.prompt_token_ids or []
        produced = list(ids[req.prompt_len:req.prompt_len + req.tokens_out])
        first = req.first_token_s
        return Progress(req.request_id, req.tokens_out, produced,
                        None if first is None else asyncio.get_running_loop().time() - first)

    def _instance(self, iid: Any) -> Any:
        inst = self.node.instances.get(str(iid))
        if inst is None:
            raise Reply(Code.NO_INSTANCE, f"no instance {iid} on {self.spec.node_id}")
        return inst

    def _abort(self, m: dict[str, Any]) -> None:
        rid = str(m.get("request_id"))
        tokenizing = self._tokenizing.get(rid)
        if tokenizing is not None:  # still being tokenized: its job leaves the tokenizer's queue
            self._tokenize_aborted[rid] = True
            tokenizing.cancel()
        if rid in self.requests:
            self.node.abort(rid, Outcome.FAILED, "aborted by the control service")
        return None

    def _stats(self, m: dict[str, Any]) -> dict[str, Any]:
        station = self.node.memory.station
        now = asyncio.get_running_loop().time()
        return {
            "node_id": self.spec.node_id, "kind": self.spec.kind, "uptime_s": now - self.started_at,
            "instances": [self._instance_view(i, now) for i in self.node.instances.values()],
            "memory": {"capacity_bytes": station.capacity, "budget_bytes": station.budget,
                       "pessimistic_bytes": station.pessimistic, "free_bytes": station.free(),
                       "waiting_ops": len(station.waiting())},
            "queue_length": self.node.queue_length(), "running": len(self.requests),
            "tokenizer": {"waiting": self.tokenizers.waiting, "cache_bytes": self.tokenizers.cache_bytes,
                          **self.tokenizers.counts.as_dict()},
            "models": self._models_known(),  # per-model state held here (a deleted model's is forgotten)
            "busy_s": self.node.busy_s, "iterations": self.node.iteration_count,
            "kv_bytes_in_use": self.node.kv_bytes_in_use(), "deadlines": self.node.deadlines.value,
            "learnt": self.learning.view(), "parked": self.parking.view(), "parked_ahead": self.ahead.view(),
            "emulate": self.emulation.device if self.emulation is not None else None,
        }

    def _models_known(self) -> list[str]:
        """Every model this agent holds state for: fronts, means, learnt times, builds ahead,
        parked workers, instances (what a deleted model must leave none of)."""
        known = set(self._front_models.values())
        known |= set(self._means) | set(self.learning.times) | set(self.ahead.models()) | set(self.parking.models())
        known |= {inst.model for inst in self.node.instances.values()} | {s.model for s in self.specs.values()}
        return sorted(known)

    async def _forget(self, m: dict[str, Any]) -> dict[str, Any]:
        """A model was deleted from the service: every trace of it here goes (its instances
        were unloaded first): its fronts and tokenizer, mean, learnt times, build ahead and
        parked workers."""
        model = str(m.get("model") or "")
        if not model:
            raise Reply(Code.BAD_REQUEST, "forget needs the model")
        if any(inst.model == model for inst in self.node.instances.values()):
            raise Reply(Code.BUSY, f"model {model} still has instances on {self.spec.node_id}")
        for _ in range(200):  # its instances' unloads end first: an unload parks its worker (forgotten below)
            if not any(inst.model == model for inst in self.node._unloading.values()):
                break
            await asyncio.sleep(0.05)
        paths = set()
        for key, front_model in list(self._front_models.items()):
            if front_model == model:
                del self._front_models[key]
                front = self.fronts.pop(key, None)
                paths.add(key[1])
                if front is not None and hasattr(front, "kill_worker"):
                    front.kill_worker()
        self._means.pop(model, None)
        self.learning.forget(model)
        self.ahead.forget(model)
        self.parking.forget(model)
        for path in paths:
            self.preparer.forget(path)
            await self.tokenizers.forget(path)
        return {"forgot": model}

    def _instance_view(self, inst: Any, now: float | None = None) -> dict[str, Any]:
        engine = inst.engine
        iid = inst.instance_id
        state = self.node.compute.instances.get(iid)
        kv_budget = self.node.memory.kv_bytes(iid) if iid in self.node.memory.instances else 0
        times = self.times.get(iid)
        return {
            "instance_id": iid, "model": inst.model, "loaded": inst.loaded, "batch_size": inst.batch_size,
            "pending": len(state.pending) if state else 0,
            "idle_for_s": (now - inst.idle_since) if (now is not None and not inst.requests) else 0.0,
            "weight_bytes": engine.weight_bytes, "kv_bytes_budget": kv_budget,
            "kv_bytes_in_use": engine.kv_bytes_in_use(),
            "kv_bytes_allocated": engine.kv_bytes_allocated() if hasattr(engine, "kv_bytes_allocated") and inst.loaded else 0,
            "context_window": engine.context_window,
            "time_factors": times.drift() if times else None,
        }

    async def _weights_path(self, m: dict[str, Any]) -> dict[str, Any]:
        """Where this node writes a received model file (the `output_path` of a multicast);
        with a `manifest`, also whether the file there already is that model (`complete`)."""
        if self.weights is None:
            raise Reply(Code.BAD_REQUEST, f"node {self.spec.node_id} receives no weights (start it with --weights-listen)")
        try:
            path = received_path(self.weights.root, str(m["model"]), str(m["file"]))
            manifest = Manifest.from_dict(m["manifest"]) if m.get("manifest") is not None else None
        except (KeyError, ValueError, TypeError) as exc:
            raise Reply(Code.BAD_REQUEST, f"weights_path needs a model, a file name and a valid manifest: {exc}") from exc
        reply: dict[str, Any] = {"path": str(path)}
        if manifest is not None:
            reply["complete"] = await asyncio.to_thread(holds, path, manifest)  # sha256 releases the GIL
        return reply

    def _weights_drop(self, m: dict[str, Any]) -> dict[str, Any]:
        """Delete a model's received files (the model was deleted); `dropped`: were there any."""
        if self.weights is None:
            raise Reply(Code.BAD_REQUEST, f"node {self.spec.node_id} receives no weights (start it with --weights-listen)")
        try:
            folder = received_path(self.weights.root, str(m["model"]), "file").parent
        except (KeyError, ValueError) as exc:
            raise Reply(Code.BAD_REQUEST, f"weights_drop needs a model: {exc}") from exc
        existed = folder.is_dir()
        shutil.rmtree(folder, ignore_errors=True)
        return {"dropped": existed}

    def _shutdown(self, m: dict[str, Any]) -> dict[str, Any]:
        asyncio.get_running_loop().call_later(0.05, self.stop)
        return {}

    # ---- request callbacks (called by the node runtime) ------------------------------------
    def _on_output(self, req: ServedRequest, tokens: Any, texts: Any) -> None:
        self._send(TokensEvent([(req.request_id, list(tokens or ()), "".join(texts or ()))]).to_message())

    def _on_done(self, req: ServedRequest) -> None:
        self.requests.pop(req.request_id, None)
        self._send(DoneEvent(req.request_id, req.outcome.value if req.outcome else "failed",
                             req.finish_reason.value if req.finish_reason else None, req.detail, req.tokens_out,
                             _finite(req.ttft_s), _finite(req.tpot_s)).to_message())

    def _on_evict(self, req: ServedRequest) -> None:
        """The memory subsystem evicted a request (6.4), progress kept: it goes back to the
        control service, whose dispatcher places it on another node (an `evicted` event
        with the tokens it produced; no `done` follows)."""
        self.requests.pop(req.request_id, None)
        self._send(EvictedEvent(req.attempts[-1] if req.attempts else "evicted", self._progress(req),
                                req.fault).to_message())

    def _abort_all(self, why: str) -> None:
        for rid in list(self.requests):
            self.node.abort(rid, Outcome.FAILED, why)


EMULATED_NEVER_LEARNS = 2**62  # AdaptiveTimes.margin_after of an emulated instance: no learnt margin


def _only_own_prefill_late(admission: Any) -> bool:
    verdict = admission.compute
    if verdict is None or admission.memory is None or not admission.memory.ok or not verdict.failures:
        return False
    return all(f.case is FailureCase.OWN_PREFILL_LATE for f in verdict.failures)


def _warm_openvino() -> None:
    """Import OpenVINO (GenAI) and load its CPU plugin once (mesh.engines.openvino_engine reads the
    plugin's KV cache precisions for every instance it describes)."""
    try:
        import openvino_genai  # noqa: F401 - its libraries, read once

        from mesh.engines.openvino_engine import kv_precisions

        kv_precisions("CPU", {})
    except Exception as exc:  # noqa: BLE001 - an agent without OpenVINO still serves other engines
        log.warning("OpenVINO could not be loaded at start: %s", exc)


def _since(age_s: Any) -> float | None:
    """A time given as an age (seconds ago): the two processes' clocks are never compared."""
    return None if age_s is None else asyncio.get_running_loop().time() - max(0.0, float(age_s))


def _finite(x: float) -> float | None:
    return x if x == x and x not in (float("inf"), float("-inf")) else None


def _cpu_info() -> dict[str, Any]:
    from mesh.hardware import read_cpuinfo

    cpu = read_cpuinfo()
    return {"model": cpu.model_name, "cores": cpu.cores, "amx": cpu.amx,
            "core_set": sorted(os.sched_getaffinity(0))}  # the cores this node owns (its agent's --cpus)


async def _watch_stdin(server: AgentServer) -> None:
    """--exit-with-parent: stdin reaching EOF means the parent is gone."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass
    log.info("stdin closed (the parent is done or gone): exiting")
    server.stop()


def loopback(listen: str) -> bool:
    """Does a --listen / --weights-listen address reach only this machine (loopback or a Unix socket)?"""
    if listen.startswith("unix:"):
        return True
    host = listen.rpartition(":")[0].strip("[]")
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def open_ports_refused(args: argparse.Namespace, agent_token: str | None, weights_token: str | None) -> str | None:
    """Why the agent must not start (a port off loopback without its token), or None."""
    if not loopback(args.listen) and not agent_token:
        return (f"refusing to listen on {args.listen} without a token: anyone who reaches it could load models and "
                f"run requests. Set ${args.token_env} (the control service's MESH_AGENT_TOKEN), or listen on "
                "127.0.0.1")
    if args.weights_listen and not loopback(args.weights_listen) and not weights_token:
        return (f"refusing to receive weights on {args.weights_listen} without a token: anyone who reaches it could "
                "write files into the weights folder. Set $MESH_WEIGHTS_TOKEN (the control service's), or listen "
                "on 127.0.0.1")
    return None


async def _amain(args: argparse.Namespace) -> int:
    from mesh.paths import data_dir

    token = os.environ.get(args.token_env) or None
    refused = open_ports_refused(args, token, token_from_env())
    if refused:
        print(f"mesh agent: {refused}", file=sys.stderr)
        return 2
    if args.cpus:
        try:
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})  # engine workers inherit it
        except (ValueError, OSError) as exc:
            print(f"mesh agent: --cpus {args.cpus}: {exc}; give core numbers this machine has, e.g. --cpus 0,1",
                  file=sys.stderr)
            return 2
    weights = None
    root = Path(args.weights_dir) if args.weights_dir else data_dir() / "received" / args.node_id
    if args.weights_listen:
        host, port = parse_listen(args.weights_listen)
        weights = NodeWeightsReceiver(root, host, port, token=token_from_env())  # MESH_WEIGHTS_TOKEN
    emulation = (Emulation(args.emulate, args.emulate_noise, args.emulate_seed, args.emulate_profiles)
                 if args.emulate else None)
    server = AgentServer(NodeSpec(args.node_id, args.kind, args.memory_bytes), token, _cpu_info(), weights,
                         load_roots=[root, *(args.models_root or ())], deadlines=DeadlineRule(args.deadlines),
                         emulation=emulation, watchdog_min_s=args.watchdog_min_s,
                         park_bytes=args.memory_bytes // 4 if args.park_bytes is None else args.park_bytes,
                         tokenizer_bytes=_tokenizer_bytes(args))
    address = await server.serve(args.listen)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    watcher = loop.create_task(_watch_stdin(server)) if args.exit_with_parent else None  # keep a reference
    print(f"{READY_PREFIX}{address}", flush=True)
    await server.wait_stopped()
    if watcher is not None:
        watcher.cancel()
    await server.close()
    return 0


def _tokenizer_bytes(args: argparse.Namespace) -> int:
    """The tokenizer cache reserved on a node that tokenizes in its worker (an OpenVINO CPU
    node): --tokenizer-bytes, else 1/16 of its memory up to the worker's default."""
    if args.kind != "cpu" or args.emulate:
        return 0
    if args.tokenizer_bytes is not None:
        return args.tokenizer_bytes
    return min(DEFAULT_CACHE_BYTES, args.memory_bytes // 16)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mesh.agent", description="Mesh node agent")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any free port) or unix:PATH")
    parser.add_argument("--node-id", default="cpu-0")
    parser.add_argument("--kind", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--memory-bytes", type=int, required=True, help="memory budget for weights and KV caches")
    parser.add_argument("--park-bytes", type=int, help="memory beside --memory-bytes for stopped OpenVINO instances kept "
                        "built and warm, so that the next load of their model is ready at once (mesh.engines.parking; "
                        "default: a quarter of --memory-bytes; 0: none)")
    parser.add_argument("--tokenizer-bytes", type=int, help="memory for the tokenizers the node keeps built (an "
                        "OpenVINO CPU node; reserved in --memory-bytes; default: 1/16 of it, at most 256 MiB)")
    parser.add_argument("--token-env", default="MESH_AGENT_TOKEN", help="environment variable holding the hello token")
    parser.add_argument("--exit-with-parent", action="store_true", help="exit when stdin closes")
    parser.add_argument("--weights-listen", metavar="HOST:PORT",
                        help="receive model weight blocks here (port 0: any); token: env MESH_WEIGHTS_TOKEN")
    parser.add_argument("--weights-dir", metavar="DIR", help="where received models go (default: DATA/received/NODE_ID)")
    parser.add_argument("--models-root", action="append", metavar="DIR",
                        help="`load` may also open models under DIR (repeatable); the weights folder always counts")
    parser.add_argument("--deadlines", default=DeadlineRule.EQ1.value, choices=[r.value for r in DeadlineRule],
                        help="when tokens after the first are due: 'eq1' (the paper's arrival + TTFT + TPOT x (i-1), "
                             "the default) or 'pace' (first token + TPOT x (i-1)); docs/design.md")
    parser.add_argument("--cpus", metavar="LIST", help="run this agent and its engines on these cores only "
                        "(comma-separated core numbers; default: all this process may use)")
    parser.add_argument("--emulate", metavar="DEVICE", help="emulate a node of this profiled device (e.g. a100-80gb): "
                        "run emulated models only, each iteration taking its profile's time (mesh.node.emulation)")
    parser.add_argument("--emulate-noise", type=float, default=SIMULATED_NOISE,
                        help="relative std-dev of an emulated iteration's time (default: the replay's %(default)s)")
    parser.add_argument("--emulate-seed", type=int, default=0, help="seed of the emulated noise (default: 0)")
    parser.add_argument("--emulate-profiles", metavar="DIR", help="calibrated profiles <model>__<device>.json to "
                        "emulate besides the packaged ones")
    parser.add_argument("--watchdog-min-s", type=_positive_seconds, default=HUNG_MIN_S,
                        help="an engine iteration running past max(this, 20 x its predicted time) has hung: its "
                             f"instance fails and its worker is killed; its requests move (default {HUNG_MIN_S:g})")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    os.umask(0o077)  # received weights, parked builds, logs: this user's only (a standalone agent too)
    logging.basicConfig(level=args.log_level, format=f"agent {args.node_id}: %(levelname)s %(message)s")
    return asyncio.run(_amain(args))
