"""A node as the cluster dispatcher sees it: the one interface between the decisions
(mesh.control.dispatcher, mesh.control.schedulers) and whatever runs the node.

The dispatcher and the policies never touch a node's runtime directly. They ask a
`ClusterNode` to validate a candidate (shadow validation on both subsystems, LLM-Mesh 5.3
and 6.4), to admit a request, to start or stop an instance, and to give a running request
back (preemption 7.1, eviction 6.4), and they read its instances and memory budget. Two
implementations, so the replay evaluates exactly what serves tenants:

- `LocalNode` (mesh.replay.local_node): a NodeRuntime in this process. The replays run it with simulated
  engines on the virtual-time loop; its calls complete without suspending, so a replay's
  decisions are atomic.
- `AgentNode` (mesh.control.agent_node): a node agent process, local or on another
  machine, over its control connection. Validation and admission run in the agent against
  its live state, so each verb is one message; admission is validate + admit in one step
  of the agent's loop, hence atomic there too.

The verbs that reach the node are coroutines; what the dispatcher reads of a node's state
(instances, their requests, the memory budget) is plain attributes, kept current by the
implementation. What happens on the node unasked (a request evicted, a load finished, an
instance gone) it reports to its `NodeListener`, given when it is made (the cluster view).
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Collection, Mapping, Protocol, Sequence

from mesh.policy.admission import Admission, InstancePlan
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import Deadlines
from mesh.wire.served_request import Outcome, ServedRequest

# Why a node lost its requests (ServedRequest.lost; the dispatcher counts resumed and failed ones by it).
EXITED = "exited"  # its agent process exited (killed, crashed)
CONNECTION = "connection"  # its connection ended or failed, the agent's process not known to have exited
HEARTBEAT = "heartbeat"  # its agent stopped answering pings (frozen, or its network went quiet)
REMOVED = "removed"  # the node left the cluster (a Ray node removed or dead)
ENGINE_HUNG = "engine_hung"  # the node's watchdog failed a hung engine (an eviction marked fault)
LOSS_CAUSES = (EXITED, CONNECTION, HEARTBEAT, REMOVED, ENGINE_HUNG)


class HostedInstance(Protocol):
    """What the dispatcher reads of one instance (NodeInstance satisfies it)."""

    instance_id: str
    model: str
    requests: dict[str, ServedRequest]  # requests it holds (waiting for prefill or decoding)
    loaded: bool
    idle_since: float


class NodeListener(Protocol):
    """What a node reports unasked to whoever schedules on it (mesh.control.fleet.s
    Fleet); each call names the node."""

    def request_evicted(self, node: ClusterNode, req: ServedRequest) -> None:
        """A request left the node with its progress, not ended (evicted, 6.4; the node
        lost): to place again."""

    def instance_loaded(self, node: ClusterNode, instance_id: str) -> None:
        """An instance finished loading: it serves from now on."""

    def instance_gone(self, node: ClusterNode, instance_id: str) -> None:
        """An instance left without being asked (its load failed, the node was lost)."""


class ClusterNode(ABC):
    margin: float  # shadow validation's overestimate of each iteration (5.3)
    listener: NodeListener | None = None  # whom it reports to; None: an evicted request fails

    @property
    @abstractmethod
    def spec(self) -> NodeSpec:
        """The node: its id, kind and memory (a remote agent's may change at each hello)."""

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    @property
    def kind(self) -> str:
        return self.spec.kind

    # -- state the dispatcher reads ------------------------------------------------------
    @property
    @abstractmethod
    def instances(self) -> Mapping[str, HostedInstance]: ...

    @property
    def stepping(self) -> str | None:
        """The instance whose iteration is in flight, when known (it is not preempted)."""
        return None

    @property
    def up(self) -> bool:
        return True

    @abstractmethod
    def progress(self, request_id: str) -> int:
        """Tokens the request has produced so far (here and before it came here)."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Memory budget in use (the reservation station's optimistic budget, 6.3)."""

    @abstractmethod
    def can_fit(self, instance_bytes: int) -> bool:
        """Could a new instance of `instance_bytes` (weights and initial KV cache) start now?"""

    def failure(self) -> BaseException | None:
        """What stopped the node's token-level loop, if anything did (a bug)."""
        return None

    def staging(self, instance_id: str) -> bool:
        """Is the instance's start staged: its weights still on their way to this node and its
        load not issued yet (the service's nodes, mesh.control.agent_node)? Never in a replay."""
        return False

    def loaded_from(self, instance_id: str) -> str | None:
        """Where a loaded instance's engine read its model from (OpenVINO: "gguf", "prepared",
        "ir"; mesh.perf.load_times.ColdStartTable keys measured loads by it); None if it does not say."""
        return None

    def parked(self, model: str) -> bool:
        """Does the node keep a stopped instance of `model` built and warm (mesh.engines.parking),
        so that its next load adopts it? Nodes that park nothing say False."""
        return False

    def hand_back_lost(self, reqs: Sequence[ServedRequest], why: str, cause: str) -> int:
        """Requests this node held when it was lost (`cause`, one of LOSS_CAUSES; `why` for the
        operator), with their progress, not ended: each goes back to the dispatcher (`listener`,
        the path of an evicted or preempted request: placed again, its stream goes on from the
        next token, its deadlines restarting from now: `fault`); without one, each fails.
        Returns how many."""
        now = asyncio.get_running_loop().time()
        for req in reqs:
            req.fault, req.lost = True, cause
            req.attempts.append(f"lost on {self.node_id} after {req.tokens_out} tokens: {why}")
            req.node_id = req.instance_id = None
            if self.listener is not None:
                self.listener.request_evicted(self, req)
            else:
                req.end(Outcome.FAILED, now, why)
        return len(reqs)

    # -- verbs -------------------------------------------------------------------------
    @abstractmethod
    async def validate(self, instance_id: str, req: ServedRequest, *, exclude: Collection[str] = ()) -> Admission:
        """Would `req` (with its progress) meet its SLO on the instance, with the instances
        in `exclude` preempted first (7.1)? Changes nothing."""

    @abstractmethod
    async def validate_group(self, instance_id: str, reqs: Sequence[ServedRequest], done: Sequence[int]) -> Admission:
        """Would all of `reqs`, having produced `done` tokens each, fit the instance?"""

    @abstractmethod
    async def validate_new(self, plan: InstancePlan, reqs: Sequence[ServedRequest], done: Sequence[int], *,
                           deadlines: Sequence[Deadlines] | None = None) -> Admission:
        """Would a new instance started now, its cold start counted, serve all of `reqs`
        (with `deadlines` in place of their own, if given)?"""

    @abstractmethod
    async def try_admit(self, instance_id: str, req: ServedRequest, *, compute: bool = True,
                        deadlines: Deadlines | None = None) -> Admission:
        """Validate and admit in one step (compute=False: memory only, the baselines);
        `deadlines`: validated with these in place of its own, which it keeps if admitted."""

    @abstractmethod
    async def take_back(self, request_id: str, why: str) -> ServedRequest | None:
        """Take a running request off the node with its progress kept, not ended: the
        caller places it elsewhere, where it is prefilled again with its prompt and the
        tokens it produced (7.1). None if the node no longer holds it."""

    @abstractmethod
    async def start_instance(self, plan: InstancePlan) -> bool:
        """Issue the planned instance's load; False if the node's memory refuses it."""

    @abstractmethod
    async def stop_instance(self, instance_id: str) -> None:
        """Unload an instance that holds no requests."""

    @abstractmethod
    def abort(self, request_id: str, why: str) -> None:
        """End a request held here as failed (the replay's time limit, shutdown)."""

    async def start(self) -> None:
        """Start serving (the node's loop, its connection)."""

    async def stop(self) -> None: ...
