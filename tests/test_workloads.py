"""Tests of the workloads package: Azure trace loaders and workload generation."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from workloads.azure_functions import FunctionTrace, TraceFormatError, load_function_trace
from workloads.azure_llm import LengthTrace, load_lengths
from workloads.datasets import CONVERSATION_TRACE, FUNCTIONS_TRACE
from workloads.workload import (
    DEFAULT_TARGET_RPS_PER_FUNCTION,
    Workload,
    build_workload,
    bursty_single_model,
    default_target_rps,
    model_mix_counts,
    rate_scale_for_target,
    sample_functions,
    stochastic_round,
)

FUNCTIONS_CSV = FUNCTIONS_TRACE
CONV_CSV = CONVERSATION_TRACE
MIX_411 = {"llama-3.2-3b": 4, "llama-2-7b": 1, "llama-2-13b": 1}
MIX_114 = {"llama-3.2-3b": 1, "llama-2-7b": 1, "llama-2-13b": 4}


@pytest.fixture(scope="module")
def trace() -> FunctionTrace:
    return load_function_trace(FUNCTIONS_CSV)


@pytest.fixture(scope="module")
def lengths() -> LengthTrace:
    return load_lengths(CONV_CSV)


def small_trace(tmp_path: Path, rows: list[list[int]], first_minute: int = 0) -> FunctionTrace:
    n = len(rows[0])
    header = "HashOwner,HashApp,HashFunction,Trigger," + ",".join(
        str(first_minute + k) for k in range(n)
    )
    body = [f"o{i},a{i},f{i},http," + ",".join(map(str, r)) for i, r in enumerate(rows)]
    path = tmp_path / "small.csv"
    path.write_text("\n".join([header, *body]) + "\n")
    return load_function_trace(path)


def small_lengths(tmp_path: Path, pairs: list[tuple[int, int]]) -> LengthTrace:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [
        f"{float(i)},{c},{g}" for i, (c, g) in enumerate(pairs)
    ]
    path = tmp_path / "lengths.csv"
    path.write_text("\n".join(lines) + "\n")
    return load_lengths(path)


# ---------------------------------------------------------------- loaders, real files


def test_function_trace_real_file(trace: FunctionTrace) -> None:
    assert trace.counts.shape == (500, 240)
    assert trace.counts.dtype == np.int64
    assert trace.minutes[0] == 480 and trace.minutes[-1] == 719
    assert np.all(np.diff(trace.minutes) == 1)
    assert int(trace.counts.sum()) == 1_505_228
    assert int(trace.counts[:, trace.window(30)].sum()) == 171_558
    assert len(set(trace.function_ids)) == 500
    assert all(fid.count("/") == 2 for fid in trace.function_ids)
    assert Counter(trace.triggers)["timer"] == 247
    assert trace.index_of(trace.function_ids[17]) == 17


def test_length_trace_real_file(lengths: LengthTrace) -> None:
    # The data README says 19,365; the file holds 19,366 data rows after its header.
    assert len(lengths) == 19_366
    assert lengths.timestamps_s[0] == 0.0
    assert np.all(np.diff(lengths.timestamps_s) >= 0)
    assert lengths.timestamps_s[1] == pytest.approx(4.314579, abs=1e-9)
    assert lengths.duration_s == pytest.approx(3501.721937, abs=1e-6)
    assert lengths.context_tokens[0] == 374 and lengths.generated_tokens[0] == 44
    assert lengths.context_tokens.min() >= 1 and lengths.generated_tokens.min() >= 1
    assert lengths.excluded_fraction(4096) == pytest.approx(0.0832, abs=5e-4)
    assert lengths.excluded_fraction(None) == 0.0


def test_function_trace_any_minutes_and_start(tmp_path: Path) -> None:
    t = small_trace(tmp_path, [[1, 2, 3], [0, 0, 5]], first_minute=1000)
    assert list(t.minutes) == [1000, 1001, 1002]
    assert t.counts.tolist() == [[1, 2, 3], [0, 0, 5]]
    assert t.function_ids == ("o0/a0/f0", "o1/a1/f1")
    assert t.window(2, 1001) == slice(1, 3)
    with pytest.raises(ValueError, match="outside"):
        t.window(3, 1001)
    one = small_trace(tmp_path, [[7]], first_minute=1)
    assert one.counts.shape == (1, 1)


def test_function_trace_tolerates_bom_blank_lines_and_repeats(tmp_path: Path) -> None:
    path = tmp_path / "f.csv"
    path.write_text(
        "\ufeffHashOwner,HashApp,HashFunction,Trigger,5,6\n\n"
        "o,a,f,http,1,2\n\no,a,f,timer,3,4\n\n"
    )
    t = load_function_trace(path)
    assert t.function_ids == ("o/a/f", "o/a/f#2")
    assert t.triggers == ("http", "timer")
    assert t.counts.tolist() == [[1, 2], [3, 4]]


# ---------------------------------------------------------------- loaders, malformed input

HEADER = "HashOwner,HashApp,HashFunction,Trigger,480,481\n"


@pytest.mark.parametrize(
    "text, line, expected",
    [
        ("", 1, "empty file"),
        ("\n\n", 1, "empty file"),
        ("Owner,HashApp,HashFunction,Trigger,480\n", 1, "expected header"),
        ("HashOwner,HashApp,HashFunction,Trigger\no,a,f,http\n", 1, "at least one minute column"),
        ("HashOwner,HashApp,HashFunction,Trigger,480,x\n", 1, "integer minute number"),
        ("HashOwner,HashApp,HashFunction,Trigger,480,482\n", 1, "consecutive minute numbers"),
        (HEADER, 2, "at least one function row"),
        (HEADER + "o,a,f,http,1,2\no,a,g,http,1,2.5\n", 3, "non-negative integer count, got '2.5'"),
        (HEADER + "o,a,f,http,1,x\n", 2, "non-negative integer count, got 'x'"),
        (HEADER + "o,a,f,http,1,2\no,a,g,http,-1,2\n", 3, "non-negative integer count, got -1"),
        (HEADER + "o,a,f,http,1,2\no,a,g,http,1\n", 3, "expected 6 columns"),
        (HEADER + "o,a,f,http,1,2,3\n", 2, "expected 6 columns"),
        (HEADER + "o,,f,http,1,2\n", 2, "HashApp"),
        ("\n" + HEADER + "o,a,f,http,1,2\n\no,a,g,http,1\n", 5, "expected 6 columns"),
    ],
)
def test_function_trace_errors(tmp_path: Path, text: str, line: int, expected: str) -> None:
    path = tmp_path / "bad_functions.csv"
    path.write_text(text)
    with pytest.raises(TraceFormatError) as info:
        load_function_trace(path)
    message = str(info.value)
    assert str(path) in message
    assert f"line {line}:" in message
    assert expected in message
    assert info.value.line == line and info.value.path == str(path)


LHEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize(
    "text, line, expected",
    [
        ("", 1, "empty file"),
        ("TIMESTAMP,Context,GeneratedTokens\n", 1, "expected header"),
        (LHEADER, 2, "at least one request row"),
        (LHEADER + "2023-11-16 18:15:46.68,374\n", 2, "expected 3 columns"),
        (LHEADER + "2023-11-16 18:15:46.68,374,44,1\n", 2, "expected 3 columns"),
        (LHEADER + "yesterday,374,44\n", 2, "TIMESTAMP: expected a date-time"),
        (LHEADER + "2023-11-16 18:15:46,1,1\n2023-13-16 18:15:46,1,1\n", 3, "TIMESTAMP"),
        (LHEADER + "2023-11-16 18:15:46,1,1\n12.5,1,1\n", 3, "like the first row"),
        (LHEADER + "12.5,1,1\n2023-11-16 18:15:46,1,1\n", 3, "like the first row"),
        (LHEADER + "2023-11-16 18:15:46.5,1,1\n2023-11-16 18:15:46.4,1,1\n", 3, "no earlier"),
        (LHEADER + "2023-11-16 18:15:46,1.5,1\n", 2, "ContextTokens: expected a non-negative integer"),
        (LHEADER + "2023-11-16 18:15:46,1,-3\n", 2, "GeneratedTokens: expected a non-negative integer, got -3"),
    ],
)
def test_length_trace_errors(tmp_path: Path, text: str, line: int, expected: str) -> None:
    path = tmp_path / "bad_lengths.csv"
    path.write_text(text)
    with pytest.raises(TraceFormatError) as info:
        load_lengths(path)
    message = str(info.value)
    assert str(path) in message
    assert f"line {line}:" in message
    assert expected in message


def test_length_trace_formats(tmp_path: Path) -> None:
    path = tmp_path / "l.csv"
    path.write_text(LHEADER + "2023-11-16T23:59:59.9999999,5,6\n\n2023-11-17 00:00:01,7,8\n")
    t = load_lengths(path)
    assert t.timestamps_s.tolist() == pytest.approx([0.0, 1.0000001], abs=1e-9)
    numeric = small_lengths(tmp_path, [(1, 1), (2, 2)])
    assert numeric.timestamps_s.tolist() == [0.0, 1.0]


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_function_trace(tmp_path / "nope.csv")


# ---------------------------------------------------------------- length sampling


def test_length_sample_respects_max_total(lengths: LengthTrace) -> None:
    s = lengths.sample(20_000, np.random.default_rng(1), max_total=4096)
    assert s.prompt_tokens.shape == (20_000,)
    assert np.all(s.prompt_tokens + s.output_tokens <= 4096)
    assert s.prompt_tokens.min() >= 1 and s.output_tokens.min() >= 1
    assert s.excluded_fraction == pytest.approx(lengths.excluded_fraction(4096))
    assert s.eligible + s.excluded == len(lengths)
    # pairs stay together: every sampled pair is a row of the trace
    rows = set(zip(lengths.context_tokens.tolist(), lengths.generated_tokens.tolist()))
    assert set(zip(s.prompt_tokens.tolist(), s.output_tokens.tolist())) <= rows


def test_length_sample_uniform_and_excludes(tmp_path: Path) -> None:
    t = small_lengths(tmp_path, [(10, 10), (20, 20), (30, 30), (0, 5), (100, 100)])
    s = t.sample(30_000, np.random.default_rng(0), max_total=60)
    assert s.excluded == 2 and s.excluded_fraction == pytest.approx(0.4)
    counts = Counter(s.prompt_tokens.tolist())
    assert set(counts) == {10, 20, 30}
    assert stats.chisquare(list(counts.values())).pvalue > 1e-3
    with pytest.raises(ValueError, match="no request"):
        t.sample(1, np.random.default_rng(0), max_total=10)
    a = t.sample(50, np.random.default_rng(5), 60)
    b = t.sample(50, np.random.default_rng(5), 60)
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens)


# ---------------------------------------------------------------- sampling and mixes


def test_function_sampling_deterministic_nested_and_bounded(trace: FunctionTrace) -> None:
    a = sample_functions(trace, 32, seed=3)
    assert np.array_equal(a, sample_functions(trace, 32, seed=3))
    assert not np.array_equal(a, sample_functions(trace, 32, seed=4))
    assert len(set(a.tolist())) == 32 and np.all(np.diff(a) > 0)
    s64, s128 = sample_functions(trace, 64, 3), sample_functions(trace, 128, 3)
    assert set(a) <= set(s64) <= set(s128)
    for bad in (0, 501):
        with pytest.raises(ValueError, match="holds 500"):
            sample_functions(trace, bad, 0)
    with pytest.raises(ValueError, match="seed"):
        sample_functions(trace, 3, -1)


def test_function_sampling_is_uniform(tmp_path: Path) -> None:
    t = small_trace(tmp_path, [[1]] * 20)
    hits = np.zeros(20, dtype=np.int64)
    for seed in range(4000):
        hits[sample_functions(t, 5, seed)] += 1
    assert hits.sum() == 20_000
    assert stats.chisquare(hits).pvalue > 1e-3


@pytest.mark.parametrize("mix", [MIX_411, MIX_114])
@pytest.mark.parametrize("n", [32, 64, 128])
def test_model_mix_exact_proportions(trace, lengths, mix: dict[str, int], n: int) -> None:
    counts = model_mix_counts(mix, n)
    assert sum(counts.values()) == n
    total_w = sum(mix.values())
    for base, w in mix.items():
        assert abs(counts[base] - n * w / total_w) < 1
    w = build_workload(trace, lengths, functions=n, minutes=1, models=mix, seed=1, rate_scale=0.01)
    assert Counter(w.models.values()) == Counter(counts)
    width = 3
    for replica, base in w.models.items():
        b, _, idx = replica.partition("/f")
        assert b == base and len(idx) == width
    assert sorted(int(r.split("/f")[1]) for r in w.models) == list(range(n))


def test_model_mix_largest_remainder() -> None:
    assert model_mix_counts(MIX_411, 32) == {"llama-3.2-3b": 22, "llama-2-7b": 5, "llama-2-13b": 5}
    assert model_mix_counts(MIX_114, 32) == {"llama-3.2-3b": 5, "llama-2-7b": 5, "llama-2-13b": 22}
    assert model_mix_counts(MIX_411, 64) == {"llama-3.2-3b": 43, "llama-2-7b": 11, "llama-2-13b": 10}
    assert model_mix_counts(MIX_411, 128) == {"llama-3.2-3b": 86, "llama-2-7b": 21, "llama-2-13b": 21}
    assert model_mix_counts({"a": 1, "b": 0}, 7) == {"a": 7, "b": 0}
    for bad in ({}, {"a": 0}, {"a": -1, "b": 2}, {"a": float("nan")}):
        with pytest.raises(ValueError, match="model mix"):
            model_mix_counts(bad, 4)


def test_model_assignment_is_shuffled_by_seed(trace, lengths) -> None:
    kw = dict(functions=32, minutes=1, models=MIX_411, rate_scale=0.01)
    a = build_workload(trace, lengths, seed=0, **kw).description["per_function"]
    b = build_workload(trace, lengths, seed=1, **kw).description["per_function"]
    bases = lambda d: [f["base_model"] for f in d]  # noqa: E731 - a local shorthand
    assert bases(a) != bases(b)
    assert bases(a)[:22] != ["llama-3.2-3b"] * 22  # not in mix order


# ---------------------------------------------------------------- rate scaling and arrivals


def test_stochastic_round_expectation() -> None:
    rng = np.random.default_rng(0)
    x = stochastic_round(np.full(200_000, 2.3), rng)
    assert set(np.unique(x).tolist()) == {2, 3}
    assert x.mean() == pytest.approx(2.3, abs=0.005)
    ints = np.array([0.0, 1.0, 7.0, 12345.0])
    assert stochastic_round(ints, rng).tolist() == [0, 1, 7, 12345]
    with pytest.raises(ValueError):
        stochastic_round(np.array([-0.5]), rng)


def test_uniform_scale_one_reproduces_counts(trace, lengths) -> None:
    w = build_workload(trace, lengths, functions=64, minutes=5, seed=2, rate_scale=1.0, arrivals="uniform")
    d = w.description
    times = np.array([a.time_s for a in w.arrivals])
    assert np.all(np.diff(times) >= 0)
    assert times.min() >= 0 and times.max() < 300
    rows = sample_functions(trace, 64, 2)
    raw = trace.counts[rows, trace.window(5)]
    got = Counter((a.function, int(a.time_s // 60)) for a in w.arrivals)
    for i, r in enumerate(rows):
        for m in range(5):
            assert got[(trace.function_ids[r], m)] == raw[i, m]
    assert d["requests"] == d["raw_invocations"] == int(raw.sum())
    assert d["per_minute"]["raw"] == d["per_minute"]["requests"] == raw.sum(axis=0).tolist()


@pytest.mark.parametrize("arrivals", ["uniform", "poisson"])
def test_fractional_scale_expectation(tmp_path: Path, arrivals: str) -> None:
    t = small_trace(tmp_path, [[3, 0, 10, 1]] * 5, first_minute=60)
    ln = small_lengths(tmp_path, [(5, 5)])
    totals = [
        len(build_workload(t, ln, functions=5, minutes=4, seed=s, rate_scale=0.37, arrivals=arrivals))
        for s in range(400)
    ]
    expected = 0.37 * 14 * 5
    assert np.mean(totals) == pytest.approx(expected, rel=0.03)
    if arrivals == "uniform":  # stochastic rounding: each cell is floor or ceil
        assert min(totals) >= sum(math.floor(0.37 * c) for c in [3, 0, 10, 1]) * 5


@pytest.mark.parametrize("arrivals", ["uniform", "poisson"])
def test_arrivals_inside_their_minute_and_sorted(trace, lengths, arrivals: str) -> None:
    w = build_workload(trace, lengths, functions=32, minutes=10, start_minute=600, seed=5, arrivals=arrivals)
    times = np.array([a.time_s for a in w.arrivals])
    assert np.all(np.diff(times) >= 0)
    assert times.min() >= 0.0 and times.max() < 600.0
    per_minute = np.bincount((times // 60).astype(int), minlength=10)
    assert per_minute.tolist() == w.description["per_minute"]["requests"]
    assert w.description["per_minute"]["minute"] == list(range(600, 610))
    assert w.description["window"]["start_minute"] == 600
    assert len({a.request_id for a in w.arrivals}) == len(w)
    assert all(a.model in w.models for a in w.arrivals)


def test_rate_scale_for_target(trace, lengths) -> None:
    rows = sample_functions(trace, 64, 1)
    ids = [trace.function_ids[r] for r in rows]
    scale = rate_scale_for_target(trace, ids, 30, 10.0)
    raw = trace.counts[rows, :30].sum()
    assert scale * raw / 1800 == pytest.approx(10.0)
    w = build_workload(trace, lengths, functions=64, seed=1, rate_scale=scale)
    assert w.description["expected_requests"] == pytest.approx(18_000)
    assert w.description["mean_rps"] == pytest.approx(10.0, rel=0.03)
    auto = build_workload(trace, lengths, functions=64, seed=1, target_rps=10.0)
    assert auto.description["rate_scale"]["value"] == pytest.approx(scale)
    with pytest.raises(ValueError, match="positive"):
        rate_scale_for_target(trace, ids, 30, 0.0)
    silent = [trace.function_ids[i] for i in np.flatnonzero(trace.counts[:, :30].sum(1) == 0)[:3]]
    with pytest.raises(ValueError, match="no invocation"):
        rate_scale_for_target(trace, silent, 30, 1.0)


@pytest.mark.parametrize("n", [32, 64, 128])
def test_auto_scale_default_target(trace, lengths, n: int) -> None:
    w = build_workload(trace, lengths, functions=n, seed=0)
    d = w.description
    assert default_target_rps(n) == pytest.approx(n * DEFAULT_TARGET_RPS_PER_FUNCTION)
    assert d["rate_scale"]["mode"] == "auto"
    assert d["rate_scale"]["target_rps"] == pytest.approx(default_target_rps(n))
    assert d["expected_requests"] == pytest.approx(default_target_rps(n) * 1800)
    assert d["mean_rps"] == pytest.approx(default_target_rps(n), rel=0.05)
    assert "DEFAULT_TARGET_RPS_PER_FUNCTION" in d["rate_scale"]["reason"]


# ---------------------------------------------------------------- lengths and determinism


def test_lengths_within_max_total_per_model(trace, lengths) -> None:
    windows = {"llama-3.2-3b": 2048, "llama-2-7b": 4096, "llama-2-13b": 4096}
    w = build_workload(trace, lengths, functions=64, minutes=10, models=MIX_114, seed=3, max_total=windows)
    for a in w.arrivals:
        assert a.prompt_len >= 1 and a.output_len >= 1
        assert a.prompt_len + a.output_len <= windows[w.models[a.model]]
    per_model = w.description["per_model"]
    assert per_model["llama-2-7b"]["excluded_fraction"] == pytest.approx(0.0832, abs=5e-4)
    assert per_model["llama-3.2-3b"]["excluded_fraction"] > per_model["llama-2-7b"]["excluded_fraction"]
    assert sum(m["requests"] for m in per_model.values()) == len(w)
    with pytest.raises(ValueError, match="no context window"):
        build_workload(trace, lengths, functions=8, minutes=1, models=MIX_114, max_total={"llama-2-7b": 4096})


def test_same_arguments_same_workload(trace, lengths) -> None:
    kw = dict(functions=32, minutes=5, models=MIX_411, seed=7, max_total=4096)
    a, b = build_workload(trace, lengths, **kw), build_workload(trace, lengths, **kw)
    assert a.arrivals == b.arrivals and a.models == b.models and a.description == b.description
    c = build_workload(trace, lengths, **{**kw, "seed": 8})
    assert c.arrivals != a.arrivals
    json.dumps(a.description)  # plain data
    # changing the arrival process does not change which functions are sampled
    u = build_workload(trace, lengths, **{**kw, "arrivals": "uniform"})
    assert u.models == a.models


def test_build_workload_errors(trace, lengths) -> None:
    with pytest.raises(ValueError, match="holds 500"):
        build_workload(trace, lengths, functions=1000)
    with pytest.raises(ValueError, match="outside"):
        build_workload(trace, lengths, minutes=30, start_minute=700)
    with pytest.raises(ValueError, match="rate_scale"):
        build_workload(trace, lengths, rate_scale="fast")
    with pytest.raises(ValueError, match="rate_scale"):
        build_workload(trace, lengths, rate_scale=-1.0)
    with pytest.raises(ValueError, match="target_rps"):
        build_workload(trace, lengths, rate_scale=1.0, target_rps=3.0)
    with pytest.raises(ValueError, match="arrivals"):
        build_workload(trace, lengths, arrivals="bursty")


# ---------------------------------------------------------------- conversation-trace timestamps


def test_bursty_single_model(lengths: LengthTrace) -> None:
    w = bursty_single_model(lengths, model="llama-2-7b", minutes=5, seed=0, max_total=2048)
    assert isinstance(w, Workload) and w.models == {"llama-2-7b/f000": "llama-2-7b"}
    n = int(np.sum(lengths.timestamps_s < 300))
    assert len(w) == n
    assert [a.time_s for a in w.arrivals] == lengths.timestamps_s[:n].tolist()
    assert all(a.prompt_len + a.output_len <= 2048 for a in w.arrivals)
    assert w.description["resampled_lengths"] == int(
        np.sum(lengths.context_tokens[:n] + lengths.generated_tokens[:n] > 2048)
    )
    for a, c, g in zip(w.arrivals, lengths.context_tokens[:n], lengths.generated_tokens[:n]):
        if c + g <= 2048:  # rows that fit keep their own lengths
            assert (a.prompt_len, a.output_len) == (c, g)
    fast = bursty_single_model(lengths, model="llama-2-7b", minutes=5, seed=0, time_scale=0.5)
    assert len(fast) == int(np.sum(lengths.timestamps_s * 0.5 < 300))
    assert bursty_single_model(lengths, model="llama-2-7b", minutes=5, seed=0, max_total=2048).arrivals == w.arrivals
    json.dumps(w.description)
    with pytest.raises(ValueError):
        bursty_single_model(lengths, model="llama-2-7b", minutes=0, seed=0)
