"""The global parameter pool (BlitzScale 5.3): where every model's weights are.

Per model the pool tracks its host copies (weights cached in a node's host memory) and its
running instances (engines holding the weights, on any node). Rules:

- O(1) host caching: a registered model always has at least one host copy cluster-wide.
  Registration places that first copy on the node with the most free host memory (ties:
  the node name, so the choice is deterministic); dropping the last host copy is refused
  (`LastHostCopy`): move it first (`relocate` names where to, the caller multicasts there,
  then `add_host_copy` and `drop_host_copy`).
- More host copies are a cache: they may be added where memory is free and dropped freely.
- Sources for a multicast (5.1): host copies first (idle, so loading from them does not
  interfere with serving), then running instances, one source per node.
- A node that leaves (failure, or removed) takes its copies and instances with it; the pool
  reports which models lost their last host copy, to be re-cached from an instance (the
  "Fault tolerance" paragraph of BlitzScale's appendix), and which are lost outright (those
  leave the pool: the tenant registers them again).

Only host copies count against a node's host memory here; an instance's own memory is the
node's memory subsystem's business (mesh.policy.memory). Pure: no I/O, no clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable


class PoolError(ValueError):
    """Bad input or a request the pool cannot satisfy."""


class LastHostCopy(PoolError):
    """Dropping this host copy would leave the model with none (O(1) caching)."""


class Where(str, Enum):
    HOST = "host"  # cached in the node's host memory
    INSTANCE = "instance"  # held by a running engine instance on the node


@dataclass(frozen=True, slots=True)
class Location:
    model: str
    node: str
    where: Where
    instance_id: str | None = None


@dataclass(slots=True)
class HostMemory:
    capacity_bytes: int
    used_bytes: int = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


@dataclass(frozen=True, slots=True)
class NodeLoss:
    """What removing a node did: `recache` models lost their last host copy but still run
    somewhere (multicast from an instance to `ParameterPool.choose_host`); `lost` models have
    no copy left at all."""

    node: str
    recache: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()


@dataclass(slots=True)
class _Model:
    size_bytes: int
    hosts: set[str] = field(default_factory=set)
    instances: dict[str, str] = field(default_factory=dict)  # instance id -> node


class ParameterPool:
    def __init__(self) -> None:
        self._nodes: dict[str, HostMemory] = {}
        self._models: dict[str, _Model] = {}

    # --- nodes -----------------------------------------------------------------------------
    def add_node(self, node: str, host_capacity_bytes: int) -> None:
        if node in self._nodes:
            raise PoolError(f"node {node!r} is already in the pool")
        if host_capacity_bytes < 0:
            raise PoolError(f"node {node!r}: host capacity must be >= 0, got {host_capacity_bytes}")
        self._nodes[node] = HostMemory(host_capacity_bytes)

    def remove_node(self, node: str) -> NodeLoss:
        """The node leaves with everything on it (a failure, or decommissioning)."""
        self._node(node)
        recache: list[str] = []
        lost: list[str] = []
        for name, m in self._models.items():
            gone = [i for i, n in m.instances.items() if n == node]
            if node not in m.hosts and not gone:
                continue
            m.hosts.discard(node)
            for iid in gone:
                del m.instances[iid]
            if not m.hosts:
                (recache if m.instances else lost).append(name)
        for name in lost:  # nothing left to copy from: the tenant must register it again
            del self._models[name]
        del self._nodes[node]
        return NodeLoss(node, tuple(recache), tuple(lost))

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def free_host_bytes(self, node: str) -> int:
        return self._node(node).free_bytes

    def choose_host(self, size_bytes: int, exclude: Iterable[str] = (),
                    among: Iterable[str] | None = None) -> str | None:
        """The node with the most free host memory that fits `size_bytes` (ties: name),
        among `among` if given (e.g. the nodes that can run the model)."""
        skip = set(exclude)
        allowed = set(among) if among is not None else None
        fits = [(-mem.free_bytes, n) for n, mem in self._nodes.items()
                if n not in skip and (allowed is None or n in allowed) and mem.free_bytes >= size_bytes]
        return min(fits)[1] if fits else None

    # --- models ----------------------------------------------------------------------------
    def register(self, model: str, size_bytes: int, among: Iterable[str] | None = None) -> str:
        """Register a model and place its first host copy (on one of `among` if given: the
        nodes that run it, so its first instance needs no transfer); returns the node."""
        if model in self._models:
            raise PoolError(f"model {model!r} is already registered")
        if size_bytes <= 0:
            raise PoolError(f"model {model!r}: size must be > 0 bytes, got {size_bytes}")
        allowed = list(among) if among is not None else list(self._nodes)
        node = self.choose_host(size_bytes, among=allowed)
        if node is None:
            most = max((m.free_bytes for n, m in self._nodes.items() if n in allowed), default=0)
            raise PoolError(f"model {model!r} ({size_bytes} B) fits in no node's host memory "
                            f"(most free: {most} B on {len(allowed)} nodes)")
        self._models[model] = _Model(size_bytes)
        self._place(model, node)
        return node

    def unregister(self, model: str) -> None:
        """Forget the model: its host copies are freed (its instances must be gone)."""
        m = self._model(model)
        if m.instances:
            raise PoolError(f"model {model!r} still has running instances: {sorted(m.instances)}")
        for node in m.hosts:
            self._nodes[node].used_bytes -= m.size_bytes
        del self._models[model]

    def add_host_copy(self, model: str, node: str) -> None:
        m = self._model(model)
        mem = self._node(node)
        if node in m.hosts:
            raise PoolError(f"model {model!r} already has a host copy on {node!r}")
        if mem.free_bytes < m.size_bytes:
            raise PoolError(f"node {node!r} has {mem.free_bytes} B of host memory free, "
                            f"model {model!r} needs {m.size_bytes} B")
        self._place(model, node)

    def drop_host_copy(self, model: str, node: str) -> None:
        m = self._model(model)
        if node not in m.hosts:
            raise PoolError(f"model {model!r} has no host copy on {node!r}")
        if len(m.hosts) == 1:
            raise LastHostCopy(f"{node!r} holds the last host copy of model {model!r}: "
                               f"relocate it before dropping (O(1) host caching)")
        m.hosts.remove(node)
        self._nodes[node].used_bytes -= m.size_bytes

    def relocate(self, model: str, node: str) -> str:
        """Where to move the host copy on `node` so that it can be dropped: the other node
        with the most free host memory that has no copy yet."""
        m = self._model(model)
        if node not in m.hosts:
            raise PoolError(f"model {model!r} has no host copy on {node!r}")
        dest = self.choose_host(m.size_bytes, exclude=m.hosts)
        if dest is None:
            raise PoolError(f"no other node has {m.size_bytes} B of host memory free for model {model!r}")
        return dest

    def evictable(self, node: str) -> list[str]:
        """Models whose host copy on `node` can be dropped now (not their last)."""
        self._node(node)
        return sorted(name for name, m in self._models.items() if node in m.hosts and len(m.hosts) > 1)

    def add_instance(self, model: str, node: str, instance_id: str) -> None:
        m = self._model(model)
        self._node(node)
        if any(instance_id in other.instances for other in self._models.values()):
            raise PoolError(f"instance {instance_id!r} is already in the pool")
        m.instances[instance_id] = node

    def remove_instance(self, model: str, instance_id: str) -> None:
        m = self._model(model)
        if instance_id not in m.instances:
            raise PoolError(f"model {model!r} has no instance {instance_id!r}")
        del m.instances[instance_id]

    # --- queries ---------------------------------------------------------------------------
    def models(self) -> list[str]:
        return sorted(self._models)

    def size_bytes(self, model: str) -> int:
        return self._model(model).size_bytes

    def host_copies(self, model: str) -> list[str]:
        return sorted(self._model(model).hosts)

    def locations(self, model: str) -> list[Location]:
        """Every place the model's weights are: host copies, then instances (by node, id)."""
        m = self._model(model)
        return ([Location(model, n, Where.HOST) for n in sorted(m.hosts)]
                + [Location(model, n, Where.INSTANCE, i) for i, n in sorted(m.instances.items(), key=lambda x: (x[1],
                                                                                                                x[0]))])

    def sources(self, model: str, exclude: Iterable[str] = (), use_instances: bool = True) -> list[Location]:
        """Multicast sources: one per node, host copies before instances (an idle host copy
        does not slow serving down), nodes in `exclude` left out."""
        skip = set(exclude)
        out: dict[str, Location] = {}
        for loc in self.locations(model):
            if loc.node in skip or (loc.where is Where.INSTANCE and not use_instances):
                continue
            out.setdefault(loc.node, loc)
        return list(out.values())

    def needs_recache(self) -> list[str]:
        """Models without a host copy (their last one left with a node): copy one from an
        instance to `choose_host`, then `add_host_copy`."""
        return sorted(name for name, m in self._models.items() if not m.hosts)

    def check(self) -> None:
        """Invariants (for tests): every model has a host copy, or is waiting for one and
        still runs somewhere; host memory adds up."""
        used = {n: 0 for n in self._nodes}
        for name, m in self._models.items():
            if not m.hosts and not m.instances:
                raise AssertionError(f"model {name!r} has no copy at all")
            for n in m.hosts:
                used[n] += m.size_bytes
        for n, mem in self._nodes.items():
            if mem.used_bytes != used[n] or mem.used_bytes > mem.capacity_bytes:
                raise AssertionError(f"node {n!r}: used {mem.used_bytes} B, copies {used[n]} B, capacity "
                                     f"{mem.capacity_bytes} B")

    # --- internals -------------------------------------------------------------------------
    def _place(self, model: str, node: str) -> None:
        m = self._models[model]
        m.hosts.add(node)
        self._nodes[node].used_bytes += m.size_bytes

    def _node(self, node: str) -> HostMemory:
        if node not in self._nodes:
            raise PoolError(f"unknown node {node!r}")
        return self._nodes[node]

    def _model(self, model: str) -> _Model:
        if model not in self._models:
            raise PoolError(f"unknown model {model!r}")
        return self._models[model]
