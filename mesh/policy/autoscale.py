"""How many nodes Mesh wants, and which idle ones it lets go (`mesh serve --ray-autoscale`).

The number of nodes in use is the paper's cost metric. A node is *in use* while it holds an
instance (loading or ready) or a request. Mesh asks for the nodes in use, plus one when
requests wait refused for capacity (the placement would scale out if it had a node), and at
least `min_nodes`. A node that has held nothing for `idle_release_s` is released (beyond
`min_nodes`), so the cluster shrinks when Mesh packs models onto fewer nodes. Pure rules: the
caller measures idle times and acts (mesh.ray.node_autoscaler).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeUse:
    node: str
    instances: int  # loading or ready
    requests: int  # running or queued
    idle_s: float  # how long it has held no instance and no request (0 while in use)

    @property
    def in_use(self) -> bool:
        return self.instances > 0 or self.requests > 0


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    wanted: int  # nodes to ask the autoscaler for
    release: tuple[str, ...]  # idle nodes to let go, longest idle first


def decide(nodes: list[NodeUse], refused_waiting: int, idle_release_s: float, min_nodes: int = 1) -> ScaleDecision:
    """`refused_waiting`: requests waiting in admission queues after a refusal for capacity."""
    if idle_release_s < 0 or min_nodes < 0:
        raise ValueError("idle_release_s and min_nodes must be at least 0")
    used = sum(1 for n in nodes if n.in_use)
    wanted = max(min_nodes, used + (1 if refused_waiting > 0 else 0))
    idle = sorted((n for n in nodes if not n.in_use and n.idle_s >= idle_release_s), key=lambda n: (-n.idle_s, n.node))
    keep = max(0, wanted - used)  # idle nodes kept to reach `wanted`: the most recently used
    return ScaleDecision(wanted, tuple(n.node for n in idle[:max(0, len(idle) - keep)]))
