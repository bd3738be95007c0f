"""One engine instance on a node as the node runtime holds it (mesh.node.runtime): its
engine, SLO, memory state, and the requests it serves."""
from __future__ import annotations

from dataclasses import dataclass, field

from mesh.engines.engine_api import Engine, EngineRequest
from mesh.policy.memory import InstanceMemory
from mesh.policy.slo import SLO
from mesh.wire.served_request import ServedRequest


@dataclass(eq=False)
class NodeInstance:
    instance_id: str
    model: str
    engine: Engine
    slo: SLO
    memory: InstanceMemory
    requests: dict[str, ServedRequest] = field(default_factory=dict)
    loaded: bool = False
    idle_since: float = 0.0  # when it last became empty (keep-alive, LLM-Mesh 4)
    # Requests admitted while the instance loads (validated with its cold start, LLM-Mesh 4):
    # a real engine takes requests only once loaded, so they reach it when the load ends.
    deferred: dict[str, EngineRequest] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.requests)
