"""The service's node membership: one `AgentNode` per node agent (mesh.control.agent_node),
in the fleet the dispatcher decides on.

`NodePool` makes each node's agent handle (a supervised local process, or a remote agent:
mesh.control.supervisor, mesh.control.remote_agents), adds and removes nodes while serving
(`add_node`, `remove_node`: the Ray cluster's membership, mesh.ray.membership), tells the
weights plane which instances and agents come and go (mesh.control.weights_plane), and draws
the nodes for /admin/cluster (`view`). A removed node's requests are placed again with their
progress (`AgentNode.lose`) and its copies leave the parameter pool.

What a node asks about the models it loads (how an instance loads, its calibration profile,
whether its weights are here) the model catalogue answers (`NodeModels`; the service's is
mesh.service.model_catalogue). What a node reports (mesh.control.agent_node's
AgentNodeListener) the pool hears: it passes the cluster's part on to the cluster view and
tells the weights plane, the catalogue and the dispatcher theirs.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

from mesh.control.agent_node import AgentNode
from mesh.control.cluster_node import REMOVED, ClusterNode
from mesh.control.dispatcher import Dispatcher
from mesh.control.fleet import Fleet
from mesh.control.supervisor import AgentHandle, AgentSettings
from mesh.control.weights_plane import WeightsPlane
from mesh.policy.admission import InstancePlan
from mesh.policy.node_spec import NodeSpec
from mesh.wire.agent_protocol import InstanceSpec
from mesh.wire.served_request import ServedRequest

log = logging.getLogger(__name__)


class ModelLabel(Protocol):
    """What the nodes' view shows of a model (a registry's ModelRecord)."""

    tenant: str
    name: str
    context_length: int


class NodeModels(Protocol):
    """What the pool's nodes ask of the model catalogue."""

    async def load_spec(self, plan: InstancePlan, node: AgentNode) -> InstanceSpec:
        """How `node`'s agent loads the planned instance (its weights placed there first)."""

    def profile_for(self, model_uid: str, kind: str) -> str | None:
        """The model's calibration profile for `kind` nodes, if any."""

    def holds_copy(self, model_uid: str, node: Any) -> bool:
        """Does `node` hold the model's weights (no transfer before a load)?"""

    def label(self, model_uid: str) -> ModelLabel | None: ...

    def origin(self, instance_id: str) -> str:
        """Where the instance's weights came from ("registry path", "multicast", ...)."""

    def instance_stopped(self, instance_id: str) -> None: ...


