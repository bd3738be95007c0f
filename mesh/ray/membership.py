"""Cluster membership on Ray: the node agents of `mesh serve --ray`, one per Ray node.

`RayMembership` watches `ray.nodes()` from the service's event loop (each Ray call runs in a
thread of the loop's executor, so the loop never blocks on Ray) and keeps the cluster control's
nodes equal to the live Ray nodes:

- a Ray node that is alive and offers a CPU gets a CPU node agent, and one GPU node agent
  per GPU it offers: a `NodeAgentActor` (mesh.ray.actor) pinned to the node
  (NodeAffinitySchedulingStrategy, soft=False) with `max_restarts=-1`, whose hardware probe
  on the node gives the node's kind and memory; the cluster control connects to the agent over
  Mesh's framed TCP (mesh.control.remote_agents.RemoteAgent, with the actor as its address source:
  after Ray restarts the actor, the agent has a new port and the actor says which);
- a Ray node that died or was removed leaves the cluster (`ClusterControl.remove_node`):
  its requests are placed again with their progress (their streams go on from the next
  token on another node), its queued requests go to other nodes, its copies
  leave the parameter pool, and /admin/cluster no longer lists it.

Ray does membership, where agent processes run, their restarts and health; weights go by
Mesh's multicast between the agents' weights receivers, tokens by the agents' connections.

Autoscaling (`--ray-autoscale`, mesh.ray.node_autoscaler) asks Ray's autoscaler for the nodes
the cluster control uses and releases idle ones.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

from mesh.control.remote_agents import RemoteAgent
from mesh.control.supervisor import AgentHandle
from mesh.policy.node_spec import NodeSpec
from mesh.ray.actor import AgentLaunch, NodeAgentActor, agent_token, launch_dict
from mesh.tasks import cancel_all

log = logging.getLogger(__name__)

NAMESPACE = "mesh"


def connect(address: str) -> None:
    """Join the Ray cluster at `address` ("auto": the one `ray start` made on this machine)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)


def mesh_node_ids(ray_node_id: str, resources: dict[str, float]) -> list[tuple[str, str]]:
    """The node agents a Ray node gets, as (mesh node id, kind): a CPU agent when it offers a
    CPU, a GPU agent per GPU. A node offering neither (e.g. `ray start --head --num-cpus 0`)
    gets none."""
    short = ray_node_id[:8]
    out = [(f"ray-{short}", "cpu")] if resources.get("CPU", 0) >= 1 else []
    out += [(f"ray-{short}-gpu{i}", "gpu") for i in range(int(resources.get("GPU", 0)))]
    return out


@dataclass
class _RayNode:
    ray_node_id: str
    agents: dict[str, Any]  # mesh node id -> its actor handle
    released: bool = False  # the autoscaler let it go: no agents until it is wanted again


