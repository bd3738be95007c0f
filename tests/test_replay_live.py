"""The pieces of `mesh replay --live` that need no service: the workload's scaled lengths,
the prompts, the `ignore_eos` field on its way to the engine. The whole run against a real
`mesh serve` is in tests/test_service_e2e.py."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.bench.live import function_name, prompt_ids
from mesh.engines.engine_api import Sampling
from mesh.service.errors import ApiError
from mesh.service.schema import parse_completion
from mesh.wire.agent_protocol import sampling_from_dict, sampling_to_dict
from workloads.workload import Arrival, Workload, scale_lengths


def _workload(lengths: list[tuple[int, int]]) -> Workload:
    arrivals = [Arrival(f"r{i}", float(i), "f", "m/f000", p, o) for i, (p, o) in enumerate(lengths)]
    return Workload(arrivals, {"m/f000": "m"}, {"duration_s": 60.0})


@given(st.lists(st.tuples(st.integers(1, 8000), st.integers(1, 4000)), min_size=1, max_size=30),
       st.floats(0.5, 32), st.integers(6, 4096))
def test_scaled_lengths_fit_the_window_and_keep_the_arrivals(lengths, factor, window):
    w = scale_lengths(_workload(lengths), factor, window)
    assert [a.time_s for a in w.arrivals] == [float(i) for i in range(len(lengths))]
    for a, (p, o) in zip(w.arrivals, lengths):
        assert a.prompt_len >= 4 and a.output_len >= 2 and a.prompt_len + a.output_len <= window
        if round(p / factor) >= 4 and round(p / factor) + max(2, round(o / factor)) <= window - 2:
            assert a.prompt_len == round(p / factor)


def test_scaled_lengths_refuse_a_bad_factor():
    with pytest.raises(ValueError, match="length scale"):
        scale_lengths(_workload([(10, 10)]), 0.0, 100)


def test_prompts_are_the_same_for_the_same_request():
    assert prompt_ids("r001", 16) == prompt_ids("r001", 16) != prompt_ids("r002", 16)
    assert len(prompt_ids("r001", 300)) == 300 and function_name("smollm2-135m/f003") == "f003"


def test_ignore_eos_travels_from_the_api_to_the_engine():
    req = parse_completion({"model": "m", "prompt": "Hi", "max_tokens": 8, "ignore_eos": True})
    assert req.ignore_eos
    s = Sampling(max_tokens=8, ignore_eos=True)
    assert sampling_from_dict(sampling_to_dict(s)) == s
    assert not sampling_from_dict({"max_tokens": 3}).ignore_eos  # an older service's message
    for bad in ({"ignore_eos": 1, "max_tokens": 8}, {"ignore_eos": True}):
        with pytest.raises(ApiError) as exc:
            parse_completion({"model": "m", "prompt": "Hi", **bad})
        assert exc.value.status == 400 and exc.value.param == "ignore_eos"
