"""Local node agents: spawn `python -m mesh.agent` for a node, connect, restart it when it dies.

`LocalAgent` is one node of the embedded default. Its state goes starting -> up -> down ->
starting ... until `stop()`. It notices a death by the connection ending (the kernel closes
a killed process's socket at once), by the process exiting, or by the client's heartbeat,
and then restarts the process with a backoff that grows only while it keeps dying young.

`detect_local_nodes()` lists the nodes of this machine: `cpu_nodes` CPU nodes sharing its
memory budget (default one; more stand in for several machines, each with its own weights
folder, so that models travel between them by multicast). GPU nodes
(vLLM) plug in here: one `NodeSpec` of kind "gpu" per device, the agent started
with `--kind gpu` registering the vLLM engine factory (mesh.node.engine_host).
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from mesh.control.agent_client import AgentClient, AgentDown
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import DeadlineRule
from mesh.tasks import PIPE_EOF_S, cancel_all
from mesh.wire.agent_protocol import READY_PREFIX, Shutdown

log = logging.getLogger(__name__)

UpCallback = Callable[["AgentHandle"], None]
DownCallback = Callable[["AgentHandle", str], None]
EventCallback = Callable[["AgentHandle", dict[str, Any]], None]


def total_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def detect_local_nodes(cpu_memory_bytes: int | None = None, cpu_nodes: int = 1) -> list[NodeSpec]:
    """This machine's nodes: `cpu_nodes` CPU nodes splitting the CPU budget (half the memory
    unless told), plus vLLM nodes: one per GPU with vLLM's CUDA build, a vLLM-on-CPU one if
    MESH_VLLM_CPU_NODE=1 (mesh.control.vllm_nodes)."""
    from mesh.control.vllm_nodes import vllm_node_specs

    memory = (cpu_memory_bytes or total_memory_bytes() // 2) // cpu_nodes
    return [*(NodeSpec(f"cpu-{i}", "cpu", memory) for i in range(cpu_nodes)), *vllm_node_specs()]


SERVICE = "service"  # the key of the service's own cores in core_shares / parse_node_cores


def core_shares(node_ids: list[str], cores: list[int] | None = None) -> dict[str, tuple[int, ...]]:
    """The machine's cores split among its local nodes that compute on them (OpenVINO agents,
    the vLLM-on-CPU agent), as its memory is: node i of N gets the i-th of N equal slices of
    the cores this process may use (each node then stands in for a machine of its own,
    which is what the cluster's simulated twin assumes). Where every node still gets two
    cores or more, one core is kept out of the slices for the service, its emulated agents,
    its background conversions and a load client (key SERVICE); otherwise they share the
    nodes' cores (docs/service.md). With more nodes than cores, nodes share cores round-robin."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    n = len(node_ids)
    if n == 0:
        return {}
    if n > len(cores):
        return {node: (cores[i % len(cores)],) for i, node in enumerate(node_ids)}
    shares: dict[str, tuple[int, ...]] = {}
    if len(cores) - 1 >= 2 * n:
        shares[SERVICE], cores = (cores[-1],), cores[:-1]
    shares.update({node: tuple(cores[i * len(cores) // n:(i + 1) * len(cores) // n]) for i,
                   node in enumerate(node_ids)})
    return shares


def parse_node_cores(text: str, node_ids: list[str], allowed: set[int] | None = None) -> dict[str, tuple[int, ...]]:
    """`mesh serve --node-cores`: "0;1" (the nodes' core sets in order) or "cpu-0=0-3;cpu-1=4,5;
    service=6" (by name; `service`: the service's own). A node not named runs on every core
    (a named node's set is its alone only if no other set holds it). ValueError says what is
    wrong."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    parts = [p.strip() for p in text.split(";") if p.strip()]
    if not parts:
        raise ValueError("node_cores needs core sets separated by ';', e.g. '0;1' or 'cpu-0=0-3;cpu-1=4-7'")
    named = all("=" in p for p in parts)
    if not named and any("=" in p for p in parts):
        raise ValueError(f"node_cores {text!r}: name every set (NODE=CORES) or none")
    if not named and len(parts) > len(node_ids):
        raise ValueError(f"node_cores {text!r} gives {len(parts)} core sets for {len(node_ids)} local nodes "
                         f"({', '.join(node_ids)})")
    out: dict[str, tuple[int, ...]] = {}
    for i, part in enumerate(parts):
        node, _, spec = part.rpartition("=") if named else (node_ids[i], "=", part)
        node = node.strip()
        if node not in node_ids and node != SERVICE:
            raise ValueError(f"node_cores {text!r}: no local node {node!r}; the nodes are {', '.join(node_ids)} "
                             f"(and {SERVICE})")
        cores: set[int] = set()
        for item in (x.strip() for x in spec.split(",") if x.strip()):
            lo, _, hi = item.partition("-")
            try:
                cores.update(range(int(lo), int(hi or lo) + 1))
            except ValueError:
                raise ValueError(
                    f"node_cores {text!r}: {item!r} is not a core or a range of cores (e.g. 0-3)") from None
        if not cores:
            raise ValueError(f"node_cores {text!r}: {node} has no cores")
        if not cores <= allowed:
            raise ValueError(f"node_cores {text!r}: {node} names cores {sorted(cores - allowed)} this process may not "
                             f"use (it may use {sorted(allowed)})")
        out[node] = tuple(sorted(cores))
    return out


@dataclass
class AgentSettings:
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 10.0  # building a tokenizer holds the agent's GIL for seconds
    start_timeout_s: float = 60.0
    restart_backoff_s: float = 0.2
    restart_backoff_max_s: float = 5.0
    log_level: str = "WARNING"
    weights_root: str | None = None  # node agents receive weights into <root>/<node id> (None: no receiver)
    weights_token: str | None = None  # MESH_WEIGHTS_TOKEN of their weights ports
    deadlines: DeadlineRule = DeadlineRule.EQ1  # the agents' deadline rule (their --deadlines)
    watchdog_min_s: float | None = None  # the engine watchdog's floor (their --watchdog-min-s; None: theirs, 30 s)
    models_roots: tuple[str, ...] = ()  # folders whose models the agents may `load` (--models-root), besides
    # their weights folder: the registry's places (data folder, --allowed-dir, the demo model cache)
    cores: dict[str, tuple[int, ...]] = field(default_factory=dict)  # node id -> the cores its local agent
    # and its engines run on (--cpus; core_shares); a node not named runs on all of them
    emulate: dict[str, str] = field(default_factory=dict)  # node id -> the device its agent emulates (--emulate;
    # mesh.engines.emulation): such a node runs emulated models only
    emulate_noise: float | None = None  # their --emulate-noise (None: the replay's noise)
    # their --emulate-profiles: calibrated <model>__<device>.json besides the catalog's
    emulate_profiles: str | None = None
    # their --tokenizer-bytes (None: theirs, 1/16 of the node's memory up to 256 MiB)
    tokenizer_bytes: int | None = None


EXIT_SETTLE_S = 0.2  # a lost connection: how long to wait for its process's exit to be seen (`_settle_exit`)
ABANDONED_START_S = 2.0  # an agent stopped while it starts: its wait for EOF on stdin before SIGTERM


class AgentHandle:
    """What the service holds of one node agent: its connection (`client`), state
    (starting, up, down, stopped), the generation its instances belong to, and callbacks for
    up, down and events. Subclasses keep the connection alive in `_supervise`."""

    remote = False  # True: the service serves without it until it is reachable

    def __init__(self, spec: NodeSpec, on_up: UpCallback, on_down: DownCallback, on_event: EventCallback,
                 settings: AgentSettings | None = None) -> None:
        self.spec = spec
        self.on_up, self.on_down, self.on_event = on_up, on_down, on_event
        self.settings = settings or AgentSettings()
        self.state = "stopped"
        self.client: AgentClient | None = None
        self.restarts = 0
        self.last_error = ""
        self.generation = 0  # increments at every (re)connection: instances belong to one generation
        self.token: str | None = None  # the agent's token: its connection's, and its layer port's
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._up = asyncio.Event()
        self._gone = asyncio.Event()  # set when the current connection (or process) ends

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    @property
    def location(self) -> str:
        """Where the agent runs, for /admin/cluster: "local", its address, or its Ray node."""
        return "local"

    @property
    def up(self) -> bool:
        return self.state == "up" and self.client is not None and self.client.up

    @property
    def pid(self) -> int | None:
        """The agent's process id while this service runs it (None: not running, or not ours)."""
        return None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name=f"agent {self.node_id}")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the agent for good: no restart or reconnection from now on."""
        raise NotImplementedError

    async def wait_up(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._up.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def _supervise(self) -> None:
        raise NotImplementedError

    def kill_process(self) -> None:
        """End the agent's process now, if this service runs it (a stop cut short); a remote
        agent is not ours to end."""


class LocalAgent(AgentHandle):
    """One local agent process and its connection, kept alive."""

    def __init__(self, spec: NodeSpec, on_up: UpCallback, on_down: DownCallback, on_event: EventCallback,
                 settings: AgentSettings | None = None) -> None:
        super().__init__(spec, on_up, on_down, on_event, settings)
        self.process: asyncio.subprocess.Process | None = None
        self.token: str = secrets.token_urlsafe(24)
        self._watchers: set[asyncio.Task] = set()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.returncode is None else None

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the agent for good, within about `timeout_s` + 10 s: no restart from now on (a
        start under way is abandoned); a connected agent is asked to shut down (its engines
        unload) and gets `timeout_s` to exit, one still starting `ABANDONED_START_S`; then
        SIGTERM, then SIGKILL."""
        self._stopping = True
        client = self.client
        connected = client is not None and client.up
        if client is not None and connected:
            try:
                await client.call(Shutdown(), 2.0)
            except (AgentDown, Exception):  # noqa: BLE001 - it is going away either way
                pass
        await cancel_all([self._task])  # first: a restart must not spawn a process after the reap below
        await self._reap(timeout_s if connected else ABANDONED_START_S)
        if self._watchers:  # its stdout read to EOF (its workers, which share the pipe, die with it):
            await asyncio.wait(set(self._watchers), timeout=PIPE_EOF_S)  # no pipe left open to the loop's end
        await cancel_all(list(self._watchers))
        if self.client is not None:
            await self.client.close()
        self.state = "stopped"

    def kill_process(self) -> None:
        """SIGKILL the agent's process now (a stop cut short; also from another thread); its
        engine and tokenizer workers die with it (PR_SET_PDEATHSIG)."""
        self._stopping = True
        process = self.process
        if process is not None and process.returncode is None:  # not reaped: its pid is still its own
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ---- supervision -------------------------------------------------------------------
    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = self.settings.restart_backoff_s
        while not self._stopping:
            self.state = "starting"
            started = loop.time()
            self._gone.clear()
            try:
                await self._spawn_and_connect()
            except (AgentDown, OSError, asyncio.TimeoutError) as exc:
                self.last_error = f"start failed: {exc}"
                log.error("agent %s: %s", self.node_id, self.last_error)
                await self._reap(2.0)
            else:
                self.state = "up"
                self._up.set()
                self.on_up(self)
                await self._gone.wait()
                await self._settle_exit()
                reason = self.client.closed_reason if self.client and self.client.closed_reason else "process exited"
                if self.process is not None and self.process.returncode is not None:
                    reason = f"{reason} (exit status {self.process.returncode})"
                self.last_error = reason
                self.state = "down"
                self._up.clear()
                if self._stopping:
                    return
                log.error("agent %s is down: %s; restarting", self.node_id, reason)
                self.on_down(self, reason)
                await self._reap(2.0)
            if self._stopping:
                return
            self.state = "down"
            self.restarts += 1
            backoff = self.settings.restart_backoff_s if loop.time() - started > 30 else min(
                backoff * 2, self.settings.restart_backoff_max_s)
            await asyncio.sleep(backoff)

    async def _settle_exit(self) -> None:
        """The connection ended: give a process that is exiting (the kernel closes a killed
        process's socket as it ends it) up to EXIT_SETTLE_S to be seen gone, so the reason
        says whether it exited (mesh.control.agent_node.loss_cause)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + EXIT_SETTLE_S
        while self.process is not None and self.process.returncode is None and loop.time() < until:
            await asyncio.sleep(0.01)

    async def _spawn_and_connect(self) -> None:
        from mesh.control.vllm_nodes import agent_env
        from mesh.engines.worker_process import worker_env

        # only the agent's own secrets (worker_env drops the service's admin and metrics tokens)
        device = self.settings.emulate.get(self.node_id)
        # GPU agents: their device (an emulated one has none)
        env = worker_env(MESH_AGENT_TOKEN=self.token, **({} if device else agent_env(self.spec)))
        cmd = [sys.executable, "-m", "mesh.agent", "--listen", "127.0.0.1:0", "--node-id", self.node_id,
               "--kind", self.spec.kind, "--memory-bytes", str(self.spec.memory_bytes), "--exit-with-parent",
               "--log-level", self.settings.log_level, "--deadlines", str(self.settings.deadlines)]
        if self.settings.watchdog_min_s is not None:
            cmd += ["--watchdog-min-s", repr(float(self.settings.watchdog_min_s))]
        if self.settings.tokenizer_bytes is not None:
            cmd += ["--tokenizer-bytes", str(self.settings.tokenizer_bytes)]
        for root in self.settings.models_roots:
            cmd += ["--models-root", root]
        if device:
            cmd += ["--emulate", device]
            if self.settings.emulate_noise is not None:
                cmd += ["--emulate-noise", repr(self.settings.emulate_noise)]
            if self.settings.emulate_profiles is not None:
                cmd += ["--emulate-profiles", self.settings.emulate_profiles]
        if self.settings.cores.get(self.node_id):
            cmd += ["--cpus", ",".join(map(str, self.settings.cores[self.node_id]))]
        if self.settings.weights_root is not None:
            cmd += ["--weights-listen", "127.0.0.1:0", "--weights-dir", os.path.join(self.settings.weights_root,
                                                                                    self.node_id)]
            if self.settings.weights_token:
                env["MESH_WEIGHTS_TOKEN"] = self.settings.weights_token
        self.process = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            start_new_session=True)  # a Ctrl-C to `mesh serve` reaches the agent through us, in order
        address = await asyncio.wait_for(self._read_address(), self.settings.start_timeout_s)
        self.generation += 1
        loop = asyncio.get_running_loop()
        for coro in (self._watch_process(self.process), self._drain_stdout(self.process)):
            task = loop.create_task(coro)
            self._watchers.add(task)  # a reference, or the loop may drop the task
            task.add_done_callback(self._watchers.discard)
        client = AgentClient(self.node_id, lambda m: self.on_event(self, m), lambda reason: self._gone.set(),
                             self.settings.heartbeat_s, self.settings.heartbeat_timeout_s)
        self.client = client
        await client.connect(address, self.token)

    async def _read_address(self) -> str:
        assert self.process is not None and self.process.stdout is not None
        while True:
            line = await self.process.stdout.readline()
            if not line:
                raise AgentDown(f"agent process exited before listening (exit status {await self.process.wait()})")
            text = line.decode(errors="replace").strip()
            if text.startswith(READY_PREFIX):
                return text[len(READY_PREFIX):]
            log.info("agent %s: %s", self.node_id, text)

    async def _drain_stdout(self, process: asyncio.subprocess.Process) -> None:
        while process.stdout is not None:
            line = await process.stdout.readline()
            if not line:
                return
            log.info("agent %s: %s", self.node_id, line.decode(errors="replace").rstrip())

    async def _watch_process(self, process: asyncio.subprocess.Process) -> None:
        await process.wait()
        if process is self.process:
            if self.client is not None:
                self.client._close(f"agent process exited with status {process.returncode}")
            self._gone.set()

    async def _reap(self, timeout_s: float) -> None:
        """Make sure the current process is gone: wait, then SIGTERM, then SIGKILL."""
        process = self.process
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()  # --exit-with-parent: the agent exits on stdin EOF
        if process.returncode is not None:
            return
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                try:
                    process.send_signal(sig)
                except ProcessLookupError:
                    return
            try:
                await asyncio.wait_for(process.wait(), timeout_s if sig is None else 3.0)
                return
            except asyncio.TimeoutError:
                continue