class RayMembership:
    def __init__(self, control: Any, launch: AgentLaunch, secret: bytes, poll_s: float = 1.0,
                 on_change: Callable[[], None] | None = None) -> None:
        """`control`: a ClusterControl (add_node, remove_node); `launch`: the agents'
        settings; `secret`: the cluster secret (mesh.ray.actor.cluster_secret), from which the
        agents' tokens are derived here and on their nodes."""
        self.control = control
        self.launch = launch
        self.secret = secret
        self.poll_s = poll_s
        self.on_change = on_change
        self.nodes: dict[str, _RayNode] = {}  # Ray node id -> its agents
        self.alive: dict[str, dict[str, Any]] = {}  # Ray node id -> ray.nodes() entry, at the last scan
        self._joining: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self._actor_class: Any = None

    async def start(self) -> None:
        import ray

        self._actor_class = ray.remote(NodeAgentActor)
        await self.scan()
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="ray membership")

    async def wait_joined(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) until the nodes found so far have their agents up."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        if self._joining:
            await asyncio.wait(list(self._joining.values()), timeout=timeout_s)
        for node in list(self.nodes.values()):
            for mesh_id in node.agents:
                agent = self.control.agents.get(mesh_id)
                if agent is not None:
                    await agent.wait_up(max(0.0, end - loop.time()))

    async def stop_watching(self) -> None:
        await cancel_all([self._task, *self._joining.values()])

    async def stop(self) -> None:
        """Stop watching and end every agent this service started (their actors too)."""
        await self.stop_watching()
        for node in list(self.nodes.values()):
            await self._drop_actors(node)
        self.nodes.clear()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.scan()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the watcher must survive a Ray hiccup
                log.exception("scanning the Ray cluster failed")

    async def scan(self) -> None:
        """One look at the cluster: start agents on new nodes, remove the nodes that left."""
        import ray

        loop = asyncio.get_running_loop()
        entries = await loop.run_in_executor(None, ray.nodes)
        self.alive = {e["NodeID"]: e for e in entries if e.get("Alive")}
        changed = False
        for ray_id in [r for r in self.nodes if r not in self.alive]:
            node = self.nodes.pop(ray_id)
            task = self._joining.pop(ray_id, None)
            await cancel_all([task] if task is not None else [])
            for mesh_id in node.agents:
                await self.control.remove_node(mesh_id, f"Ray node {ray_id[:12]} is gone")
            await self._drop_actors(node, kill_only=True)
            changed = True
        for ray_id, entry in self.alive.items():
            if ray_id in self.nodes or ray_id in self._joining:
                continue
            if not mesh_node_ids(ray_id, entry.get("Resources", {})):
                continue
            task = loop.create_task(self._join(ray_id, entry), name=f"join {ray_id[:12]}")
            self._joining[ray_id] = task
            task.add_done_callback(lambda _t, r=ray_id: self._joining.pop(r, None))
        if changed and self.on_change is not None:
            self.on_change()

    async def _join(self, ray_id: str, entry: dict[str, Any]) -> None:
        """Start the node's agents (pinned actors), probe them, and add them to the cluster control."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = _RayNode(ray_id, {})
        pinned = NodeAffinitySchedulingStrategy(node_id=ray_id, soft=False)
        launch = launch_dict(self.launch)
        try:
            for mesh_id, kind in mesh_node_ids(ray_id, entry.get("Resources", {})):
                resources = {"num_cpus": 1} if kind == "cpu" else {"num_cpus": 0, "num_gpus": 1}
                actor = self._actor_class.options(
                    scheduling_strategy=pinned, max_restarts=-1, max_concurrency=4, **resources,
                ).remote(mesh_id, kind, launch)
                node.agents[mesh_id] = actor
            infos = {m: await a.probe.remote() for m, a in node.agents.items()}
        except Exception as exc:  # noqa: BLE001 - an actor that cannot start: try at the next scan
            log.error("cannot start node agents on Ray node %s: %s", ray_id[:12], exc)
            await self._drop_actors(node, kill_only=True)
            return
        if ray_id not in self.alive:  # it left while its agents started
            await self._drop_actors(node, kill_only=True)
            return
        self.nodes[ray_id] = node
        for mesh_id, info in infos.items():
            actor = node.agents[mesh_id]

            async def address(actor: Any = actor) -> str:
                return await actor.address.remote()

            def factory(spec: NodeSpec, *callbacks: Any, source: Any = address, info: dict = info) -> AgentHandle:
                return RemoteAgent(spec, source, agent_token(self.secret, spec.node_id), *callbacks,
                                   where=f"ray node {ray_id[:12]} at {info['host']}")

            spec = NodeSpec(mesh_id, str(info["kind"]), int(info["memory_bytes"]))
            await self.control.add_node(spec, factory)
            log.warning("Ray node %s: agent %s (%s, %.1f GiB, AMX %s)", ray_id[:12], mesh_id, info["kind"],
                        info["memory_bytes"] / 2**30, info["amx"])
        if self.on_change is not None:
            self.on_change()

    async def release(self, ray_id: str, reason: str) -> None:
        """Take Mesh off a node (the autoscaler may then remove it): its agents leave."""
        node = self.nodes.get(ray_id)
        if node is None or node.released:
            return
        for mesh_id in node.agents:
            await self.control.remove_node(mesh_id, reason)
        await self._drop_actors(node)
        node.agents = {}
        node.released = True

    async def rejoin(self, ray_id: str) -> None:
        """A released node is wanted again: start its agents at the next scan."""
        node = self.nodes.get(ray_id)
        if node is not None and node.released:
            del self.nodes[ray_id]
            await self.scan()

    async def _drop_actors(self, node: _RayNode, kill_only: bool = False) -> None:
        import ray

        loop = asyncio.get_running_loop()
        for actor in node.agents.values():
            if not kill_only:
                try:
                    await asyncio.wait_for(actor.stop.remote(), 10.0)
                except Exception:  # noqa: BLE001 - it is killed next either way
                    pass
            await loop.run_in_executor(None, lambda a=actor: ray.kill(a, no_restart=True))
