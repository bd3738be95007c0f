"""The global parameter pool (BlitzScale 5.3): O(1) host caching, placement, sources, drops."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mesh.policy.param_pool import LastHostCopy, Location, ParameterPool, PoolError, Where

GB = 10**9


def pool(**nodes: int) -> ParameterPool:
    p = ParameterPool()
    for n, cap in nodes.items():
        p.add_node(n, cap * GB)
    return p


def test_registration_places_the_first_copy_on_the_node_with_most_free_host_memory():
    p = pool(a=64, b=128, c=128)
    assert p.register("llama-7b", 14 * GB) == "b"  # b and c tie: the name decides
    assert p.register("llama-13b", 26 * GB) == "c"
    assert p.register("llama-3b", 7 * GB) == "b"  # b: 114 free, c: 102, a: 64
    assert p.host_copies("llama-7b") == ["b"]
    assert p.free_host_bytes("b") == (128 - 14 - 7) * GB
    p.check()


def test_registration_refuses_a_model_that_fits_nowhere():
    p = pool(a=8, b=16)
    with pytest.raises(PoolError, match=r"fits in no node's host memory \(most free: 16000000000 B"):
        p.register("big", 20 * GB)
    assert p.models() == []


def test_the_last_host_copy_cannot_be_dropped():
    p = pool(a=64, b=64)
    p.register("m", 10 * GB)
    with pytest.raises(LastHostCopy, match="last host copy of model 'm'"):
        p.drop_host_copy("m", "a")
    p.add_host_copy("m", "b")
    assert p.evictable("a") == ["m"] and p.evictable("b") == ["m"]
    p.drop_host_copy("m", "a")
    assert p.host_copies("m") == ["b"] and p.free_host_bytes("a") == 64 * GB
    assert p.evictable("b") == []
    p.check()


def test_relocate_names_where_the_last_copy_moves():
    p = pool(a=64, b=32, c=48)
    p.register("m", 10 * GB)  # on a
    dest = p.relocate("m", "a")
    assert dest == "c"
    p.add_host_copy("m", dest)  # after the multicast a -> c
    p.drop_host_copy("m", "a")
    assert p.host_copies("m") == ["c"]
    q = pool(a=64, b=8)
    q.register("m", 10 * GB)
    with pytest.raises(PoolError, match="no other node"):
        q.relocate("m", "a")


def test_sources_are_host_copies_then_instances_one_per_node():
    p = pool(a=64, b=64, c=64, d=64)
    p.register("m", 10 * GB)  # a
    p.add_instance("m", "c", "i1")
    p.add_instance("m", "a", "i2")  # a already a source through its host copy
    p.add_instance("m", "b", "i3")
    assert p.sources("m") == [Location("m", "a", Where.HOST), Location("m", "b", Where.INSTANCE, "i3"),
                              Location("m", "c", Where.INSTANCE, "i1")]
    assert [s.node for s in p.sources("m", exclude=["a"])] == ["a", "b", "c"][1:] and \
        p.sources("m", exclude=["a"])[0].instance_id == "i3"
    assert [s.node for s in p.sources("m", use_instances=False)] == ["a"]
    assert len(p.locations("m")) == 4
    p.remove_instance("m", "i1")
    assert [s.node for s in p.sources("m")] == ["a", "b"]


def test_a_lost_node_reports_models_to_recache_and_models_lost():
    p = pool(a=64, b=32)
    p.register("m1", 10 * GB)  # a
    p.register("m2", 10 * GB)  # a (54 free vs 32)
    p.add_instance("m1", "b", "i1")
    loss = p.remove_node("a")
    assert loss.recache == ("m1",) and loss.lost == ("m2",)
    assert p.models() == ["m1"] and p.needs_recache() == ["m1"]
    p.check()  # m1 still runs on b, waiting for a host copy
    p.add_host_copy("m1", p.choose_host(p.size_bytes("m1")))
    assert p.host_copies("m1") == ["b"] and p.needs_recache() == []


@pytest.mark.parametrize("call,message", [
    (lambda p: p.add_node("a", GB), "already in the pool"),
    (lambda p: p.add_node("z", -1), "must be >= 0"),
    (lambda p: p.register("m", GB), "already registered"),
    (lambda p: p.register("x", 0), "size must be > 0"),
    (lambda p: p.add_host_copy("m", "a"), "already has a host copy on 'a'"),
    (lambda p: p.add_host_copy("m", "nowhere"), "unknown node 'nowhere'"),
    (lambda p: p.add_host_copy("nothing", "a"), "unknown model 'nothing'"),
    (lambda p: p.add_host_copy("m", "b"), "has 1000000000 B of host memory free"),
    (lambda p: p.drop_host_copy("m", "b"), "no host copy on 'b'"),
    (lambda p: p.remove_instance("m", "i9"), "no instance 'i9'"),
    (lambda p: p.unregister("m"), "still has running instances"),
])
def test_bad_input_gets_clear_errors(call, message):
    p = pool(a=64, b=1)
    p.register("m", 2 * GB)
    p.add_instance("m", "a", "i0")
    with pytest.raises(PoolError, match=message):
        call(p)


class PoolMachine(RuleBasedStateMachine):
    """Random registrations, copies, drops, instances and node losses: the pool never leaves
    a model without a copy while the model has one to give, and memory adds up."""

    def __init__(self) -> None:
        super().__init__()
        self.p = pool(a=40, b=30, c=20, d=10)
        self.n = 0

    @rule(size=st.integers(1, 25))
    def register(self, size):
        self.n += 1
        free = {x: self.p.free_host_bytes(x) for x in self.p._nodes}
        try:
            node = self.p.register(f"m{self.n}", size * GB)
        except PoolError:
            assert all(f < size * GB for f in free.values())
            return
        assert free[node] == max(free.values()) and self.p.free_host_bytes(node) == free[node] - size * GB

    @rule(data=st.data())
    def copy_or_drop(self, data):
        if not self.p.models():
            return
        m = data.draw(st.sampled_from(self.p.models()))
        node = data.draw(st.sampled_from(sorted(self.p._nodes)))
        before = self.p.host_copies(m)
        if node in before:
            if len(before) == 1:
                with pytest.raises(LastHostCopy):
                    self.p.drop_host_copy(m, node)
            else:
                self.p.drop_host_copy(m, node)
        elif self.p.free_host_bytes(node) >= self.p.size_bytes(m):
            self.p.add_host_copy(m, node)

    @rule(data=st.data())
    def instance(self, data):
        if self.p.models():
            self.n += 1
            self.p.add_instance(data.draw(st.sampled_from(self.p.models())),
                                data.draw(st.sampled_from(sorted(self.p._nodes))), f"i{self.n}")

    @rule(data=st.data())
    def lose_node(self, data):
        if len(self.p._nodes) > 1:
            node = data.draw(st.sampled_from(sorted(self.p._nodes)))
            loss = self.p.remove_node(node)
            for m in loss.recache:  # re-cache at once where it fits
                dest = self.p.choose_host(self.p.size_bytes(m))
                if dest:
                    self.p.add_host_copy(m, dest)

    @invariant()
    def holds(self):
        self.p.check()


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_pool_machine = PoolMachine.TestCase


def test_registration_among_the_nodes_that_run_the_model():
    p = ParameterPool()
    p.add_node("cpu-0", 10 * GB)
    p.add_node("gpu-0", 50 * GB)  # the most free, but not a node the model runs on
    assert p.register("m", GB, among=["cpu-0"]) == "cpu-0"
    with pytest.raises(PoolError, match="most free: 9000000000 B on 1 nodes"):
        p.register("big", 11 * GB, among=["cpu-0"])  # cpu-0 has 9 GB left
    assert p.register("any", GB) == "gpu-0"
