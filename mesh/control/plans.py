"""A scheduler's decisions as values (mesh.control.schedulers): what it will do for a request,
decided before anything changes, then carried out against the nodes by one commit step.

A plan is made by a planning generator. It reads the cluster's books and yields each `Check`
it needs, a shadow validation on one node that changes nothing (LLM-Mesh 5.3, 6.4); it is
sent back whether the check passed, and returns its plan (or None). So planning awaits
nothing: the scheduler asks the nodes (`MeshScheduler._answer`), a test can answer from a table.

- `Placement`: admit a request on the first of some instances that admits it. A node
  validates and admits in one step, so the plan is the order to try them in.
- `Preemption`: admit a request on an instance once neighbours on its node are preempted
  (7.1); each `Move` names a neighbour, its requests with their progress, and their new home.
- `ScaleOut`: start a new instance for some requests, or for none (a warm-up).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, TypeVar

from mesh.control.cluster_node import ClusterNode
from mesh.control.fleet import InstanceRef
from mesh.policy.admission import Admission, InstancePlan
from mesh.policy.slo import Deadlines
from mesh.wire.served_request import ServedRequest

T = TypeVar("T")


@dataclass(frozen=True)
class FitsInstance:
    """Would `request` meet its SLO on an instance, with the instances in `exclude` preempted first?"""

    node: ClusterNode
    instance_id: str
    request: ServedRequest
    exclude: tuple[str, ...] = ()

    async def ask(self) -> Admission:
        return await self.node.validate(self.instance_id, self.request, exclude=self.exclude)


@dataclass(frozen=True)
class FitsGroup:
    """Would all of `requests`, having produced `done` tokens each, fit an instance?"""

    node: ClusterNode
    instance_id: str
    requests: tuple[ServedRequest, ...]
    done: tuple[int, ...]

    async def ask(self) -> Admission:
        return await self.node.validate_group(self.instance_id, self.requests, self.done)


@dataclass(frozen=True)
class FitsNew:
    """Would the new instance `plan` serve all of `requests` (with `deadlines` in place of
    their own, if given)?"""

    node: ClusterNode
    plan: InstancePlan
    requests: tuple[ServedRequest, ...]
    done: tuple[int, ...]
    deadlines: tuple[Deadlines, ...] | None = None

    async def ask(self) -> Admission:
        return await self.node.validate_new(self.plan, self.requests, self.done, deadlines=self.deadlines)


Check = FitsInstance | FitsGroup | FitsNew
Planning = Generator[Check, bool, T]  # yields checks, is sent whether each passed, returns a plan


@dataclass(frozen=True)
class ExistingHome:
    """Where requests go: the running instance `ref` on `node`."""

    node: ClusterNode
    ref: InstanceRef

    def __str__(self) -> str:
        return self.ref.instance_id


@dataclass(frozen=True)
class NewHome:
    """Where requests go: the new instance `plan`, to start on `node`."""

    node: ClusterNode
    plan: InstancePlan

    def __str__(self) -> str:
        return f"new {self.plan.instance_id}"


Home = ExistingHome | NewHome


@dataclass(frozen=True)
class Admit:
    """One instance to try, with the deadlines the request is validated under there (None: its own)."""

    instance: InstanceRef
    deadlines: Deadlines | None = None


@dataclass(frozen=True)
class Placement:
    """Admit `request` on the first of `tries` whose node admits it; `late`: served late,
    each try moving its deadlines (dispatch_rules.SERVE_LATE)."""

    request: ServedRequest
    tries: tuple[Admit, ...]
    late: bool = False

    def __str__(self) -> str:
        tries = ", ".join(t.instance.instance_id + ("" if t.deadlines is None else f" (+{t.deadlines.late_s:.2f} s)")
                          for t in self.tries)
        return f"place {self.request.request_id}{' late' if self.late else ''} on the first of: {tries}"


@dataclass(frozen=True)
class Move:
    """A preempted instance's requests, with the tokens each had produced, to their new home."""

    instance: InstanceRef
    requests: tuple[ServedRequest, ...]
    done: tuple[int, ...]
    home: Home


@dataclass(frozen=True)
class Preemption:
    """Admit `request` on `target` after preempting the instances of `moves` on its node (7.1)."""

    request: ServedRequest
    target: InstanceRef
    moves: tuple[Move, ...]

    def __str__(self) -> str:
        moves = "; ".join(f"{m.instance.instance_id} ({len(m.requests)} requests) to {m.home}" for m in self.moves)
        return f"place {self.request.request_id} on {self.target.instance_id}, preempting {moves}"


@dataclass(frozen=True)
class ScaleOut:
    """Start the new instance `home.plan` on `home.node` and admit `requests` there; with
    none, a warm-up for the requests to come (dispatch_rules.warm_up_allowed)."""

    home: NewHome
    requests: tuple[ServedRequest, ...] = ()

    def __str__(self) -> str:
        if not self.requests:
            return f"warm up {self.home}"
        return f"start {self.home} for {', '.join(r.request_id for r in self.requests)}"


Plan = Placement | Preemption | ScaleOut
