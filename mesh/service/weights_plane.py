"""The control service's weights plane: the parameter pool made real (BlitzScale 5.1, 5.3).

The registry keeps each model's file (an upload, or a path under --allowed-dir): the
*origin*, BlitzScale's remote storage. The nodes never read it. Instead:

- Registration places the model's first host copy (O(1) host caching, 5.3): the pool
  (mesh.policy.param_pool) chooses the node with the most free host memory, and the origin,
  a weights agent inside the control service, sends the file there over the weights
  transport (mesh.runtime.weights: checksummed blocks, written atomically into the node's
  weights folder). A model registered before a restart gets its copy on first use.
- A node that starts an instance of a model it does not hold gets the model by multicast
  from the pool's sources (5.1): nodes with a host copy first, then nodes running an
  instance; the origin only when no node can send. Targets that ask while a transfer of the
  model is running go together in the next one, so a scale-out to several nodes is one
  multicast (binomial pipeline by default, λScale 4.2). The received file stays as a cached
  host copy while the node's host memory allows.
- The engine loads the node's own copy (the `load` names its path on that node), so a
  scale-out to a node without the model needs no shared disk.
- Before sending, each target checks the file it may already have against the manifest
  (size and every block's sha256): after a restart of the service or of an agent, a node
  that still holds a model is not sent it again.

Host copies live in the node's weights folder (and its page cache). Only single-file models (GGUF) travel this way; OpenVINO IR and
Hugging Face folders are loaded from the registry's path (a shared disk), as before.

The weights port of every agent and of the origin requires the service's weights token
(MESH_WEIGHTS_TOKEN, generated at start).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

from mesh.agent.client import AgentClient
from mesh.agent.weights import weights_address
from mesh.policy.multicast import make_plan
from mesh.policy.param_pool import ParameterPool, PoolError, Where
from mesh.runtime.weights.agent import WeightAgent
from mesh.runtime.weights.blocks import Manifest, pack
from mesh.runtime.weights.coordinator import multicast
from mesh.service.registry import ModelRecord

log = logging.getLogger("mesh.service.weights")

ORIGIN = "origin"  # the control service's own weights agent, sending from the registry's files
CALL_TIMEOUT_S = 30.0


class NodeHandle(Protocol):
    """What the plane needs of a node agent (mesh.agent.supervisor.LocalAgent)."""

    node_id: str
    client: AgentClient | None

    @property
    def up(self) -> bool: ...


class WeightsError(RuntimeError):
    """A model's weights could not be brought to a node; the message says why."""


@dataclass(frozen=True, slots=True)
class WeightsSettings:
    plan: str = "binomial"  # naive, chain or binomial (mesh.policy.multicast)
    block_bytes: int = 4 << 20
    timeout_s: float = 600.0
    token: str | None = None  # the weights token every agent was started with


@dataclass(frozen=True, slots=True)
class NodeCopy:
    """A model's file on a node, and how it got there."""

    path: str
    how: str  # "host copy" (already there) or "multicast from a, b" / "origin"


@dataclass
class _ModelWeights:
    manifest: Manifest
    origin_path: str  # the registry's file
    paths: dict[str, str] = field(default_factory=dict)  # node -> its file
    how: dict[str, str] = field(default_factory=dict)  # node -> how the file got there
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wanted: set[str] = field(default_factory=set)  # targets waiting for the next transfer
    transfers: list[dict[str, Any]] = field(default_factory=list)  # what was sent, for the view


