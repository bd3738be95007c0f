"""A node agent's weights receiver: engines start from received weights.

With `--weights-listen HOST:PORT` the node agent hosts a weights agent
(mesh.weights.peer) on its own event loop, on a second port. A coordinator
(mesh.weights.coordinator.multicast) then sends the node a model's blocks, which it
verifies, forwards as its plan says, and writes atomically into the node's data folder:
`<weights dir>/<model>/<file name>`. The control service learns the address and the folder
from `hello` (`weights: {address, dir}`) and asks the agent where a model's file goes with
`weights_path {model, file}` -> `{path}`; the `load` that follows names that path, so the
engine (OpenVINO: the received GGUF, or the IR folder's files) builds from the node's own
copy and a scale-out to a node without the model needs no shared disk. `send_model` does
those steps for connected agents (the control service's side).

What this node accepts: with a token (the node agent reads it from the environment variable
MESH_WEIGHTS_TOKEN; unset: none, for a trusted network), every connection to the weights
port, a coordinator's `start` or a peer's blocks, must carry it in its first frame, or it is
answered with an `error` ("weights token missing/wrong") and closed before any block is
accepted; the coordinator (`multicast(..., token=)`, `send_model(..., token=)`) and the
agents forwarding to each other send it, so the nodes of a multicast share one token. A
transfer may write its output only inside the weights folder (a `start` whose `output_path`
points elsewhere is answered with an `error`), and it sends only files inside that folder (a
`source_path` elsewhere, or a symlink leading out, is answered with an `error` that names no
path, size or hash: the node's log has those). Its node agent widens that to the folders its
`load` may open (its --models-root folders).

The receiver shares the agent's loop: block reads happen between engine iterations, and
checksums and the file write run in worker threads (sha256 releases the GIL).
"""
from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any, Mapping, Protocol, TypeVar

from mesh.policy.multicast import make_plan
from mesh.weights.blocks import Manifest
from mesh.weights.coordinator import MulticastResult, multicast
from mesh.weights.frames import ProtocolError, send
from mesh.weights.peer import WeightAgent, inside  # noqa: F401 - inside: part of this module's API
from mesh.wire.agent_protocol import HelloReply, Request, WeightsPath

R = TypeVar("R")


class AgentClient(Protocol):
    """What the weights need of a connection to a node agent (mesh.control.agent_client.AgentClient):
    its name and address, the agent's hello, and a call."""

    name: str
    address: str
    hello: HelloReply | None

    async def call(self, request: Request[R], timeout_s: float | None = None) -> R: ...


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(name: str) -> str:
    """One path component from a model id or file name ('org/model:v1' -> 'org_model_v1')."""
    cleaned = _UNSAFE.sub("_", name).strip("._")
    if not cleaned:
        raise ValueError(f"{name!r} gives an empty file name")
    return cleaned[:200]


def received_path(root: Path, model: str, file_name: str) -> Path:
    """Where a node keeps a received model file: <root>/<model>/<file name>."""
    return Path(root) / safe_name(model) / safe_name(Path(file_name).name)


class NodeWeightsReceiver(WeightAgent):
    """A weights agent that writes received models only under `root`."""

    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 link_bytes_per_s: float | None = None) -> None:
        """`link_bytes_per_s`: pace what this node sends (its uplink, mesh.weights.peer); None: unpaced."""
        super().__init__(host, port, link_bytes_per_s, token=token,
                         source_roots=[root])  # its agent adds its model folders
        self.root = Path(root)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        return await super().start()

    async def _start(self, h: dict[str, Any], control: asyncio.StreamWriter) -> Any:
        out = h.get("output_path")
        if out and not inside(self.root, out):
            reason = f"output path {out} is outside this node's weights folder {self.root}"
            await send(control, {"type": "error", "transfer": str(h.get("transfer")), "node": str(h.get("node")),
                                 "reason": reason})
            raise ProtocolError(reason)
        return await super()._start(h, control)

    def info(self) -> dict[str, str]:
        return {"address": self.address, "dir": str(self.root)}


def parse_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT' (port 0: any free port) -> (host, port)."""
    host, _, port = listen.rpartition(":")
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        raise ValueError(f"--weights-listen must be HOST:PORT, got {listen!r}") from None


def weights_address(client: AgentClient) -> tuple[str, int]:
    """The weights receiver of a connected agent; ValueError if it hosts none. A receiver on
    an unspecified host (0.0.0.0, ::) is reached at the host the agent itself was reached at."""
    info = client.hello.weights if client.hello is not None else None
    if not info:
        raise ValueError(f"node {client.name} receives no weights (its agent runs without --weights-listen)")
    host, port = parse_listen(str(info["address"]))
    if host in ("0.0.0.0", "::", "[::]") and client.address and not client.address.startswith("unix:"):
        host = client.address.rpartition(":")[0]
    return host, port


async def send_model(manifest: Manifest, file_name: str, sources: Mapping[str, tuple[AgentClient, str]],
                     targets: Mapping[str, AgentClient], plan: str = "binomial",
                     timeout_s: float = 300.0, token: str | None = None) -> MulticastResult:
    """Multicast a model from `sources` (node -> (its agent, the model file there)) into each
    target's weights folder; `result.outputs[node]` is the path to `load` on that node.
    token: the nodes' weights token (their MESH_WEIGHTS_TOKEN; None: they run without one)."""
    agents = {n: weights_address(c) for n, (c, _) in sources.items()}
    agents.update({n: weights_address(c) for n, c in targets.items()})
    outputs = {n: (await c.call(WeightsPath(manifest.model, file_name))).path for n, c in targets.items()}
    chosen = make_plan(plan, list(sources), list(targets), manifest.count)
    return await multicast(agents, manifest, chosen, {n: path for n, (_, path) in sources.items()}, outputs,
                           timeout_s=timeout_s, token=token)
