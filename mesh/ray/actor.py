"""The node agent as a Ray actor: `NodeAgentActor`, one per Ray node (one per GPU on GPU nodes).

The actor is the agent's keeper on its node, not its transport. Created pinned to its node
(node-affinity scheduling, soft=False) with `max_restarts=-1`, it

1. runs the hardware probe on that node (`probe()`: kind, memory budget, AMX, CPU model),
   so the head never guesses another machine's hardware;
2. starts the real node agent there, `python -m mesh.agent`, listening on the node's
   address (127.0.0.1 in tests) with a control port and a weights port, and its tokens
   (in the agent's environment, never on its command line), which the actor derives from
   the cluster secret its node holds (`cluster_secret`); the actor's arguments, which Ray
   keeps in its control store to restart it, carry no secret;
3. reports the agent's address (`address()`) and health (`health()`);
4. exits when the agent process exits, so that Ray restarts the actor (and with it a new
   agent process) on the same node. The agent has `--exit-with-parent`: when the actor's
   worker dies, or its node is removed, the agent goes too and its connection closes.

Control messages go over Mesh's framed TCP connection between the control service and the
agent (mesh.control.agent_client), never through Ray: docs/cluster.md measures why. Tokens go nowhere:
the service and each actor derive them from the cluster secret (HMAC-SHA256), so neither Ray's
store nor its actor calls ever hold one.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mesh.engines.worker_process import worker_env
from mesh.policy.slo import DeadlineRule
from mesh.wire.agent_protocol import READY_PREFIX

SECRET_ENV = "MESH_CLUSTER_SECRET"  # the cluster secret itself, in the environment of `ray start` and mesh serve
SECRET_FILE_ENV = "MESH_CLUSTER_SECRET_FILE"  # else this file (default: DATA/cluster.secret)


class ClusterSecretError(RuntimeError):
    """The node holds no cluster secret; the message says how to give it one."""


def secret_file() -> Path:
    from mesh.paths import data_dir

    return Path(os.environ.get(SECRET_FILE_ENV) or data_dir() / "cluster.secret")


def cluster_secret(create: bool = False) -> bytes:
    """The secret every machine of a Mesh Ray cluster holds: $MESH_CLUSTER_SECRET, else the
    file $MESH_CLUSTER_SECRET_FILE (default DATA/cluster.secret, DATA being Mesh's data
    folder: $MESH_DATA_DIR or ~/.local/share/mesh). `create` (the control service): write a
    new random one there (mode 0600) if there is none; the nodes of a one-machine cluster
    then share it as they are, the others get a copy of the file (docs/cluster.md)."""
    value = os.environ.get(SECRET_ENV)
    if value:
        return value.encode()
    path = secret_file()
    try:
        data = path.read_bytes().strip()
    except FileNotFoundError:
        data = b""
    if data:
        return data
    if not create:
        raise ClusterSecretError(f"this node holds no cluster secret: set ${SECRET_ENV} in the environment of `ray "
                                 f"start`, or copy the control service's {path.name} to {path} (docs/cluster.md)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_urlsafe(32).encode())
    return path.read_bytes().strip()


def agent_token(secret: bytes, node_id: str) -> str:
    """The hello token of the agent of Mesh node `node_id` (one per node)."""
    return hmac.new(secret, f"mesh agent token {node_id}".encode(), hashlib.sha256).hexdigest()


def weights_token(secret: bytes) -> str:
    """The weights token of every agent of the cluster (they forward blocks to each other)."""
    return hmac.new(secret, b"mesh weights token", hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class AgentLaunch:
    """What the control service tells each actor (the same for every node): no secret."""

    log_level: str = "WARNING"
    deadlines: DeadlineRule = DeadlineRule.EQ1
    watchdog_min_s: float | None = None  # the agents' --watchdog-min-s (None: their default)
    memory_fraction: float = 0.5  # of the node's memory, when the agent's budget is not given
    memory_bytes: int | None = None  # the budget of every CPU agent (None: memory_fraction of the node's)
    start_timeout_s: float = 120.0


def probe_node(kind: str, gpu_memory: int | None, launch: AgentLaunch) -> dict[str, Any]:
    """This node's hardware, as the agent will report it: kind, memory budget, AMX, CPU."""
    from mesh.control.supervisor import total_memory_bytes
    from mesh.hardware import read_cpuinfo

    cpu = read_cpuinfo()
    if kind == "gpu":
        memory = gpu_memory or _gpu_memory()
    else:
        memory = launch.memory_bytes or int(total_memory_bytes() * launch.memory_fraction)
    return {"kind": kind, "memory_bytes": int(memory), "amx": cpu.amx, "cpu": cpu.model_name, "cores": cpu.cores,
            "host": node_ip()}


