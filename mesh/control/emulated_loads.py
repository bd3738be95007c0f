"""How long an emulated node's load takes, and how it serves before its last layer.

An emulated load (mesh.engines.emulated) takes what the replay's engine's takes: ColdStart's
load from host memory (Fleet.simulated_load_s), or, with `weights` (ClusterSettings.
emulated_weights: `mesh serve --emulate-weights`), the replay's weights model's decision
(mesh.control.load_timing: multicast, live scaling), so the service and its twin decide each
cold start by one implementation. A live load (the target of ZigZag, BlitzScale 5.2) also
gets its usable layers over the load and its partner's layer port (mesh.node.lending).
"""
from __future__ import annotations

from typing import Any

from mesh.control.agent_node import AgentNode
from mesh.control.fleet import Fleet
from mesh.control.load_timing import EmulatedLoad, LoadTiming, WeightsConfig
from mesh.policy.admission import InstancePlan


class EmulatedLoads:
    def __init__(self, cluster: Fleet, weights: WeightsConfig | None = None) -> None:
        self.cluster = cluster
        self.weights = weights
        self.timing: LoadTiming | None = None  # made at the first load, once the nodes are in

    def load(self, plan: InstancePlan, node: AgentNode) -> EmulatedLoad:
        """The planned instance's load on `node`, issued now."""
        if self.weights is None:
            return EmulatedLoad(self.cluster.simulated_load_s(plan, node.kind))
        if self.timing is None:
            self.timing = LoadTiming(self.weights, self.cluster)
        return self.timing.emulated_load(plan, node.node_id, plan.load_wait_s)

    def spec_fields(self, plan: InstancePlan, node: AgentNode) -> dict[str, Any]:
        """The load as InstanceSpec carries it (emulated_load_s, emulated_layers, emulated_partner)."""
        load = self.load(plan, node)
        return {"emulated_load_s": load.load_s, "emulated_layers": load.layer_steps,
                "emulated_partner": self.partner(load)}

    def partner(self, load: EmulatedLoad) -> dict[str, Any] | None:
        """A live load's ZigZag partner as its agent reaches it: the layer port of the
        partner's node and its token. None: no partner, or its agent has no port (the live
        instance then serves alone)."""
        if load.partner is None or load.layer_steps is None:
            return None
        partner = self.cluster.instance(load.partner)
        peer = partner.node.layers_peer if partner is not None else None  # type: ignore[attr-defined]
        if peer is None:
            return None
        return {"address": peer[0], "token": peer[1], "instance_id": load.partner,
                "link_bytes_per_s": load.link_bytes_per_s}
