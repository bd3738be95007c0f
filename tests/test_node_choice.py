"""mesh.policy.node_choice: where the service sends a request for a model."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mesh.policy.node_choice import NodeView, choose_node

GB = 2**30


def node(i: int, **kw) -> NodeView:
    kw.setdefault("kind", "cpu")
    kw.setdefault("up", True)
    kw.setdefault("free_bytes", 10 * GB)
    return NodeView(f"cpu-{i}", **kw)


def test_an_open_instance_takes_the_request_the_fullest_first():
    nodes = [node(0, instance="ready", active=2), node(1, instance="ready", active=5), node(2)]
    choice = choose_node(nodes, "cpu", GB)
    assert (choice.node_id, choice.new_instance) == ("cpu-1", False)
    loading = [node(0), node(1, instance="loading")]
    assert choose_node(loading, "cpu", GB).node_id == "cpu-1"  # wait for the load, do not start another


def test_scale_out_when_every_instance_refuses_host_copies_first():
    refusing = node(0, instance="ready", refusing=True, active=8)
    choice = choose_node([refusing, node(1, used_bytes=5 * GB), node(2, host_copy=True)], "cpu", GB)
    assert (choice.node_id, choice.new_instance) == ("cpu-2", True)
    assert "refuses" in choice.reason and "holds the weights" in choice.reason
    # no host copy anywhere: the fullest node that fits (idle nodes stay idle, LLM-Mesh 4)
    choice = choose_node([refusing, node(1, used_bytes=5 * GB), node(2, used_bytes=GB)], "cpu", GB)
    assert choice.node_id == "cpu-1"


def test_nodes_that_are_down_full_or_of_another_kind_are_skipped():
    nodes = [node(0, up=False, host_copy=True), node(1, free_bytes=GB // 2), node(2, kind="gpu"), node(3)]
    assert choose_node(nodes, "cpu", GB).node_id == "cpu-3"
    assert choose_node([node(0, up=False)], "cpu", GB) is None
    assert choose_node(nodes, "gpu", GB).node_id == "cpu-2"


def test_nowhere_to_scale_waits_on_the_least_queued_instance():
    nodes = [node(0, instance="ready", refusing=True, queued=4), node(1, instance="ready", refusing=True, queued=1),
             node(2, free_bytes=0)]
    choice = choose_node(nodes, "cpu", GB)
    assert (choice.node_id, choice.new_instance) == ("cpu-1", False)


def test_no_instance_and_no_free_memory_loads_where_most_is_free():
    choice = choose_node([node(0, free_bytes=GB // 4), node(1, free_bytes=GB // 2)], "cpu", GB)
    assert (choice.node_id, choice.new_instance) == ("cpu-1", True)


views = st.builds(
    NodeView, node_id=st.sampled_from([f"n{i}" for i in range(6)]), kind=st.sampled_from(["cpu", "gpu"]),
    up=st.booleans(), free_bytes=st.integers(0, 4 * GB), used_bytes=st.integers(0, 4 * GB),
    instance=st.sampled_from([None, "ready", "loading"]), refusing=st.booleans(), active=st.integers(0, 9),
    queued=st.integers(0, 9), host_copy=st.booleans())


@given(st.lists(views, max_size=8, unique_by=lambda v: v.node_id), st.integers(1, 3 * GB))
def test_the_choice_is_a_live_node_of_the_kind_and_scales_only_when_it_must(nodes, weight_bytes):
    choice = choose_node(nodes, "cpu", weight_bytes)
    live = [n for n in nodes if n.kind == "cpu" and n.up]
    if not live:
        assert choice is None
        return
    chosen = next(n for n in live if n.node_id == choice.node_id)
    open_instances = [n for n in live if n.instance is not None and not n.refusing]
    if open_instances:  # an instance that takes requests is never passed over for a new one
        assert not choice.new_instance and chosen in open_instances
    assert choice.new_instance == (chosen.instance is None)
