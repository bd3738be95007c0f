"""A node's live-scaling counts: what shadow validation must keep at zero, and how often it
was put to the test (docs/multicast.md, "Live scaling in `mesh serve`")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mesh.policy.live_scaling import late_for_layers
from mesh.wire.served_request import ServedRequest


@dataclass
class LiveCounts:
    """Requests completed after an iteration of a live instance that waited for layers (the
    engine's `waited_for_layers`, mesh.engines.emulated), and those of them served late for
    it (mesh.policy.live_scaling.late_for_layers, the twin's rule); iterations of this node's
    live instances that their partners finished (`pulls`), and of other nodes' live
    instances that this node finished (`lent`; mesh.node.lending). Kept for the agent's life."""

    waited_for_layers: int = 0
    late_for_layers: int = 0
    pulls: int = 0
    lent: int = 0

    def completed(self, engine: Any, req: ServedRequest) -> None:
        """`req` completed on `engine`'s instance: counted if one of its iterations waited."""
        waited: set[str] | None = getattr(engine, "waited_for_layers", None)
        if waited is None or req.request_id not in waited:
            return
        waited.discard(req.request_id)
        self.waited_for_layers += 1
        self.late_for_layers += late_for_layers(True, True, req.slo_met, req.late_s != 0)
