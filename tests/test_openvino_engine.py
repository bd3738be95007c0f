"""OpenVINOEngine: fast tests of input checks and helpers, slow tests on the real demo model.

The slow tests share one engine (context window 256, so over-long prompts are cheap to
build) and keep prompts short and max_tokens <= 16.
"""
from __future__ import annotations

import asyncio
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mesh.engines.detokenize import Detokenizer, StopMatcher
from mesh.engines.engine_api import Engine, EngineError, EngineRequest, FinishReason, Sampling, step_result
from mesh.engines.openvino_engine import OpenVINOEngine, resolve_model
from mesh.modelfiles.gguf import GGUFError, read_gguf_metadata
from mesh.modelfiles.shape import shape_from_config, shape_from_gguf
from mesh.perf.roofline import kv_bytes_per_token
from mesh.policy.batching import IterationKind

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
COLORS = [{"role": "user", "content": "List three colors."}]


# ---- a GGUF file with metadata only, for fast tests ---------------------------------------

def _gguf_string(s: str) -> bytes:
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def write_tiny_gguf(path: Path, **overrides: object) -> Path:
    """A GGUF header with SmolLM2-135M's shape and no tensors."""
    kvs: dict[str, object] = {
        "general.architecture": "llama", "llama.block_count": 30, "llama.context_length": 8192,
        "llama.embedding_length": 576, "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3, "llama.vocab_size": 49152,
        "tokenizer.ggml.tokens": ["a", "b", "c"],
    }
    kvs.update(overrides)
    body = b""
    for key, value in kvs.items():
        body += _gguf_string(key)
        if isinstance(value, str):
            body += struct.pack("<I", 8) + _gguf_string(value)
        elif isinstance(value, int):
            body += struct.pack("<I", 4) + struct.pack("<I", value)
        elif isinstance(value, list):
            body += struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_gguf_string(v) for v in value)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + body)
    return path


# ---- fast tests -----------------------------------------------------------------------------

