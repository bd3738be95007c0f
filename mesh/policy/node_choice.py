"""Which node of the service serves a request for a model: pure rules over node views.

The service's placement (mesh.service.placement) keeps one instance of a model per node and
asks this module where a request goes. The order follows LLM-Mesh 4 (existing instances
first, a new instance only when none can take the request) with BlitzScale 5.3's pool added
(a node that already holds the weights starts without a transfer):

1. A node whose instance of the model is ready or loading and not refusing: the request goes
   there. Among several, the fullest (most active requests) first: bin-packing keeps the
   others free to be recycled (LLM-Mesh 7.2); ties by node id.
2. Otherwise (no instance, or every instance's node refuses: its shadow validation turned a
   queued request of this model away) scale out: a node of the model's kind without an
   instance that is up and has the weights' bytes free in its memory budget, nodes with a
   host copy of the weights first (no transfer), then the fullest that fits (LLM-Mesh 4:
   idle nodes stay idle), ties by node id.
3. No node to scale to: the least queued instance (the request waits there for capacity).

No I/O, no clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class NodeView:
    node_id: str
    kind: str  # "cpu" or "gpu"
    up: bool
    free_bytes: int  # memory budget left for a new instance
    used_bytes: int = 0  # memory budget in use (the fullest-first order)
    instance: str | None = None  # "ready" or "loading" when the node has the model's instance
    refusing: bool = False  # a queued request of the model was refused there and still waits
    active: int = 0  # the model's requests admitted on the node
    queued: int = 0  # the model's requests waiting for admission on the node
    host_copy: bool = False  # the node holds the model's weights (parameter pool)


@dataclass(frozen=True, slots=True)
class NodeChoice:
    node_id: str
    new_instance: bool  # the request starts an instance there (a scale-out)
    reason: str


def choose_node(nodes: Sequence[NodeView], kind: str, weight_bytes: int) -> NodeChoice | None:
    """Where a request for a model of `kind` with `weight_bytes` of weights goes; None if no
    node of that kind is up."""
    live = [n for n in nodes if n.kind == kind and n.up]
    if not live:
        return None
    serving = [n for n in live if n.instance is not None]
    open_ = [n for n in serving if not n.refusing]
    if open_:
        best = min(open_, key=lambda n: (-n.active, n.queued, n.node_id))
        return NodeChoice(best.node_id, False, f"the model's instance on {best.node_id} takes requests")
    fits = [n for n in live if n.instance is None and n.free_bytes >= weight_bytes]
    if fits:
        best = min(fits, key=lambda n: (not n.host_copy, -n.used_bytes, n.node_id))
        why = "no instance yet" if not serving else "every instance of the model refuses requests"
        held = "holds the weights" if best.host_copy else "fits the weights"
        return NodeChoice(best.node_id, True, f"{why}: a new instance on {best.node_id}, which {held}")
    if serving:
        best = min(serving, key=lambda n: (n.queued, -n.active, n.node_id))
        return NodeChoice(best.node_id, False, f"no node to scale out to: waiting on {best.node_id}")
    # No instance anywhere and no node has the memory free: the node with the most free
    # memory loads it (its placement recycles idle instances to make room).
    best = min(live, key=lambda n: (not n.host_copy, -n.free_bytes, n.node_id))
    return NodeChoice(best.node_id, True, f"no node has the memory free: {best.node_id} recycles to make room")