def _gpu_memory() -> int:
    """The memory of the GPU Ray gave this actor (nvidia-smi lists every GPU of the node)."""
    import ray

    from mesh.control.vllm_nodes import gpu_memory_bytes

    ids, sizes = ray.get_gpu_ids(), gpu_memory_bytes()
    try:
        return sizes[int(ids[0])]
    except (IndexError, ValueError):
        return 0


def node_ip() -> str:
    """The address this Ray node is reached at (its node_ip_address: 127.0.0.1 in tests)."""
    import ray

    return ray.util.get_node_ip_address()


class NodeAgentActor:
    """A Ray actor class (made remote by mesh.ray.membership): one node agent process."""

    def __init__(self, node_id: str, kind: str, launch: dict[str, Any], gpu_memory: int | None = None) -> None:
        self.node_id = node_id
        self.launch = AgentLaunch(**launch)
        self.info = probe_node(kind, gpu_memory, self.launch)
        self._stopping = False
        self._address = ""
        host = self.info["host"]
        secret = cluster_secret()  # this node's own (ClusterSecretError: none; the actor fails to start, saying so)
        env = worker_env(MESH_AGENT_TOKEN=agent_token(secret, node_id), MESH_WEIGHTS_TOKEN=weights_token(secret))
        if kind == "gpu":
            env["MESH_VLLM_DEVICE"] = "cuda"  # Ray set CUDA_VISIBLE_DEVICES to this actor's GPU
        cmd = [sys.executable, "-m", "mesh.agent", "--listen", f"{host}:0", "--node-id", node_id, "--kind", kind,
               "--memory-bytes", str(self.info["memory_bytes"]), "--exit-with-parent", "--log-level",
               self.launch.log_level, "--deadlines", str(self.launch.deadlines), "--weights-listen", f"{host}:0"]
        if self.launch.watchdog_min_s is not None:
            cmd += ["--watchdog-min-s", repr(float(self.launch.watchdog_min_s))]
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        deadline = time.monotonic() + self.launch.start_timeout_s
        assert self.process.stdout is not None
        for line in self.process.stdout:  # the agent prints its address once it listens
            if line.startswith(READY_PREFIX):
                self._address = line[len(READY_PREFIX):].strip()
                break
            if time.monotonic() > deadline:
                break
        if not self._address:
            self.process.kill()
            raise RuntimeError(f"node agent {node_id} did not start (exit status {self.process.wait()})")
        threading.Thread(target=self._drain, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            print(f"agent {self.node_id}: {line.rstrip()}", file=sys.stderr)

    def _watch(self) -> None:
        status = self.process.wait()
        if not self._stopping:  # the agent died: end this actor so that Ray restarts it (a new agent)
            print(f"node agent {self.node_id} exited with status {status}; the actor exits for Ray to restart it",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def address(self) -> str:
        return self._address

    def probe(self) -> dict[str, Any]:
        return dict(self.info)

    def health(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "pid": self.process.pid, "alive": self.process.poll() is None,
                "address": self._address}

    def stop(self) -> None:
        """End the agent (the service is stopping); the actor is killed after this."""
        self._stopping = True
        if self.process.poll() is None and self.process.stdin is not None:
            self.process.stdin.close()  # --exit-with-parent
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()


def launch_dict(launch: AgentLaunch) -> dict[str, Any]:
    return asdict(launch)
