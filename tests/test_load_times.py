"""The load-time models of mesh.perf.load_times, each written once (issue 34 item 4), against
the figures they come from."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.modelfiles.local import llama_parameter_count, shape_config, shape_names
from mesh.perf.load_times import GIB, ColdStart, block_sizes, kv_resize_s, weights_load_s
from mesh.perf.roofline import ARCHITECTURES, kv_bytes_per_token


def test_a_kv_resize_takes_figure_8s_times():
    """LLM-Mesh Figure 8 (an A100): 32 -> 64 GB in 1.9 s, 32 -> 16 GB in 0.3 s; no change, no time."""
    assert kv_resize_s(32 * GIB, 64 * GIB) == pytest.approx(1.9)
    assert kv_resize_s(32 * GIB, 16 * GIB) == pytest.approx(0.3)
    assert kv_resize_s(5 * GIB, 5 * GIB) == 0.0


def test_the_prior_is_a_stop_the_world_load_then_the_first_kv_cache():
    cs = ColdStart(pcie_bytes_per_s=20e9, cpu_load_bytes_per_s=40e9, fixed_s=1.0)
    assert cs.load_s(40 * 10**9, "gpu") == weights_load_s(40 * 10**9, 20e9, 1.0) == pytest.approx(3.0)
    assert cs.instance_load_s(40 * 10**9, "cpu", "m", 32 * GIB) == pytest.approx(1.0 + 1.0 + 1.9)
    measured = ColdStart(measured={("m", "cpu"): 4.0, ("*", "gpu"): 6.0})
    assert measured.instance_load_s(10**9, "cpu", "m", GIB) == 4.0  # a measured load includes the KV cache
    assert measured.instance_load_s(10**9, "gpu", "other", GIB) == 6.0
    assert measured.simulated_load_s(2.0, 10**9, "cpu", "m") == 6.0  # the node's wait, then the load


@given(st.integers(1, 2**30), st.integers(1, 1000), st.data())
def test_blocks_cover_the_model_once(block_bytes, nblocks, data):
    model_bytes = block_bytes * (nblocks - 1) + data.draw(st.integers(1, block_bytes))
    sizes = block_sizes(model_bytes, block_bytes)
    assert len(sizes) == nblocks and sum(sizes) == model_bytes
    assert all(0 < s <= block_bytes for s in sizes) and all(s == block_bytes for s in sizes[:-1])


@pytest.mark.parametrize("name", shape_names())
def test_the_checkpoint_and_the_roofline_count_the_same_parameters(name):
    """One formula: a shape folder's config and the roofline's architecture of that model agree."""
    arch = ARCHITECTURES[name]
    assert llama_parameter_count(shape_config(name)) == arch.params
    assert arch.kv_bytes_per_token == kv_bytes_per_token(arch, "f16",
                                                         "f16") == 2 * arch.layers * arch.kv_heads * arch.head_dim * 2
