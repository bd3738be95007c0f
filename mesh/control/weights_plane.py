"""The control service's weights plane: the parameter pool made real (BlitzScale 5.1, 5.3).

The registry keeps each model's files (an upload, or a path under --allowed-dir): the
*origin*, BlitzScale's remote storage. The nodes never read it. Instead:

- Registration places the model's first host copy (O(1) host caching, 5.3): the pool
  (mesh.policy.param_pool) chooses, among the nodes of the kind that runs the model (CPU
  for GGUF and IR, GPU for Hugging Face folders), the one with the most free host memory,
  and the origin,
  a weights agent inside the control service, sends the file there over the weights
  transport (mesh.weights: checksummed blocks, written atomically into the node's
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

A model is one file (GGUF) or a folder of files (OpenVINO IR: the .xml, .bin and tokenizer
files; a Hugging Face folder for vLLM: config, safetensors, tokenizer); each file travels as
its own multicast, one after the other, and the node's copy is the file, or the folder
`<weights dir>/<model uid>/` holding them. Host copies live in the node's weights folder
(and its page cache). A folder with subfolders does not travel: its engine loads it from
the registry's path (a shared disk).

A model registered once may have a copy per kind of node (mesh.service.preparation: a GGUF
converted to a Hugging Face folder for vLLM): each format is its own entry of the pool,
keyed by `ModelFormat.key` (the model uid for the registered format, `<uid>.<kind>` for a
prepared one), with its own first host copy on a node of its kind, multicasts and cached
copies, by the same rules. Deleting the model forgets all of its formats.

The weights port of every agent and of the origin requires the service's weights token
(MESH_WEIGHTS_TOKEN, generated at start).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

from mesh.policy.multicast import make_plan
from mesh.policy.node_spec import NodeSpec
from mesh.policy.param_pool import ParameterPool, PoolError, Where
from mesh.weights.blocks import Manifest, pack
from mesh.weights.coordinator import multicast
from mesh.weights.peer import WeightAgent
from mesh.weights.receiver import AgentClient, weights_address
from mesh.wire.agent_protocol import WeightsDrop, WeightsPath


class ModelRecord(Protocol):
    """What the plane reads of a registered model (mesh.service.registry.ModelRecord)."""

    uid: str
    tenant: str
    name: str

    @property
    def native_kind(self) -> str: ...

    def path_for(self, kind: str) -> str: ...

log = logging.getLogger(__name__)

ORIGIN = "origin"  # the control service's own weights agent, sending from the registry's files
CALL_TIMEOUT_S = 30.0


class NodeHandle(Protocol):
    """What the plane needs of a node agent (mesh.control.supervisor.LocalAgent)."""

    node_id: str
    spec: NodeSpec
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
    # the folders the origin may send files from (the registry's and the prepared copies'; None: any)
    source_roots: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class ModelFormat:
    """One format of a registered model, as the weights plane moves and caches it."""

    model_uid: str
    node_kind: str  # the nodes that run this format
    path: str  # its origin: the registry's file or folder, or the prepared copy in the data folder
    label: str  # "tenant/name", for messages
    native: bool = True  # the registered format (else prepared by the service)

    @property
    def key(self) -> str:
        """Its entry in the parameter pool and its folder on the nodes."""
        return self.model_uid if self.native else f"{self.model_uid}.{self.node_kind}"

    @classmethod
    def of(cls, record: ModelRecord, kind: str | None = None) -> "ModelFormat":
        """The format of `record` that nodes of `kind` run (default: the registered one);
        KeyError if it has none ready for that kind."""
        kind = kind or record.native_kind
        return cls(record.uid, kind, record.path_for(kind), f"{record.tenant}/{record.name}",
                   kind == record.native_kind)


def as_format(model: ModelRecord | ModelFormat) -> ModelFormat:
    """A registry record stands for its registered format."""
    return model if isinstance(model, ModelFormat) else ModelFormat.of(model)


@dataclass(frozen=True, slots=True)
class NodeCopy:
    """A model's copy on a node (its file, or its folder), and how it got there."""

    path: str
    how: str  # "host copy", "host copy (already on the node)", "origin" or "multicast from a, b"


