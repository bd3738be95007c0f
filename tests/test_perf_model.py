"""PerformanceModel (LLM-Mesh 5.2): interpolation, the outside-grid rule, scalar vs scipy."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.perf.model import PerformanceModel
from mesh.perf.profile import Profile, profile_from_dict, reference_profile, reference_profiles


def make_profile(lengths: list[int], prefill: list[float], batches: list[int], contexts: list[int],
                 decode: list[list[float]]) -> Profile:
    return profile_from_dict({
        "format": "mesh-profile/1", "model": "m", "device": "d", "device_kind": "gpu",
        "engine": "test", "kv_bytes_per_token": 1, "weight_bytes": 1, "max_context": contexts[-1],
        "prefill": {"prompt_lengths": lengths, "seconds": prefill},
        "decode": {"batch_sizes": batches, "context_lengths": contexts, "seconds": decode},
        "provenance": {"method": "measured", "hardware": {}},
    })


@pytest.fixture
def model() -> PerformanceModel:
    # decode = 0.01 * batch + 0.001 * context at the grid points (bilinear is exact for it)
    batches, contexts = [1, 2, 4, 8], [16, 32, 64]
    decode = [[0.01 * b + 0.001 * c for c in contexts] for b in batches]
    return PerformanceModel(make_profile([16, 32, 64], [0.1, 0.2, 0.5], batches, contexts, decode))


def test_exact_at_grid_points(model: PerformanceModel) -> None:
    p = model.profile
    for n, s in zip(p.prefill_lengths, p.prefill_s):
        assert model.prefill_s(n) == s
    for i, b in enumerate(p.decode_batches):
        for j, c in enumerate(p.decode_contexts):
            assert model.decode_s(b, c) == p.decode_s[i][j]


def test_linear_between_points(model: PerformanceModel) -> None:
    assert model.prefill_s(24) == pytest.approx(0.15)
    assert model.prefill_s(48) == pytest.approx(0.35)
    assert model.decode_s(3, 24) == pytest.approx(0.03 + 0.024)
    assert model.decode_s(6, 40.5) == pytest.approx(0.06 + 0.0405)


def test_bilinear_cell_centre_is_mean_of_corners() -> None:
    m = PerformanceModel(make_profile([1, 2], [1.0, 2.0], [1, 2], [1, 2], [[1.0, 2.0], [3.0, 10.0]]))
    assert m.decode_s(1.5, 1.5) == pytest.approx((1 + 2 + 3 + 10) / 4)


def test_below_grid_clamps_flat(model: PerformanceModel) -> None:
    assert model.prefill_s(1) == model.prefill_s(15) == model.prefill_s(16) == 0.1
    assert model.decode_s(1, 1) == model.decode_s(1, 16)
    assert model.decode_s(3, 5) == model.decode_s(3, 16)


def test_above_grid_extrapolates_last_segment(model: PerformanceModel) -> None:
    # last prefill segment: 0.2 -> 0.5 over 32 -> 64 tokens
    assert model.prefill_s(128) == pytest.approx(0.5 + 64 * 0.3 / 32)
    assert model.decode_s(16, 64) == pytest.approx(0.16 + 0.064)
    assert model.decode_s(8, 128) == pytest.approx(0.08 + 0.128)
    assert model.decode_s(16, 256) == pytest.approx(0.16 + 0.256)
    assert model.decode_s(32, 5) == pytest.approx(0.32 + 0.016)  # above in batch, below in context


def test_above_grid_never_below_edge_value() -> None:
    # measured times may dip in the last segment: extrapolation must not go below the edge
    m = PerformanceModel(make_profile(
        [16, 32, 64], [0.1, 0.5, 0.4], [1, 2, 4], [16, 32],
        [[0.1, 0.2], [0.3, 0.25], [0.2, 0.4]],
    ))
    assert m.prefill_s(1000) == 0.4
    assert m.decode_s(64, 16) == 0.2  # batch slope at context 16 is negative
    assert m.decode_s(4, 1000) == pytest.approx(0.4 + (1000 - 32) * 0.2 / 16)
    assert m.decode_s(2, 1000) == pytest.approx(0.25)  # context slope at batch 2 is negative
    for f in (m.prefill_s_many([1000]), m.decode_s_many([64, 2], [16, 1000])):
        assert np.all(f > 0)
    assert m.decode_s_many([64, 2], [16, 1000]) == pytest.approx([0.2, 0.25])


@pytest.mark.parametrize("bad", [0, -3, 0.5, float("nan")])
def test_inputs_below_one_raise(model: PerformanceModel, bad: float) -> None:
    with pytest.raises(ValueError, match="prompt_len must be at least 1"):
        model.prefill_s(bad)
    with pytest.raises(ValueError, match="batch must be at least 1"):
        model.decode_s(bad, 100)
    with pytest.raises(ValueError, match="avg_context must be at least 1"):
        model.decode_s(1, bad)
    with pytest.raises(ValueError, match="every prompt length must be at least 1"):
        model.prefill_s_many([16, bad])
    with pytest.raises(ValueError, match="every batch must be at least 1"):
        model.decode_s_many([bad], [16])
    with pytest.raises(ValueError, match="every avg_context must be at least 1"):
        model.decode_s_many([1], [bad])


def test_many_shapes(model: PerformanceModel) -> None:
    assert model.prefill_s_many([16, 24]).shape == (2,)
    grid = model.decode_s_many(np.array([[1], [2]]), np.array([16, 32, 64]))  # broadcasts
    assert grid.shape == (2, 3)
    assert grid[1, 2] == pytest.approx(model.decode_s(2, 64))


# --- the hot path (plain Python) must agree with the scipy reference path ----------------

def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


@st.composite
def profiles(draw: st.DrawFn) -> Profile:
    def axis() -> list[int]:
        start = draw(st.integers(0, 5))
        count = draw(st.integers(2, 7))
        return [2 ** (start + k) for k in range(count)]

    times = st.floats(1e-3, 10.0, allow_nan=False, allow_infinity=False)
    lengths, batches, contexts = axis(), axis(), axis()
    prefill = [draw(times) for _ in lengths]
    decode = [[draw(times) for _ in contexts] for _ in batches]
    return make_profile(lengths, prefill, batches, contexts, decode)


def _points(profile_axis: tuple[int, ...]) -> st.SearchStrategy[float]:
    # below, inside and up to 4x above the grid
    return st.one_of(
        st.floats(1.0, 4.0 * profile_axis[-1]),
        st.integers(1, 4 * profile_axis[-1]).map(float),
        st.sampled_from([float(g) for g in profile_axis]),
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data(), profile=profiles())
def test_scalar_matches_scipy_random_profiles(data: st.DataObject, profile: Profile) -> None:
    m = PerformanceModel(profile)
    n = data.draw(_points(profile.prefill_lengths))
    b = data.draw(_points(profile.decode_batches))
    c = data.draw(_points(profile.decode_contexts))
    assert _close(m.prefill_s(n), float(m.prefill_s_many([n])[0]))
    assert _close(m.decode_s(b, c), float(m.decode_s_many([b], [c])[0]))


REFERENCE = {pair: PerformanceModel(reference_profile(*pair)) for pair in reference_profiles()}


@settings(max_examples=300, deadline=None)
@given(pair=st.sampled_from(sorted(REFERENCE)), data=st.data())
def test_scalar_matches_scipy_reference_profiles(pair: tuple[str, str], data: st.DataObject) -> None:
    m = REFERENCE[pair]
    p = m.profile
    n = data.draw(_points(p.prefill_lengths))
    b = data.draw(_points(p.decode_batches))
    c = data.draw(_points(p.decode_contexts))
    assert _close(m.prefill_s(n), float(m.prefill_s_many([n])[0]))
    assert _close(m.decode_s(b, c), float(m.decode_s_many([b], [c])[0]))


def test_scalar_matches_scipy_on_a_dense_sweep() -> None:
    m = REFERENCE[("llama-2-13b", "xeon-6462c")]
    lengths = np.arange(1, 2 * 4096, 7)
    assert np.allclose([m.prefill_s(int(n)) for n in lengths], m.prefill_s_many(lengths), rtol=1e-9, atol=0)
    b, c = np.meshgrid(np.arange(1, 520, 9), np.arange(1, 9000, 97), indexing="ij")
    scalar = np.array([[m.decode_s(int(x), int(y)) for x, y in zip(rb, rc)] for rb, rc in zip(b, c)])
    assert np.allclose(scalar, m.decode_s_many(b, c), rtol=1e-9, atol=0)


def test_hot_path_speed(benchmark) -> None:  # type: ignore[no-untyped-def]
    # Timed only with --benchmark-enable; the target is ~1-3 us a call (LLM-Mesh 5.3 calls it
    # thousands of times per shadow validation).
    m = REFERENCE[("llama-2-7b", "xeon-6462c")]
    benchmark(lambda: (m.decode_s(13, 777.5), m.prefill_s(777)))