def test_gguf_metadata_and_kv_bytes(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf")
    meta = read_gguf_metadata(path)
    assert meta["llama.block_count"] == 30 and meta["tokenizer.ggml.tokens"].count == 3
    assert read_gguf_metadata(path, keep_arrays=True)["tokenizer.ggml.tokens"] == ["a", "b", "c"]
    shape = shape_from_gguf(path)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.context_length) == (30, 3, 64, 8192)
    # u8 keys (per-channel f32 scale+zero point per 32-token block), u8 values (per token)
    assert kv_bytes_per_token(shape) == 30 * 3 * ((64 + 8 * 64 // 32) + (64 + 8)) == 13680
    assert kv_bytes_per_token(shape, "bf16", "bf16") == 2 * 30 * 3 * 64 * 2
    with pytest.raises(ValueError, match="precision"):
        kv_bytes_per_token(shape, "u4", "u8")
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(GGUFError, match="not a GGUF"):
        read_gguf_metadata(tmp_path / "bad.gguf")


def test_gguf_string_arrays_are_skipped_across_reads_and_a_truncated_one_is_refused(tmp_path: Path) -> None:
    """Skipped string arrays (a vocabulary) are walked by their lengths in 1 MiB reads: strings
    that straddle a read, and one longer than a read, leave the reader at the next key."""
    import mesh.modelfiles.gguf as gguf

    tokens = [f"t{i}" * (i % 7) for i in range(300_000)] + ["x" * (3 << 20)] + ["y", ""]
    path = write_tiny_gguf(tmp_path / "m.gguf", **{"tokenizer.ggml.tokens": tokens, "general.name": "after"})
    meta = read_gguf_metadata(path)
    assert meta["tokenizer.ggml.tokens"] == (8, len(tokens)) and meta["general.name"] == "after"
    assert read_gguf_metadata(path, keep_arrays=True)["tokenizer.ggml.tokens"] == tokens
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(GGUFError, match="ends early"):
        read_gguf_metadata(tmp_path / "cut.gguf")
    assert gguf._CHUNK < len(data) // 2  # (the walk crossed reads)


def test_shape_from_hf_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,'
        ' "hidden_size": 4096, "max_position_embeddings": 4096, "model_type": "llama"}')
    shape = shape_from_config(tmp_path / "config.json")
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (32, 8, 128)


def test_hf_folder_gets_an_export_hint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(EngineError, match="optimum-cli export openvino"):
        OpenVINOEngine(tmp_path)


def test_bad_model_paths(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="does not exist"):
        resolve_model(tmp_path / "missing.gguf")
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04" + bytes(16))
    with pytest.raises(EngineError, match="not a GGUF"):
        resolve_model(tmp_path / "x.bin")
    ir = tmp_path / "ir"
    ir.mkdir()
    (ir / "openvino_model.xml").write_text("<net/>")
    with pytest.raises(EngineError, match="lacks .*openvino_tokenizer.xml"):
        resolve_model(ir)
    with pytest.raises(EngineError, match="neither"):
        resolve_model(tmp_path)


def test_configuration_checks_without_loading(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf")
    engine = OpenVINOEngine(path, model_name="tiny")
    assert isinstance(engine, Engine)
    assert engine.context_window == 4096  # the model's 8192, capped by default
    assert engine.prefill_token_budget == 4096
    assert engine.weight_bytes == path.stat().st_size
    assert OpenVINOEngine(path, context_window=512).prefill_token_budget == 512
    with pytest.raises(EngineError, match="prefill_token_budget 100 is below context_window 512"):
        OpenVINOEngine(path, context_window=512, prefill_token_budget=100)
    with pytest.raises(EngineError, match="not loaded"):
        engine.add_request(EngineRequest("r", 1, Sampling(), [1]))
    with pytest.raises(EngineError, match="non-negative"):
        asyncio.run(engine.resize_kv(-1))


def _bytes_decode(ids: list[int]) -> str:
    """A byte-level 'tokenizer': token id = one byte; invalid bytes are dropped (like OpenVINO)."""
    return bytes(ids).decode("utf-8", errors="ignore")


def test_detokenizer_holds_partial_characters() -> None:
    text = "naïve 日本 😀!"
    detok = Detokenizer(_bytes_decode)
    deltas = [detok.push(b) for b in text.encode()]
    assert "".join(deltas) + detok.flush() == text
    assert "" in deltas  # multi-byte characters wait for their last byte
    assert all("\ufffd" not in d for d in deltas)


def test_stop_matcher_cuts_and_never_leaks() -> None:
    stop = StopMatcher(("END", "xyz"))
    out = [stop.feed(d) for d in ["ab", "cE", "N", "D and more"]]
    assert out == ["ab", "c", "", ""] and stop.stopped
    stop = StopMatcher(("END",))
    out = [stop.feed(d) for d in ["abE", "Nd"]]  # "EN" was a false start
    assert "".join(out) + stop.flush() == "abENd" and not stop.stopped


def test_step_result_from_per_request_outputs() -> None:
    """The builder both real engines use: tokens in batch order, finished requests apart
    (one may end without a token: aborted by the engine)."""
    r = step_result(IterationKind.DECODE, [("a", 5, "x", None), ("b", None, "", FinishReason.ABORT),
                                           ("c", 7, "yz", FinishReason.STOP), ("d", None, "", None)])
    assert (r.kind, r.request_ids, r.token_ids, r.texts) == (IterationKind.DECODE, ["a", "c"], [5, 7], ["x", "yz"])
    assert r.finished == {"b": FinishReason.ABORT, "c": FinishReason.STOP}
    empty = step_result(IterationKind.PREFILL, [])
    assert (empty.request_ids, empty.token_ids, empty.texts, empty.finished) == ([], [], [], {})


# ---- slow tests on the demo model ---------------------------------------------------------

@dataclass
class Run:
    steps: list = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    finished: dict[str, FinishReason] = field(default_factory=dict)

    def record(self, result) -> None:
        self.steps.append(result)
        for rid, tok, text in zip(result.request_ids, result.token_ids, result.texts):
            self.tokens.setdefault(rid, []).append(tok)
            self.texts[rid] = self.texts.get(rid, "") + text
        self.finished.update(result.finished)


def step(engine: OpenVINOEngine, run: Run | None = None):
    result = asyncio.run(engine.step())
    if run is not None:
        run.record(result)
    return result


def drain(engine: OpenVINOEngine, run: Run | None = None) -> Run:
    run = run or Run()
    while engine.has_work():
        step(engine, run)
    return run


def add(engine: OpenVINOEngine, rid: str, messages, **sampling) -> list[int]:
    ids = engine.encode_chat(messages)
    engine.add_request(EngineRequest(rid, len(ids), Sampling(**sampling), ids))
    return ids


@pytest.fixture(scope="module")
def engine(demo_gguf: Path) -> OpenVINOEngine:
    eng = OpenVINOEngine(demo_gguf, model_name="smollm2-135m", context_window=256, max_num_seqs=16)
    asyncio.run(eng.load())
    yield eng
    asyncio.run(eng.unload())


@pytest.fixture
def idle_engine(engine: OpenVINOEngine) -> OpenVINOEngine:
    """The shared engine, guaranteed idle before and after the test."""
    assert not engine.has_work()
    yield engine
    for rid in list(engine._live):
        engine.abort(rid)


@pytest.mark.slow
def test_one_step_is_one_iteration(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    add(eng, "a", STORY, max_tokens=6)
    add(eng, "b", COLORS, max_tokens=6)
    first = step(eng)
    assert first.kind is IterationKind.PREFILL and list(first.request_ids) == ["a", "b"]
    assert len(first.token_ids) == len(first.texts) == 2
    assert eng.pipeline_metrics().scheduled_requests == 2
    for _ in range(5):
        result = step(eng)
        assert result.kind is IterationKind.DECODE
        assert sorted(result.request_ids) == ["a", "b"]  # one token each, exactly
        assert len(result.token_ids) == 2
    assert result.finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert not eng.has_work()


@pytest.mark.slow
def test_prefill_and_decode_never_mixed(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    add(eng, "old", STORY, max_tokens=8)
    assert step(eng).kind is IterationKind.PREFILL
    assert step(eng).kind is IterationKind.DECODE
    add(eng, "new", COLORS, max_tokens=4)
    joined = step(eng)
    assert joined.kind is IterationKind.PREFILL and list(joined.request_ids) == ["new"]
    after = step(eng)
    assert after.kind is IterationKind.DECODE and sorted(after.request_ids) == ["new", "old"]
    drain(eng)


@pytest.mark.slow
def test_streaming_matches_decode_and_reference_pipeline(idle_engine: OpenVINOEngine,
                                                         demo_gguf: Path) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    eng = idle_engine
    ids = add(eng, "s", STORY, max_tokens=16)
    run = drain(eng)
    tokens = run.tokens["s"]
    assert len(tokens) == 16 and run.finished["s"] is FinishReason.LENGTH
    assert run.texts["s"] == eng.decode(tokens)  # the deltas concatenate to the full output
    reference = ov_genai.LLMPipeline(str(demo_gguf), "CPU")
    config = ov_genai.GenerationConfig()
    config.max_new_tokens, config.do_sample = 16, False
    expected = reference.generate(ov.Tensor(np.array([ids], dtype=np.int64)), config)
    assert tokens == list(expected.tokens[0])


@pytest.mark.slow
def test_multibyte_text_streams_whole_characters(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    add(eng, "jp", [{"role": "user", "content": "Translate 'good morning' to Japanese: おはよう"}],
        max_tokens=16)
    run = drain(eng)
    assert run.texts["jp"] == eng.decode(run.tokens["jp"])
    assert "\ufffd" not in run.texts["jp"]


@pytest.mark.slow
def test_chat_template_applied(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    ids = eng.encode_chat(FRANCE)
    header = eng.encode_prompt("<|im_start|>system\n")
    assert ids[:len(header)] == header
    tail = eng.encode_prompt("<|im_start|>assistant\n")
    assert ids[-len(tail):] == tail
    assert len(ids) > len(eng.encode_prompt(FRANCE[0]["content"])) + 10
    eng.add_request(EngineRequest("fr", len(ids), Sampling(max_tokens=16), ids))
    assert "Paris" in drain(eng).texts["fr"]
    with pytest.raises(EngineError, match="role"):
        eng.encode_chat([{"role": "wizard", "content": "hi"}])


@pytest.mark.slow
def test_abort_stops_tokens_and_releases_kv(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    add(eng, "keep", COLORS, max_tokens=16)
    add(eng, "drop", STORY, max_tokens=16)
    step(eng)
    step(eng)
    both = eng.kv_bytes_in_use()
    eng.abort("drop")
    eng.abort("unknown-id")  # ignored
    assert 0 < eng.kv_bytes_in_use() < both
    result = step(eng)
    assert list(result.request_ids) == ["keep"]
    eng.abort("keep")
    assert not eng.has_work() and eng.kv_bytes_in_use() == 0
    # The aborted requests' blocks are free: a new prefill holds only its own blocks.
    ids = add(eng, "next", FRANCE, max_tokens=2)
    step(eng)
    metrics = eng.pipeline_metrics()
    in_use_by_pipeline = metrics.cache_usage / 100 * metrics.cache_size_in_bytes
    own = math.ceil(len(ids) / eng.block_size) * eng.block_size * eng.kv_bytes_per_token
    assert eng.kv_bytes_in_use() == own == pytest.approx(in_use_by_pipeline, rel=1e-6)
    drain(eng)


@pytest.mark.slow
def test_abort_before_prefill(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    add(eng, "early", STORY, max_tokens=4)
    eng.abort("early")
    assert not eng.has_work() and not eng._pipe.has_non_finished_requests()
    add(eng, "later", COLORS, max_tokens=2)
    run = drain(eng)
    assert list(run.tokens) == ["later"] and run.steps[0].kind is IterationKind.PREFILL


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    outputs = []
    for rid in ("s1", "s2"):
        add(eng, rid, STORY, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
        outputs.append(drain(eng).tokens[rid])
    assert outputs[0] == outputs[1]
    with pytest.raises(EngineError, match="temperature"):
        add(eng, "bad", STORY, temperature=-1.0)


@pytest.mark.slow
def test_overlong_prompt_refused_before_the_engine(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    token = eng.encode_prompt("Hello")[0]
    too_long = [token] * eng.context_window
    with pytest.raises(EngineError, match=r"prompt of 256 tokens .* context window of 256"):
        eng.add_request(EngineRequest("long", len(too_long), Sampling(max_tokens=1), too_long))
    assert not eng.has_work() and not eng._pipe.has_non_finished_requests()
    with pytest.raises(EngineError, match="prompt_len"):
        eng.add_request(EngineRequest("mismatch", 3, Sampling(), [token]))
    with pytest.raises(EngineError, match="vocabulary"):
        eng.add_request(EngineRequest("oov", 1, Sampling(), [10**7]))
    # prompt + max_tokens is clamped to the window: 3 tokens of room, finish reason length
    nearly = [token] * (eng.context_window - 3)
    eng.add_request(EngineRequest("clamped", len(nearly), Sampling(max_tokens=16), nearly))
    run = drain(eng)
    assert len(run.tokens["clamped"]) == 3 and run.finished["clamped"] is FinishReason.LENGTH


@pytest.mark.slow
def test_max_tokens_finishes_with_length(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    add(eng, "m", STORY, max_tokens=3)
    run = drain(eng)
    assert len(run.steps) == 3 and len(run.tokens["m"]) == 3
    assert run.finished == {"m": FinishReason.LENGTH}
    assert run.steps[-1].finished == {"m": FinishReason.LENGTH}


@pytest.mark.slow
def test_stop_strings(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    add(eng, "full", FRANCE, max_tokens=8)
    full = drain(eng).texts["full"]
    assert full.startswith("The capital of France is Paris")
    add(eng, "cut", FRANCE, max_tokens=16, stop=(" Paris",))
    run = drain(eng)
    assert run.texts["cut"] == "The capital of France is"
    assert run.finished["cut"] is FinishReason.STOP
    add(eng, "mid", FRANCE, max_tokens=16, stop=("of Fr",))  # ends inside a token
    run = drain(eng)
    assert run.texts["mid"] == "The capital " and run.finished["mid"] is FinishReason.STOP


@pytest.mark.slow
def test_kv_bytes_track_tokens_and_pipeline_metrics(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    assert eng.kv_bytes_per_token == 13680  # 30 layers x 3 KV heads, u8 K/V with f32 scales
    ids = eng.encode_prompt("Once upon a time " * 10)[:30]
    eng.add_request(EngineRequest("kv", 30, Sampling(max_tokens=8), ids))
    seen = []
    for generated in range(1, 8):
        step(eng)
        held = 30 + generated - 1  # the newest token's K/V is computed at the next step
        expected = math.ceil(held / eng.block_size) * eng.block_size * eng.kv_bytes_per_token
        metrics = eng.pipeline_metrics()
        assert eng.kv_bytes_in_use() == expected
        assert metrics.cache_usage / 100 * metrics.cache_size_in_bytes == pytest.approx(expected, rel=1e-6)
        seen.append(eng.kv_bytes_in_use())
    assert seen[0] < seen[-1]  # crossed a 32-token block boundary at 33 tokens
    assert abs(seen[-1] - (30 + 6) * eng.kv_bytes_per_token) < eng.block_size * eng.kv_bytes_per_token
    drain(eng)
    assert eng.kv_bytes_in_use() == 0
    assert eng.kv_bytes_allocated() >= 2 * eng.block_size * eng.kv_bytes_per_token


@pytest.mark.slow
def test_resize_kv_records_bound_and_can_release_by_rebuild(idle_engine: OpenVINOEngine) -> None:
    eng = idle_engine
    add(eng, "grow1", STORY, max_tokens=4)
    add(eng, "grow2", COLORS, max_tokens=4)
    drain(eng)
    asyncio.run(eng.resize_kv(10 * 2**20))
    assert eng.kv_capacity_bytes == 10 * 2**20 and eng.loaded
    allocated = eng.kv_bytes_allocated()
    assert allocated > eng.block_size * eng.kv_bytes_per_token  # grew with those requests
    eng.release_on_shrink = True
    rss_before = _rss_bytes()
    try:
        asyncio.run(eng.resize_kv(eng.block_size * eng.kv_bytes_per_token))
    finally:
        eng.release_on_shrink = False
    assert eng.loaded and eng.kv_bytes_allocated() < allocated  # rebuilt: memory returned
    assert _rss_bytes() < rss_before + 100 * 2**20  # the old pipeline (~300 MB) was freed
    add(eng, "after", FRANCE, max_tokens=2)
    assert len(drain(eng).tokens["after"]) == 2


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
