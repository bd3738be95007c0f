"""The node agent process: one node's NodeRuntime and engine instances behind a connection.

`python -m mesh.agent --listen HOST:PORT --node-id ID --kind cpu --memory-bytes N` listens
(TCP; `--listen unix:/path` for a Unix socket), prints `MESH_AGENT_LISTENING host:port`
on stdout, and serves one control connection at a time (a new connection replaces the old
one, whose requests are aborted). The first message must be `hello` with the token from
$MESH_AGENT_TOKEN when that is set. Messages are in mesh.wire.agent_protocol.

The agent is put together here from its parts: the control connection
(mesh.node.control_connection: frames, the hello gate and token, a handler picked by the
decoded request's type, replies), the instances (mesh.node.instance_host), the models known
here (mesh.node.model_fronts: describe, tokenize, forget) and the requests it serves
(mesh.node.node_requests: admit, validate, take back, abort and their events).

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
import dataclasses
import ipaddress
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from mesh import native_heap
from mesh.engines.background_prepare import BackgroundPreparer
from mesh.engines.emulation import Emulation
from mesh.engines.engine_api import EngineError
from mesh.engines.parking import ParkingLot
from mesh.engines.simulated import SIMULATED_NOISE
from mesh.engines.worker_process import worker_env
from mesh.lifetime import die_with_parent
from mesh.node.control_connection import ControlConnection, Refused
from mesh.node.engine_host import make_engine
from mesh.node.instance_host import InstanceHost
from mesh.node.layer_host import LAYERS_PREFIX, LayerHost
from mesh.node.lending import Lender
from mesh.node.model_fronts import ModelFronts
from mesh.node.node_learning import NodeLearning
from mesh.node.node_requests import NodeRequests
from mesh.node.park_ahead import ParkAhead
from mesh.node.runtime import HUNG_MIN_S, NodeRuntime
from mesh.node.tokenizer_worker import DEFAULT_CACHE_BYTES
from mesh.node.tokenizers import TokenizerProcess
from mesh.perf.speed import MachineSpeed
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import DeadlineRule
from mesh.tasks import cancel_all, close_pipes
from mesh.weights.peer import token_from_env
from mesh.weights.receiver import NodeWeightsReceiver, parse_listen
from mesh.wire.agent_protocol import (
    PROTOCOL_VERSION,
    READY_PREFIX,
    Abort,
    Ack,
    Admit,
    Code,
    Describe,
    Forget,
    Hello,
    HelloReply,
    InstanceSpec,
    Ping,
    Shutdown,
    Stats,
    StatsReply,
    TakeBack,
    Tokenize,
    Unload,
    Validate,
    ValidateGroup,
    ValidateNew,
    WeightsDrop,
    WeightsPath,
)

log = logging.getLogger(__name__)

TOKENIZER_HOLDER = "tokenizers"  # the tokenizer worker's cache in the node's memory budget


class AgentServer:
    """Serves one node: its runtime, instances, and one control connection. Its parts: the
    connection (`connection`: frames, gate, token, replies), the instances (`host`: load,
    unload, times, weights files), the models known here (`models`: describe, tokenize,
    forget) and the requests it serves (`requests`: admit, validate, take back, events)."""

    def __init__(self, spec: NodeSpec, token: str | None = None, cpu: dict[str, Any] | None = None,
                 weights: NodeWeightsReceiver | None = None, load_roots: Sequence[str | Path] = (),
                 deadlines: DeadlineRule = DeadlineRule.EQ1, emulation: Emulation | None = None,
                 park_bytes: int = 0, watchdog_min_s: float = HUNG_MIN_S, tokenizer_bytes: int = 0) -> None:
        """`load_roots`: folders whose files `load` may open, besides the weights receiver's.
        `park_bytes`: memory, beside the planned budget, for OpenVINO workers parked when their
        instance stops (mesh.engines.parking; 0: none parked).
        `deadlines`: when tokens after the first are due (mesh.policy.slo); the service's
        default is the paper's Eq. 1. `emulation`: this node emulates its device (`--emulate`):
        it runs emulated models only (mesh.engines.emulation); without it, it refuses them.
        `watchdog_min_s`: the engine watchdog's floor (mesh.node.runtime.hung_bound_s): an
        iteration that runs past max(this, 20 x its predicted time) has hung.
        `tokenizer_bytes`: the tokenizer worker's cache at most (mesh.node.tokenizer_worker),
        reserved in the node's memory budget (a holder of its own, `TOKENIZER_HOLDER`), so
        instances are planned around it (0: nothing reserved, the worker's default bound)."""
        self.spec = spec
        self.emulation = emulation
        self.layers_address: str | None = None  # its layer port, once listening (`hello` tells it)
        self.weights = weights
        self.cpu = cpu or {}
        self.node = NodeRuntime(spec, record_iterations=True, deadlines=deadlines, watchdog=True,
                                hung_min_s=watchdog_min_s)  # a hung engine fails its instance; its requests move
        self.learning = NodeLearning()  # the machine's speed and per-model times
        self._speed_probe: asyncio.Future | None = None
        # OpenVINO prompts are tokenized off this process's GIL; every prompt takes its turn there
        self.tokenizers = TokenizerProcess(tokenizer_bytes) if tokenizer_bytes > 0 else TokenizerProcess()
        if tokenizer_bytes > 0:
            station = self.node.memory.station
            issued = station.issue(TOKENIZER_HOLDER, tokenizer_bytes)
            if issued.op is None:
                raise ValueError(f"the tokenizer cache ({tokenizer_bytes} bytes) does not fit the node's memory "
                                 f"({spec.memory_bytes} bytes)")
            station.complete(issued.op.op_id)
        self.parking = ParkingLot(park_bytes)  # stopped OpenVINO instances, built and warm
        self.preparer = BackgroundPreparer()  # GGUFs loaded here are prepared once, for the next loads
        # models described here are built once before their first request and parked
        self.ahead = ParkAhead(self.parking, lambda spec: asyncio.to_thread(make_engine, spec, lambda _exc: None),
                               lambda: self.node.idle() and not self.host.specs)
        self.connection = ControlConnection(self.node, token, self._handlers(), self._abort_all)
        send = self.connection.send_event
        self.host = InstanceHost(spec, self.node, send, emulation=emulation, weights=weights, load_roots=load_roots,
                                 learning=self.learning, parking=self.parking, preparer=self.preparer,
                                 ahead=self.ahead, tokenizers=self.tokenizers)
        self.connection.before_flush = self.host.learn_times
        self.node.on_stepping = self.connection.stepping
        if weights is not None and spec.kind == "cpu":
            weights.on_saved = self.host.received
        if weights is not None:  # it sends, as a multicast's source, only files `load` may open
            weights.source_roots = self.host.load_roots
        self.models = ModelFronts(self.host, self.tokenizers, self.preparer)
        self.requests = NodeRequests(self.node, self.host, send)
        self.started_at = 0.0
        self._stopped = asyncio.Event()

    def _handlers(self) -> dict[type, Any]:
        """The handler of each request type (mesh.wire.agent_protocol)."""
        return {
            Hello: self._hello, Ping: lambda m: Ack(), Stats: self._stats, Shutdown: self._shutdown,
            Abort: self._abort,
            InstanceSpec: lambda m: self.host.load(m), Unload: lambda m: self.host.unload(m),
            WeightsPath: lambda m: self.host.weights_path(m), WeightsDrop: lambda m: self.host.weights_drop(m),
            Describe: lambda m: self.models.describe(m), Tokenize: lambda m: self.models.tokenize(m),
            Forget: lambda m: self.models.forget(m),
            Admit: lambda m: self.requests.admit(m), Validate: lambda m: self.requests.validate(m),
            ValidateGroup: lambda m: self.requests.validate_group(m),
            ValidateNew: lambda m: self.requests.validate_new(m), TakeBack: lambda m: self.requests.take_back(m),
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
        if self.spec.kind == "cpu":  # know the machine from its first minute: 0.4-2 s,
            # in the background: a load before it ends starts from the prior's factors
            self._speed_probe = asyncio.ensure_future(self._probe_speed())
        self.node.start()
        if self.weights is not None:
            await self.weights.start()
        serve = self.connection.serve_connection
        if listen.startswith("unix:"):
            path = listen[len("unix:"):]
            self._server = await asyncio.start_unix_server(serve, path, limit=2**20)
            return listen
        host, _, port = listen.rpartition(":")
        self._server = await asyncio.start_server(serve, host or "127.0.0.1", int(port), limit=2**20)
        bound = self._server.sockets[0].getsockname()
        return f"{bound[0]}:{bound[1]}"

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()

    async def close(self) -> None:
        self._server.close()
        await cancel_all([self._speed_probe])  # its process is killed and its pipe closed before the loop ends
        if self.weights is not None:
            await self.weights.close()
        # its requests end at once, before the workers do
        self._abort_all(f"node agent {self.spec.node_id} is shutting down")
        self.connection.flush()
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

    def _abort_all(self, why: str) -> None:
        self.requests.abort_all(why)

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
            if proc is not None:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                await close_pipes(proc, 1.0)

    # ---- the node's own requests -----------------------------------------------------------
    def _hello(self, m: Hello) -> HelloReply:
        if m.protocol not in (None, PROTOCOL_VERSION):
            raise Refused(Code.PROTOCOL,
                          f"protocol {m.protocol} is not supported; this agent speaks {PROTOCOL_VERSION}")
        return HelloReply(self.spec.node_id, self.spec.kind, self.spec.memory_bytes, self.cpu, os.getpid(),
                          PROTOCOL_VERSION, self.node.deadlines.value,
                          self.emulation.device if self.emulation is not None else None,
                          self.weights.info() if self.weights is not None else None,
                          [self.host.view(i) for i in self.node.instances.values()], self.layers_address)

    def _abort(self, m: Abort) -> Ack:
        self.models.abort_tokenize(m.request_id)  # still being tokenized: its job leaves the tokenizer's queue
        self.requests.abort(m.request_id)
        return Ack()

    def _stats(self, m: Stats) -> StatsReply:
        station = self.node.memory.station
        now = asyncio.get_running_loop().time()
        return StatsReply(
            node_id=self.spec.node_id, kind=self.spec.kind, uptime_s=now - self.started_at,
            instances=[self.host.view(i, now) for i in self.node.instances.values()],
            memory={"capacity_bytes": station.capacity, "budget_bytes": station.budget,
                    "pessimistic_bytes": station.pessimistic, "free_bytes": station.free(),
                    "waiting_ops": len(station.waiting())},
            queue_length=self.node.queue_length(), running=len(self.requests.requests),
            tokenizer={"waiting": self.tokenizers.waiting, "cache_bytes": self.tokenizers.cache_bytes,
                       **self.tokenizers.counts.as_dict()},
            models=self.models.models_known(),  # per-model state held here (a deleted model's is forgotten)
            busy_s=self.node.busy_s, iterations=self.node.iteration_count,
            kv_bytes_in_use=self.node.kv_bytes_in_use(), deadlines=self.node.deadlines.value,
            learnt=self.learning.view(), parked=self.parking.view(), parked_ahead=self.ahead.view(),
            emulate=self.emulation.device if self.emulation is not None else None,
            live=self._live_counts(),
        )

    def _live_counts(self) -> dict[str, int]:
        """Live scaling's counts (mesh.node.live_counts; {} where nothing was live), and the KV
        recomputed once whole by the instances loaded now."""
        live = self.host.live
        if not (live.waited_for_layers or live.pulls or live.lent):
            return {}
        recomputed = sum(getattr(i.engine, "recompute_tokens", 0) for i in self.node.instances.values())
        return {**dataclasses.asdict(live), "recompute_tokens": recomputed}

    def _shutdown(self, m: Shutdown) -> Ack:
        asyncio.get_running_loop().call_later(0.05, self.stop)
        return Ack()


def _no_layer_files(*_args: Any, **_kwargs: Any) -> Any:
    """An emulating node's layer host opens no model files: it only lends time (`lend`)."""
    raise EngineError("an emulating node runs no layer files: its layer port only lends time to live instances")


def _warm_openvino() -> None:
    """Import OpenVINO (GenAI) and load its CPU plugin once (mesh.engines.openvino_engine reads the
    plugin's KV cache precisions for every instance it describes)."""
    try:
        import openvino_genai  # noqa: F401 - its libraries, read once

        from mesh.engines.openvino_engine import kv_precisions

        kv_precisions("CPU", {})
    except Exception as exc:  # noqa: BLE001 - an agent without OpenVINO still serves other engines
        log.warning("OpenVINO could not be loaded at start: %s", exc)

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
    if args.layers_listen and not loopback(args.layers_listen) and not agent_token:
        return (f"refusing to run layers on {args.layers_listen} without a token: anyone who reaches it could run "
                f"the node's models. Set ${args.token_env}, or listen on 127.0.0.1")
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
        link = args.link_mbps * 1e6 / 8 if args.link_mbps else None
        weights = NodeWeightsReceiver(root, host, port, token=token_from_env(), link_bytes_per_s=link)
    emulation = (Emulation(args.emulate, args.emulate_noise, args.emulate_seed, args.emulate_profiles)
                 if args.emulate else None)
    server = AgentServer(NodeSpec(args.node_id, args.kind, args.memory_bytes), token, _cpu_info(), weights,
                         load_roots=[root, *(args.models_root or ())], deadlines=DeadlineRule(args.deadlines),
                         emulation=emulation, watchdog_min_s=args.watchdog_min_s,
                         park_bytes=args.memory_bytes // 4 if args.park_bytes is None else args.park_bytes,
                         tokenizer_bytes=_tokenizer_bytes(args))
    address = await server.serve(args.listen)
    layers = None
    if emulation is not None:  # ZigZag's partners lend time to live instances there (mesh.node.lending)
        lender = Lender(server.node.instances, server.host.live)
        layers = LayerHost(token, make_engine=_no_layer_files, lender=lender.lend)
        host, port = parse_listen(args.layers_listen or "127.0.0.1:0")
        server.layers_address = await layers.start(host, port)
        print(f"{LAYERS_PREFIX}{server.layers_address}", flush=True)
    elif args.layers_listen:  # decoder layer ranges and activations between agents (mesh.node.layer_host)
        # its forward passes run in a thread of this process and hold the GIL between torch's
        # kernels: a short switch interval keeps the loop (weights, replies) waiting less for it
        sys.setswitchinterval(0.0005)
        layers = LayerHost(token, roots=(root, *map(Path, args.models_root or ())))
        if weights is not None:
            weights.on_block = layers.on_block
        host, port = parse_listen(args.layers_listen)
        server.layers_address = await layers.start(host, port)
        print(f"{LAYERS_PREFIX}{server.layers_address}", flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    watcher = loop.create_task(_watch_stdin(server)) if args.exit_with_parent else None  # keep a reference
    print(f"{READY_PREFIX}{address}", flush=True)
    await server.wait_stopped()
    if watcher is not None:
        watcher.cancel()
    await server.close()
    if layers is not None:
        await layers.close()
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
    parser.add_argument("--park-bytes", type=int,
                        help="memory beside --memory-bytes for stopped OpenVINO instances kept "
                        "built and warm, so that the next load of their model is ready at once (mesh.engines.parking; "
                        "default: a quarter of --memory-bytes; 0: none)")
    parser.add_argument("--tokenizer-bytes", type=int, help="memory for the tokenizers the node keeps built (an "
                        "OpenVINO CPU node; reserved in --memory-bytes; default: 1/16 of it, at most 256 MiB)")
    parser.add_argument("--token-env", default="MESH_AGENT_TOKEN", help="environment variable holding the hello token")
    parser.add_argument("--exit-with-parent", action="store_true", help="exit when stdin closes")
    parser.add_argument("--weights-listen", metavar="HOST:PORT",
                        help="receive model weight blocks here (port 0: any); token: env MESH_WEIGHTS_TOKEN")
    parser.add_argument("--link-mbps", type=float, help="pace the weights this node sends to this many megabits per "
                        "second (a NIC of that speed, emulated on loopback)")
    parser.add_argument("--layers-listen", metavar="HOST:PORT", help="also run decoder layer ranges for peers there "
                        "(mesh.node.layer_host: live scaling, activations between agents); needs the layers extra")
    parser.add_argument("--weights-dir", metavar="DIR",
                        help="where received models go (default: DATA/received/NODE_ID)")
    parser.add_argument("--models-root", action="append", metavar="DIR",
                        help="`load` may also open models under DIR (repeatable); the weights folder always counts")
    parser.add_argument("--deadlines", default=DeadlineRule.EQ1.value, choices=[r.value for r in DeadlineRule],
                        help="when tokens after the first are due: 'eq1' (the paper's arrival + TTFT + TPOT x (i-1), "
                             "the default) or 'pace' (first token + TPOT x (i-1)); docs/design.md")
    parser.add_argument("--cpus", metavar="LIST", help="run this agent and its engines on these cores only "
                        "(comma-separated core numbers; default: all this process may use)")
    parser.add_argument("--emulate", metavar="DEVICE", help="emulate a node of this profiled device (e.g. a100-80gb): "
                        "run emulated models only, each iteration taking its profile's time (mesh.engines.emulation)")
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
    native_heap.map_large_blocks()  # received models' blocks are unmapped when freed, not kept on the heap
    logging.basicConfig(level=args.log_level, format=f"agent {args.node_id}: %(levelname)s %(message)s")
    return asyncio.run(_amain(args))