@dataclass(frozen=True, slots=True)
class _File:
    name: str
    origin_path: str  # the registry's file
    manifest: Manifest


@dataclass
class _ModelWeights:
    fmt: ModelFormat
    folder: bool  # the model is a folder of `files` (else one file)
    files: list[_File]
    paths: dict[str, str] = field(default_factory=dict)  # node -> its copy (the file, or the folder)
    file_paths: dict[tuple[str, str], str] = field(default_factory=dict)  # (node, file name) -> path there
    how: dict[str, str] = field(default_factory=dict)  # node -> how the file got there
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wanted: set[str] = field(default_factory=set)  # targets waiting for the next transfer
    transfers: list[dict[str, Any]] = field(default_factory=list)  # what was sent, for the view

    @property
    def total_bytes(self) -> int:
        return sum(f.manifest.total_bytes for f in self.files)

    def forget(self, node: str) -> None:
        """The node's copy is gone, or no longer trusted."""
        self.paths.pop(node, None)
        self.how.pop(node, None)
        for f in self.files:
            self.file_paths.pop((node, f.name), None)


def model_files(path: str | Path) -> list[Path] | None:
    """The files a model travels as: [the file], or a folder's files; None for a folder with
    subfolders (it does not travel)."""
    p = Path(path)
    if p.is_file():
        return [p]
    entries = sorted(p.iterdir())
    if any(e.is_dir() for e in entries):
        return None
    return [e for e in entries if e.is_file()]