class NodePool:
    def __init__(self, cluster: Fleet, dispatcher: Dispatcher, settings: AgentSettings,
                 agent_factory: Callable[..., AgentHandle], models: NodeModels, start_timeout_s: float) -> None:
        """`agent_factory(spec, on_up, on_down, on_event, settings)` makes each node's agent
        handle (tests pass one that runs the agent in-process)."""
        self.cluster = cluster
        self.dispatcher = dispatcher
        self.settings = settings
        self._agent_factory = agent_factory
        self.models = models
        self.start_timeout_s = start_timeout_s
        self.agents: dict[str, AgentHandle] = {}  # node id -> its agent (the weights plane reads it)
        self.weights: WeightsPlane | None = None  # once made (it reads `agents`)
        self._started = False

    def nodes(self) -> list[AgentNode]:
        return [n for n in self.cluster.nodes if isinstance(n, AgentNode)]  # all of the service's are

    def healthy(self) -> bool:
        return all(a.up for a in self.agents.values())

    async def start(self) -> None:
        """Wait for the local agents (a remote one is served once reachable)."""
        self._started = True
        for node in self.nodes():
            if node.agent.remote:
                continue
            if not await node.agent.wait_up(self.start_timeout_s):
                raise RuntimeError(f"node agent {node.node_id} did not start: {node.agent.last_error or 'timeout'}")

    # ---- nodes that join or leave while serving ---------------------------------------------
    def add(self, spec: NodeSpec, factory: Callable[..., AgentHandle] | None = None) -> AgentNode:
        node = AgentNode(spec, factory or self._agent_factory, self.settings, self.models.load_spec, self,
                         self.models.profile_for, margin=self.cluster.config.margin,
                         transfer_first=self._transfer_first)
        self.cluster.add_node(node)
        self.agents[spec.node_id] = node.agent
        return node

    async def add_node(self, spec: NodeSpec, agent_factory: Callable[..., AgentHandle] | None = None) -> AgentNode:
        """A node joined: start its agent handle (made by `agent_factory`, default the
        pool's). It gets models by multicast on first use."""
        if spec.node_id in self.agents:
            raise ValueError(f"node {spec.node_id} is already placed on")
        node = self.add(spec, agent_factory)
        if self._started:
            await node.start()
        log.warning("node %s joined (%s)", spec.node_id, spec.kind)
        return node

    async def remove_node(self, node_id: str, reason: str) -> None:
        """A node left (its machine died or was removed): its requests are placed again with
        their progress (`AgentNode.lose`), its instances are gone and its copies leave the
        parameter pool; /admin/cluster no longer lists it."""
        if node_id not in self.cluster.node_seq:
            return
        node = self.cluster.node(node_id)
        if not isinstance(node, AgentNode):
            raise TypeError(f"node {node_id} is not a node agent's")
        node.lose(f"node {node_id} left the cluster ({reason})", REMOVED)
        self.cluster.remove_node(node_id)
        del self.agents[node_id]
        if self.weights is not None:
            self.weights.node_removed(node_id)
        await node.stop()
        log.warning("node %s left: %s", node_id, reason)

    def _transfer_first(self, plan: InstancePlan, node: AgentNode) -> bool:
        """A start that must first move the weights to the node is staged: no decision waits
        for a transfer."""
        return not self.models.holds_copy(plan.model, node)

    # ---- what the nodes report (AgentNodeListener) ----------------------------------------------
    def request_evicted(self, node: ClusterNode, req: ServedRequest) -> None:
        self.cluster.request_evicted(node, req)

    def instance_loaded(self, node: ClusterNode, instance_id: str) -> None:
        self.cluster.instance_loaded(node, instance_id)
        inst = node.instances.get(instance_id)
        if self.weights is not None and inst is not None:
            self.weights.instance_started(inst.model, node.node_id, instance_id)
        self.dispatcher.capacity_freed()

    def instance_gone(self, node: ClusterNode, instance_id: str) -> None:
        self.cluster.instance_gone(node, instance_id)

    def instance_stopped(self, node: ClusterNode, model: str, instance_id: str) -> None:
        self.models.instance_stopped(instance_id)
        if self.weights is not None:
            self.weights.instance_stopped(model, instance_id)

    def agent_up(self, node: AgentNode) -> None:
        self.dispatcher.capacity_freed()

    def agent_down(self, node: AgentNode) -> None:
        if self.weights is not None and self.agents.get(node.node_id) is node.agent:
            self.weights.node_down(node.node_id)

    def weights_moved(self, node: AgentNode, nbytes: int, seconds: float) -> None:
        self.cluster.cold_starts.record_transfer(nbytes, seconds)

    # ---- the view ----------------------------------------------------------------------------
    def view(self) -> list[dict[str, Any]]:
        """Each node: its agent, memory, load and instances (for /admin/cluster, /metrics)."""
        return [self._node_view(node) for node in self.nodes()]

    def _node_view(self, node: AgentNode) -> dict[str, Any]:
        stats = node.stats
        by_id = {i["instance_id"]: i for i in stats.get("instances", [])}
        instances = []
        for iid, inst in node.instances.items():
            record = self.models.label(inst.model)
            s = by_id.get(iid, {})
            instances.append({
                "instance_id": iid, "tenant": record.tenant if record else None,
                "model": record.name if record else inst.model,
                "state": "ready" if inst.loaded else "loading", "active": len(inst.requests),
                "batch_size": s.get("batch_size", 0), "pending": s.get("pending", 0),
                "kv_bytes_budget": s.get("kv_bytes_budget", 0), "kv_bytes_in_use": s.get("kv_bytes_in_use", 0),
                "kv_bytes_allocated": s.get("kv_bytes_allocated", 0), "weight_bytes": s.get("weight_bytes", 0),
                "context_window": record.context_length if record else None,
                "time_factors": s.get("time_factors"), "weights": self.models.origin(iid),
            })
        agent = node.agent
        return {
            "node_id": node.node_id, "kind": node.kind, "state": agent.state, "pid": agent.pid,
            "location": agent.location, "restarts": agent.restarts, "last_error": agent.last_error,
            "memory": stats.get("memory", {"capacity_bytes": node.spec.memory_bytes}),
            "busy_fraction": node.busy_fraction, "queue_length": int(stats.get("queue_length", 0)),
            "running": stats.get("running", 0), "kv_bytes_in_use": stats.get("kv_bytes_in_use", 0),
            "iterations": stats.get("iterations", 0), "deadlines": stats.get("deadlines"),
            "emulate": stats.get("emulate"),  # the device an emulated node emulates (mesh serve --emulate)
            "models": stats.get("models", []),  # the models its agent holds state for (a deleted one: none)
            "parked": stats.get("parked"),  # its parking lot: budget, bytes held, models (mesh.engines.parking)
            "calls": {t: c.view() for t, c in sorted(agent.client.call_times.items())} if agent.client else {},
            "frames_in": agent.client.frames_in if agent.client else 0,  # from the agent, this connection
            "instances": instances,
        }