class WeightsPlane:
    def __init__(self, nodes: Mapping[str, NodeHandle], host_bytes: Mapping[str, int],
                 settings: WeightsSettings | None = None) -> None:
        """`nodes`: the node agents by id; `host_bytes`: each node's host memory for copies."""
        self.settings = settings or WeightsSettings()
        self.nodes = nodes
        self.pool = ParameterPool()
        for node_id, capacity in host_bytes.items():
            self.pool.add_node(node_id, capacity)
        self.origin = WeightAgent(token=self.settings.token)
        self._models: dict[str, _ModelWeights] = {}
        self._registering: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        await self.origin.start()

    async def stop(self) -> None:
        await self.origin.close()

    @staticmethod
    def carries(model: ModelRecord) -> bool:
        """Does this model travel by the weights plane (a single file)?"""
        return model.kind == "gguf"

    # ---- the pool's rules, made real ------------------------------------------------------
    async def register(self, model: ModelRecord) -> str:
        """Place the model's first host copy (BlitzScale 5.3) and return its node."""
        lock = self._registering.setdefault(model.uid, asyncio.Lock())
        async with lock:
            if model.uid in self._models:
                return self.pool.host_copies(model.uid)[0]
            manifest = await asyncio.to_thread(pack, model.path, self.settings.block_bytes, model.uid)
            try:
                node = self.pool.register(model.uid, manifest.total_bytes)
            except PoolError as exc:
                raise WeightsError(f"model {model.tenant}/{model.name}: {exc}") from exc
            entry = _ModelWeights(manifest, model.path)
            try:
                await self._send(model, entry, {ORIGIN: model.path}, [node])
            except BaseException:
                self.pool.unregister(model.uid)
                raise
            self._models[model.uid] = entry
            log.info("model %s/%s: first host copy on %s", model.tenant, model.name, node)
            return node

    async def copy_on(self, model: ModelRecord, node: str) -> NodeCopy:
        """The model's file on `node`: its host copy, or one multicast there now."""
        if model.uid not in self._models:
            await self.register(model)
        entry = self._models[model.uid]
        if node in entry.paths:
            return NodeCopy(entry.paths[node], "host copy")
        entry.wanted.add(node)
        await asyncio.sleep(0)  # let targets asked for in the same tick join this transfer
        async with entry.lock:
            if node not in entry.paths:
                targets = sorted(t for t in entry.wanted if t not in entry.paths and self._up(t))
                entry.wanted.difference_update(targets)
                if node not in targets:
                    raise WeightsError(f"node {node} is down; it cannot receive model {model.tenant}/{model.name}")
                await self._send(model, entry, self._sources(model.uid, entry, targets), targets)
        return NodeCopy(entry.paths[node], entry.how[node])

    def holders(self, model_uid: str) -> list[str]:
        """Nodes holding the model's file (host copies and the copies instances loaded)."""
        entry = self._models.get(model_uid)
        return sorted(entry.paths) if entry is not None else []

    def instance_started(self, model_uid: str, node: str, instance_id: str) -> None:
        if model_uid in self._models:
            self.pool.add_instance(model_uid, node, instance_id)

    def instance_stopped(self, model_uid: str, instance_id: str) -> None:
        if model_uid in self._models and any(loc.instance_id == instance_id for loc in self.pool.locations(model_uid)):
            self.pool.remove_instance(model_uid, instance_id)

    async def forget(self, model_uid: str) -> None:
        """The model was deleted: the pool forgets it and the nodes delete their copies."""
        entry = self._models.pop(model_uid, None)
        self._registering.pop(model_uid, None)
        if entry is None:
            return
        for loc in self.pool.locations(model_uid):
            if loc.where is Where.INSTANCE and loc.instance_id is not None:
                self.pool.remove_instance(model_uid, loc.instance_id)
        self.pool.unregister(model_uid)
        for node, path in entry.paths.items():
            if self._up(node):
                try:
                    await self.nodes[node].client.call({"t": "weights_drop", "model": model_uid}, CALL_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - a leftover file must not fail a deletion
                    log.warning("node %s kept %s: %s", node, path, exc)

    # ---- transfers ---------------------------------------------------------------------------
    def _up(self, node: str) -> bool:
        handle = self.nodes.get(node)
        return handle is not None and handle.up and handle.client is not None

    def _sources(self, uid: str, entry: _ModelWeights, targets: list[str]) -> dict[str, str]:
        """Pool sources that are up and hold the file (host copies first), else the origin."""
        sources = {loc.node: entry.paths[loc.node] for loc in self.pool.sources(uid, exclude=targets)
                   if loc.node in entry.paths and self._up(loc.node)}
        return sources or {ORIGIN: entry.origin_path}

    async def _send(self, model: ModelRecord, entry: _ModelWeights, sources: dict[str, str],
                    targets: list[str]) -> None:
        targets = list(targets)
        addresses: dict[str, tuple[str, int]] = {}
        outputs: dict[str, str] = {}
        try:
            for node in list(targets):  # a node that still has the model on disk (a restart) needs no transfer
                reply = await self.nodes[node].client.call(
                    {"t": "weights_path", "model": model.uid, "file": Path(entry.origin_path).name,
                     "manifest": entry.manifest.to_dict()}, self.settings.timeout_s)
                if reply.get("complete"):
                    self._arrived(model.uid, entry, node, str(reply["path"]), "host copy (already on the node)")
                    targets.remove(node)
                else:
                    outputs[node] = str(reply["path"])
            if not targets:
                return
            for node in [*sources, *targets]:
                addresses[node] = self._address(node)
            plan = make_plan(self.settings.plan, list(sources), targets, entry.manifest.count)
            result = await multicast(addresses, entry.manifest, plan, sources, outputs,
                                     timeout_s=self.settings.timeout_s, token=self.settings.token)
        except WeightsError:
            raise
        except Exception as exc:  # MulticastError, or AgentDown / AgentCallError: a target went away
            raise WeightsError(f"sending model {model.tenant}/{model.name} to {', '.join(targets)} failed: {exc}") from exc
        how = "origin" if ORIGIN in sources else "multicast from " + ", ".join(sorted(sources))
        for node in targets:
            if node in result.outputs:
                self._arrived(model.uid, entry, node, result.outputs[node], how)
        entry.transfers.append({"plan": plan.name, "sources": sorted(sources), "targets": targets,
                                "completed": sorted(result.outputs), "dropped": result.dropped,
                                "seconds": round(result.total_s, 3), "bytes": entry.manifest.total_bytes})
        missing = [n for n in targets if n not in result.outputs]
        if missing:
            raise WeightsError(f"model {model.tenant}/{model.name} did not reach {', '.join(missing)} "
                               f"(dropped: {', '.join(result.dropped) or 'none'})")

    def _arrived(self, uid: str, entry: _ModelWeights, node: str, path: str, how: str) -> None:
        """The node holds the model's file: a host copy while its host memory allows."""
        entry.paths[node] = path
        entry.how[node] = how
        if node not in self.pool.host_copies(uid) and self.pool.free_host_bytes(node) >= entry.manifest.total_bytes:
            self.pool.add_host_copy(uid, node)

    def _address(self, node: str) -> tuple[str, int]:
        if node == ORIGIN:
            return self.origin.host, self.origin.port
        client = self.nodes[node].client
        if client is None:
            raise WeightsError(f"node {node} is not connected")
        return weights_address(client)

    # ---- views -------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """Per model: host copies, instances, and the transfers that placed them."""
        out = {}
        for uid, entry in self._models.items():
            locations = self.pool.locations(uid)
            out[uid] = {
                "bytes": entry.manifest.total_bytes, "blocks": entry.manifest.count,
                "host_copies": [loc.node for loc in locations if loc.where is Where.HOST],
                "instances": {loc.instance_id: loc.node for loc in locations if loc.where is Where.INSTANCE},
                "files": dict(entry.paths), "transfers": list(entry.transfers),
            }
        return {"plan": self.settings.plan, "block_bytes": self.settings.block_bytes, "models": out}