class WeightsPlane:
    def __init__(self, nodes: Mapping[str, NodeHandle], settings: WeightsSettings | None = None,
                 host_bytes: Mapping[str, int] | None = None) -> None:
        """`nodes`: the node agents by id; `host_bytes`: each node's host memory for copies
        (default: its memory budget, known once its agent said hello)."""
        self.settings = settings or WeightsSettings()
        self.nodes = nodes
        self.host_bytes = dict(host_bytes or {})
        self.pool = ParameterPool()
        self.origin = WeightAgent(token=self.settings.token, source_roots=self.settings.source_roots)
        self._models: dict[str, _ModelWeights] = {}
        self._registering: dict[str, asyncio.Lock] = {}
        self._lost: dict[str, _ModelWeights] = {}  # models whose last copy left with a node

    async def start(self) -> None:
        await self.origin.start()

    async def stop(self) -> None:
        await self.origin.close()

    @staticmethod
    def carries(model: ModelRecord | ModelFormat) -> bool:
        """Does this model (format) travel by the weights plane (a file, or a folder of files)?"""
        try:
            return model_files(as_format(model).path) is not None
        except (OSError, KeyError):
            return False

    # ---- the pool's rules, made real ------------------------------------------------------
    async def register(self, model: ModelRecord | ModelFormat) -> str:
        """Place the model's (format's) first host copy (BlitzScale 5.3) on a node of the
        kind that runs it, and return that node."""
        fmt = as_format(model)
        key = fmt.key
        self._add_nodes()
        lock = self._registering.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self._models:
                return self.pool.host_copies(key)[0]
            entry = await asyncio.to_thread(self._pack, fmt)
            # a node that is down (an agent restarting) cannot take it now: never chosen while another is up
            kind = [n for n, h in self.nodes.items() if h.spec.kind == fmt.node_kind]
            among = [n for n in kind if self._up(n)] or kind
            try:
                node = self.pool.register(key, entry.total_bytes, among=among)
            except PoolError:
                await self._make_room(entry.total_bytes, among)
                try:
                    node = self.pool.register(key, entry.total_bytes, among=among)
                except PoolError as exc:
                    raise WeightsError(f"model {fmt.label}: {exc}") from exc
            try:
                failed = await self._send(fmt, entry, [ORIGIN], [node])
            except BaseException:
                self.pool.unregister(key)
                raise
            if failed:
                self.pool.unregister(key)
                raise WeightsError(f"placing the first copy of model {fmt.label} on {node} failed: {failed[node]}")
            self._models[key] = entry
            self._lost.pop(key, None)
            log.info("model %s (%s nodes): first host copy on %s", fmt.label, fmt.node_kind, node)
            return node

    def _pack(self, fmt: ModelFormat) -> _ModelWeights:
        files = model_files(fmt.path)
        if not files:
            raise WeightsError(f"model {fmt.label}: {fmt.path} holds no files to send")
        return _ModelWeights(fmt, Path(fmt.path).is_dir(), [
            _File(f.name, str(f), pack(f, self.settings.block_bytes, f"{fmt.key}/{f.name}")) for f in files])

    async def copy_on(self, model: ModelRecord | ModelFormat, node: str) -> NodeCopy:
        """The model's (format's) copy on `node`: its host copy, or one multicast there now."""
        fmt = as_format(model)
        if fmt.key not in self._models:
            await self.register(fmt)
        self._add_nodes()
        entry = self._models[fmt.key]
        if node in entry.paths:
            return NodeCopy(entry.paths[node], "host copy")
        entry.wanted.add(node)
        await asyncio.sleep(0)  # let targets asked for in the same tick join this transfer
        async with entry.lock:
            if node not in entry.paths:
                if not self._up(node):
                    entry.wanted.discard(node)
                    raise WeightsError(f"node {node} is down; it cannot receive model {fmt.label}")
                targets = sorted({node} | {t for t in entry.wanted if t not in entry.paths and self._up(t)})
                entry.wanted.difference_update(targets)
                failed = await self._send(fmt, entry, self._sources(fmt.key, entry, targets), targets)
                if node in failed and len(targets) > 1:  # another target may have failed the whole multicast
                    failed = await self._send(fmt, entry, self._sources(fmt.key, entry, [node]), [node])
                if node in failed:
                    raise WeightsError(f"sending model {fmt.label} to {node} failed: {failed[node]}")
        return NodeCopy(entry.paths[node], entry.how[node])

    def holders(self, key: str) -> list[str]:
        """Nodes holding a model format's files (host copies and the copies instances
        loaded); `key`: ModelFormat.key (the model uid for its registered format)."""
        entry = self._models.get(key)
        return sorted(entry.paths) if entry is not None else []

    def _key_on(self, model_uid: str, node: str) -> str | None:
        """The pool entry of the model's format that `node`'s kind runs."""
        handle = self.nodes.get(node)
        kind = handle.spec.kind if handle is not None else None
        return next((k for k, e in self._models.items() if e.fmt.model_uid == model_uid and e.fmt.node_kind == kind),
                    None)

    def _keys_of(self, model_uid: str) -> list[str]:
        known = {**self._lost, **self._registering, **self._models}
        return [k for k in known if k == model_uid or k.startswith(model_uid + ".")]

    def node_down(self, node: str) -> None:
        """The node's agent went away: what its disk holds is checked again (block by block)
        before the node is trusted as a holder or a source; a remote machine may come back
        without it. The pool keeps its host copies until then."""
        for entry in self._models.values():
            entry.forget(node)

    def node_removed(self, node: str) -> None:
        """The node left the cluster: its copies and instances leave the pool. A model whose
        only host copy was there is forgotten here; its next use places a first host copy
        again, from the registry's files (the origin)."""
        for entry in self._models.values():
            entry.forget(node)
            entry.wanted.discard(node)
        if node not in self.pool.nodes():
            return
        loss = self.pool.remove_node(node)
        for key in loss.lost:
            gone = self._models.pop(key, None)
            self._registering.pop(key, None)
            if gone is not None:
                self._lost[key] = gone  # a transfer under way may still bring it to another node
            log.warning("model %s: its last copy left with node %s; the next use sends it from the origin", key, node)
        for key in loss.recache:
            log.warning("model %s: no host copy left after node %s; its instances still hold it", key, node)

    def instance_started(self, model_uid: str, node: str, instance_id: str) -> None:
        key = self._key_on(model_uid, node)
        if key is not None:
            try:
                self.pool.add_instance(key, node, instance_id)
            except PoolError as exc:  # bookkeeping only: it must not stop the instance from serving
                log.warning("parameter pool: %s", exc)

    def instance_stopped(self, model_uid: str, instance_id: str) -> None:
        for key in self._keys_of(model_uid):
            if key in self._models and any(loc.instance_id == instance_id for loc in self.pool.locations(key)):
                self.pool.remove_instance(key, instance_id)

    async def forget(self, model_uid: str) -> None:
        """The model was deleted: the pool forgets each of its formats and the nodes that
        are up delete their copies (a node that is down keeps its files)."""
        for key in self._keys_of(model_uid):
            await self._forget_key(key)

    async def _forget_key(self, key: str) -> None:
        entry = self._models.pop(key, None)
        self._registering.pop(key, None)
        self._lost.pop(key, None)
        if entry is None:
            return
        for loc in self.pool.locations(key):
            if loc.where is Where.INSTANCE and loc.instance_id is not None:
                self.pool.remove_instance(key, loc.instance_id)
        self.pool.unregister(key)
        for node in self.nodes:  # every node: one that restarted may hold a copy not yet checked again
            await self._drop_files(key, node)

    # ---- transfers ---------------------------------------------------------------------------
    def _add_nodes(self) -> None:
        """Nodes join the pool once their memory is known (a remote agent's, at its hello)."""
        known = set(self.pool.nodes())
        for node_id, handle in self.nodes.items():
            capacity = self.host_bytes.get(node_id, handle.spec.memory_bytes)
            if node_id not in known and capacity > 0:
                self.pool.add_node(node_id, capacity)

    def _up(self, node: str) -> bool:
        handle = self.nodes.get(node)
        return handle is not None and handle.up and handle.client is not None

    def _sources(self, key: str, entry: _ModelWeights, targets: list[str]) -> list[str]:
        """Pool sources that are up and hold the model (host copies first), else the origin."""
        sources = [loc.node for loc in self.pool.sources(key, exclude=targets)
                   if loc.node in entry.paths and self._up(loc.node)]
        return sources or [ORIGIN]

    async def _send(self, fmt: ModelFormat, entry: _ModelWeights, sources: list[str],
                    targets: list[str]) -> dict[str, str]:
        """Bring every file of the model to `targets` from `sources`: one multicast per file,
        to the targets that do not hold that file yet (checked block by block on the node,
        so after a restart a node that still has the model is not sent it again). A target
        that fails is left out of the later files; the rest complete. Returns why each
        failed target failed."""
        how = "origin" if ORIGIN in sources else "multicast from " + ", ".join(sorted(sources))
        failed: dict[str, str] = {}
        sent: set[str] = set()
        for f in entry.files:
            need: dict[str, str] = {}
            for node in [t for t in targets if t not in failed]:
                try:
                    reply = await self._client(node).call(WeightsPath(fmt.key, f.name, f.manifest.to_dict()),
                                                          self.settings.timeout_s)
                except Exception as exc:  # AgentDown, AgentCallError: the node cannot take it now
                    failed[node] = f"its agent did not answer: {exc}"
                    continue
                entry.file_paths[(node, f.name)] = reply.path
                if not reply.complete:
                    need[node] = reply.path
            if not need:
                continue
            try:
                addresses = {n: self._address(n) for n in [*sources, *need]}
                plan = make_plan(self.settings.plan, sources, sorted(need), f.manifest.count)
                source_paths = {s: f.origin_path if s == ORIGIN else entry.file_paths[(s, f.name)] for s in sources}
                result = await multicast(addresses, f.manifest, plan, source_paths, need,
                                         timeout_s=self.settings.timeout_s, token=self.settings.token)
            except Exception as exc:  # MulticastError, WeightsError: nothing of this file arrived
                failed.update({n: str(exc) for n in need})
                continue
            sent.update(result.outputs)
            entry.transfers.append({"file": f.name, "plan": plan.name, "sources": sorted(sources),
                                    "targets": sorted(need), "completed": sorted(result.outputs),
                                    "dropped": result.dropped, "seconds": round(result.total_s, 3),
                                    "bytes": f.manifest.total_bytes})
            for n in need:
                if n not in result.outputs:
                    failed[n] = (f"{f.name} did not reach it "
                                 f"(dropped from the multicast: {', '.join(result.dropped) or 'none'})")
        for node in targets:
            if node not in failed:
                first = entry.file_paths[(node, entry.files[0].name)]
                path = str(Path(first).parent) if entry.folder else first
                self._arrived(fmt.key, entry, node, path, how if node in sent else "host copy (already on the node)")
        for node, why in failed.items():
            log.warning("model %s did not reach %s: %s", fmt.label, node, why)
        return failed

    async def _make_room(self, size_bytes: int, among: list[str]) -> None:
        """Drop cached host copies (never a model's last, never one an instance on that node
        runs from) on the node with the most free host memory until `size_bytes` fit there."""
        for node in sorted(among, key=lambda n: (-self.pool.free_host_bytes(n), n)):
            if not self._up(node):
                continue
            for key in self.pool.evictable(node):
                if self.pool.free_host_bytes(node) >= size_bytes:
                    return
                if any(loc.node == node for loc in self.pool.locations(key) if loc.where is Where.INSTANCE):
                    continue
                self.pool.drop_host_copy(key, node)
                await self._drop_files(key, node)
                log.info("dropped the cached copy of %s on %s to make room", key, node)
            if self.pool.free_host_bytes(node) >= size_bytes:
                return

    async def _drop_files(self, key: str, node: str) -> None:
        entry = self._models.get(key)
        if entry is not None:
            entry.forget(node)
        if self._up(node):
            try:
                await self._client(node).call(WeightsDrop(key), CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a leftover file must not fail the caller
                log.warning("node %s kept the files of %s: %s", node, key, exc)

    def _arrived(self, key: str, entry: _ModelWeights, node: str, path: str, how: str) -> None:
        """The node holds the model's file: a host copy while its host memory allows."""
        if key not in self.pool.models() and self._lost.get(key) is entry:  # its last holder left meanwhile
            try:
                self.pool.register(key, entry.total_bytes, among=[node])
            except PoolError:
                pass
            else:
                self._models[key] = self._lost.pop(key)
        entry.paths[node] = path
        entry.how[node] = how
        if key not in self.pool.models():
            return
        if node not in self.pool.host_copies(key) and self.pool.free_host_bytes(node) >= entry.total_bytes:
            self.pool.add_host_copy(key, node)

    def _client(self, node: str) -> AgentClient:
        client = self.nodes[node].client
        if client is None:
            raise WeightsError(f"node {node} is not connected")
        return client

    def _address(self, node: str) -> tuple[str, int]:
        if node == ORIGIN:
            return self.origin.host, self.origin.port
        return weights_address(self._client(node))

    # ---- views -------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """Per model format (ModelFormat.key): host copies, instances, and the transfers
        that placed them."""
        out = {}
        for key, entry in self._models.items():
            locations = self.pool.locations(key)
            out[key] = {
                "model": entry.fmt.model_uid, "node_kind": entry.fmt.node_kind, "native": entry.fmt.native,
                "bytes": entry.total_bytes, "files": len(entry.files),
                "blocks": sum(f.manifest.count for f in entry.files),
                "host_copies": [loc.node for loc in locations if loc.where is Where.HOST],
                "instances": {loc.instance_id: loc.node for loc in locations if loc.where is Where.INSTANCE},
                "copies": dict(entry.paths), "transfers": list(entry.transfers),
            }
        return {"plan": self.settings.plan, "block_bytes": self.settings.block_bytes, "models": out}
