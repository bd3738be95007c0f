"""The scheduler's plans as values (mesh.control.plans): made from the cluster's books and the
answers to their checks, with no node asked and nothing awaited."""
import asyncio
from dataclasses import dataclass, field

from cluster_doubles import config, request, spec
from mesh.control.cluster_node import ClusterNode
from mesh.control.fleet import Fleet
from mesh.control.plans import (
    Admit,
    ExistingHome,
    FitsGroup,
    FitsInstance,
    FitsNew,
    Move,
    NewHome,
    Placement,
    Preemption,
    ScaleOut,
)
from mesh.control.schedulers import make_scheduler


def answer_checks(planning, answer):
    """Run a planning step with every check it yields answered by `answer` (no node asked)."""
    try:
        check = next(planning)
        while True:
            check = planning.send(answer(check))
    except StopIteration as end:
        return end.value


@dataclass
class Hosted:
    instance_id: str
    model: str
    requests: dict = field(default_factory=dict)
    loaded: bool = True
    idle_since: float = 0.0


class BookNode(ClusterNode):
    """A node that is only books: its instances, their requests and their progress. Asked
    anything once `asked_nothing` is set, it fails the test."""

    margin = 0.0

    def __init__(self, spec) -> None:
        self._spec = spec
        self.hosted: dict[str, Hosted] = {}
        self.tokens: dict[str, int] = {}
        self.asked_nothing = False

    @property
    def spec(self):
        return self._spec

    @property
    def instances(self):
        return self.hosted

    def progress(self, request_id: str) -> int:
        return self.tokens[request_id]

    def used_bytes(self) -> int:
        return 0

    def can_fit(self, instance_bytes: int) -> bool:
        return True

    def _asked(self):
        raise AssertionError(f"planning asked node {self.node_id}")

    async def start_instance(self, plan) -> bool:
        assert not self.asked_nothing, f"planning started an instance on {self.node_id}"
        self.hosted[plan.instance_id] = Hosted(plan.instance_id, plan.model)
        return True

    async def validate(self, instance_id, req, *, exclude=()):
        self._asked()

    async def validate_group(self, instance_id, reqs, done):
        self._asked()

    async def validate_new(self, plan, reqs, done, *, deadlines=None):
        self._asked()

    async def try_admit(self, instance_id, req, *, compute=True, deadlines=None):
        self._asked()

    async def take_back(self, request_id, why):
        self._asked()

    async def stop_instance(self, instance_id):
        self._asked()

    def abort(self, request_id, why):
        self._asked()


def test_a_preemption_plan_names_its_moves_from_the_books_and_the_checks_answers():
    """X (model m, 3 requests) on cpu0 takes a new request by preempting its lower-batch
    neighbours there, lowest first: Y (model a, 1 request) and Z (model b, 2). Y's request
    validates on a's instance on cpu1; b has no other instance, so Z's go to a new one on
    gpu0 (cpu0 is X's, cpu1 now takes Y's). Preempting Y alone is not enough for the new
    request, both are. The plan names each move: the instance, its requests, their
    progress, their home; and no node was asked anything."""
    async def main():
        cluster = Fleet(config(cpu=2, gpu=1), {"llama-2-7b": spec()},
                              {m: "llama-2-7b" for m in ("m", "a", "b")},
                              nodes=[BookNode(s) for s in config(cpu=2, gpu=1).node_specs()])
        cpu0, cpu1, gpu0 = (cluster.node(n) for n in ("cpu0", "cpu1", "gpu0"))
        refs = {}
        for name, model, node, batch in (("x", "m", cpu0, 3), ("y", "a", cpu0, 1), ("z", "b", cpu0, 2),
                                         ("a1", "a", cpu1, 0)):
            refs[name] = await cluster.start_instance(cluster.plan(model, node), node)
            for k in range(batch):
                r = request(f"{name}-{k}", model)
                node.hosted[refs[name].instance_id].requests[r.request_id] = r
                node.tokens[r.request_id] = 10 * len(name) + k + 1
        for node in (cpu0, cpu1, gpu0):
            node.asked_nothing = True
        x, y, z, a1 = (refs[n] for n in ("x", "y", "z", "a1"))
        scheduler = make_scheduler("mesh", cluster, lambda req: None)
        req = request("new", "m")

        asked = []

        def answer(check) -> bool:
            asked.append(check)
            if isinstance(check, FitsInstance):
                assert check.node is cpu0 and check.instance_id == x.instance_id and check.request is req
                return set(check.exclude) == {y.instance_id, z.instance_id}
            if isinstance(check, FitsGroup):
                return check.instance_id == a1.instance_id and check.requests == tuple(y.requests.values())
            assert isinstance(check, FitsNew)
            return check.node is gpu0 and check.plan.model == "b"

        plan = answer_checks(scheduler.plan_preemption(req, [x]), answer)
        return plan, asked, refs, (cpu0, cpu1, gpu0)

    plan, asked, refs, (cpu0, cpu1, gpu0) = asyncio.run(main())
    x, y, z, a1 = (refs[n] for n in ("x", "y", "z", "a1"))
    assert isinstance(plan, Preemption) and plan.target is x and plan.request.request_id == "new"
    assert [m.instance for m in plan.moves] == [y, z]
    first, second = plan.moves
    assert first == Move(y, tuple(y.requests.values()), (11,), ExistingHome(cpu1, a1))
    assert [q.request_id for q in second.requests] == ["z-0", "z-1"] and second.done == (11, 12)
    assert isinstance(second.home, NewHome) and second.home.node is gpu0 and second.home.plan.model == "b"
    # the checks it asked, in order: room with both gone; Y's request on a1; X with Y gone
    # (no); Z's requests on a new instance of b (gpu0 only: cpu0 and cpu1 are used); X with both gone
    assert [type(c).__name__ for c in asked] == ["FitsInstance", "FitsGroup", "FitsInstance", "FitsNew",
                                                 "FitsInstance"]
    assert [c.node.node_id for c in asked] == ["cpu0", "cpu1", "cpu0", "gpu0", "cpu0"]
    assert str(plan).startswith(f"place new on {x.instance_id}, preempting {y.instance_id} (1 requests) to "
                                f"{a1.instance_id}; {z.instance_id} (2 requests) to new b@gpu0")
    # every plan reads as one log line
    new_b = second.home.plan.instance_id
    assert str(ScaleOut(second.home, second.requests)) == f"start new {new_b} for z-0, z-1"
    assert str(ScaleOut(second.home)) == f"warm up new {new_b}"
    assert str(Placement(plan.request, (Admit(a1),))) == f"place new on the first of: {a1.instance_id}"


def test_no_preemption_is_planned_when_preempting_every_lower_batch_neighbour_leaves_no_room():
    async def main():
        cluster = Fleet(config(cpu=1, gpu=0), {"llama-2-7b": spec()}, {"m": "llama-2-7b", "a": "llama-2-7b"},
                              nodes=[BookNode(s) for s in config(cpu=1, gpu=0).node_specs()])
        node = cluster.node("cpu0")
        x = await cluster.start_instance(cluster.plan("m", node), node)
        await cluster.start_instance(cluster.plan("a", node), node)
        node.hosted[x.instance_id].requests["x-0"] = request("x-0", "m")
        node.asked_nothing = True
        scheduler = make_scheduler("mesh", cluster, lambda req: None)
        asked = []
        plan = answer_checks(scheduler.plan_preemption(request("new", "m"), [x]),
                             lambda c: asked.append(c) or False)
        return plan, asked

    plan, asked = asyncio.run(main())
    assert plan is None and len(asked) == 1 and isinstance(asked[0], FitsInstance)
