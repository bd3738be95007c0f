"""The OpenAI fields beyond plain sampling on the vLLM node: log probabilities with their
alternatives (`top_logprobs`, which only vLLM gives), the penalties and structured output.

Fast tests: the alternatives' way through the agent protocol and into OpenAI's answer shapes
(checked with the OpenAI SDK's own types). Slow tests: vLLM's CPU build on the demo model as a
Hugging Face folder (tests/conftest.py's demo_hf; MESH_DEMO_HF names one converted before),
one engine for the module, skipped like tests/test_vllm_engine.py's where vLLM is missing.
Routing (alternatives only to vLLM nodes, a 400 naming the field elsewhere) is
tests/test_engine_features.py's.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mesh.engines.engine_api import EngineRequest, FinishReason, Sampling, StepResult, TokenLogprob
from mesh.policy.slo import SLO
from mesh.service.registry import ModelRecord
from mesh.service.routes_openai import _Answer, _entries
from mesh.service.schema import parse_chat, parse_completion
from mesh.service.streams import Job, RequestStream, Tokens
from mesh.wire import agent_protocol as ap
from test_vllm_engine import _vllm_python, needs_vllm

# ---- fast: the wire and the answer's shape -----------------------------------------------------

TOP = (TokenLogprob(-0.25, ((" Paris", -0.25), (" Lyon", -2.5), ("\ufffd", -7.0))),
       TokenLogprob(-1.5, ((".", -0.5), ("!", -1.5), (",", -3.0))))


def test_alternatives_cross_the_agent_protocol():
    """A tokens item carries each token's log probability and its alternatives (a fifth
    element), reads back as the same TokenLogprobs, and a malformed one is refused."""
    item = ap.tokens_item("r1", [5, 6], " Paris.", TOP)
    assert len(item) == 5
    event = ap.event_from_message(json.loads(json.dumps(ap.TokensEvent([item]).to_message())))
    assert ap.item_logprobs(event.items[0]) == list(TOP)
    plain = ap.tokens_item("r2", [7], "x", [TokenLogprob(float("-inf"))])  # no alternatives: four elements
    assert plain == ("r2", [7], "x", [ap.MIN_LOGPROB]) and ap.item_logprobs(plain) == [TokenLogprob(ap.MIN_LOGPROB)]
    assert ap.tokens_item("r3", [8], "y", None) == ("r3", [8], "y")
    for bad in ([[["a", -1.0]]], [[["a", 0.5]], []], [[["a"]], []], [[["a", -1.0]] * 21, []]):
        with pytest.raises(ap.ProtocolError):
            ap.event_from_message({"t": "tokens", "items": [["r", [1, 2], "ab", [-1.0, -2.0], bad]]})
    sampling = Sampling(max_tokens=3, logprobs=True, top_logprobs=4)
    assert ap.sampling_from_dict(json.loads(json.dumps(ap.sampling_to_dict(sampling)))) == sampling
    with pytest.raises(ap.ProtocolError):
        ap.sampling_from_dict({"max_tokens": 3, "top_logprobs": 21})


def _answer(body: dict) -> _Answer:
    req = parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]}) if "prompt" not in body else \
        parse_completion(body)
    model = ModelRecord("u1", "acme", "acme/m", "hf", "llama-2-7b", 4096, SLO())
    job = Job("cmpl-0123abcd", model, 0.0, Sampling(max_tokens=8))
    return _Answer(SimpleNamespace(unix_now=lambda: 1_700_000_000), None, req, model, job,
                   [RequestStream(job.request_id, 3)])


def test_alternatives_in_openai_shapes():
    """Chat: each content entry's top_logprobs; completions: one {token: logprob} per token
    (null when none were asked for); both as the OpenAI SDK's types read them."""
    from openai.types.chat.chat_completion import ChoiceLogprobs
    from openai.types.completion_choice import Logprobs

    entries = _entries(Tokens(" Paris.", [5, 6], list(TOP)))
    chat = _answer({"model": "acme/m", "logprobs": True, "top_logprobs": 3})._logprobs(0, entries)
    parsed = ChoiceLogprobs.model_validate(chat)
    assert [e.token for e in parsed.content] == [" Paris.", ""]
    assert [(a.token, a.logprob) for a in parsed.content[0].top_logprobs] == list(TOP[0].top)
    assert parsed.content[0].top_logprobs[0].bytes == list(b" Paris")
    completion = _answer({"model": "acme/m", "prompt": "hi", "logprobs": 3})._logprobs(0, entries)
    read = Logprobs.model_validate(completion)
    assert read.top_logprobs == [dict(TOP[0].top), dict(TOP[1].top)]
    assert read.token_logprobs == [-0.25, -1.5] and read.text_offset == [0, 7]
    chosen_only = [(t, TokenLogprob(lp.logprob)) for t, lp in entries]
    assert _answer({"model": "acme/m", "prompt": "hi", "logprobs": 0})._logprobs(0, chosen_only)["top_logprobs"] is None
    assert _answer({"model": "acme/m", "logprobs": True})._logprobs(0, chosen_only)["content"][0]["top_logprobs"] == []


# ---- slow: vLLM's CPU build on the demo model ------------------------------------------------

WINDOW = 512
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(demo_hf: Path):
    from mesh.engines.vllm_engine import VLLMEngine

    _vllm_python()
    e = VLLMEngine(demo_hf, model_name="smol-hf", context_window=WINDOW, max_num_seqs=4,
                   kv_capacity_bytes=64 * 2**20)
    asyncio.run(e.load())
    yield e
    asyncio.run(e.unload())


def run(e, rid: str, ids: list[int], resize: dict[int, int] | None = None, resumed: int = 0,
        **sampling) -> tuple[list[int], str, list[TokenLogprob | None], FinishReason | None]:
    """One request alone, stepped to its end: its tokens, text, log probabilities and finish
    reason; `resize` maps a step number to a KV size to resize to before that step."""
    tokens: list[int] = []
    text, logprobs, reason = "", [], None

    async def go() -> None:
        nonlocal text, reason
        e.add_request(EngineRequest(rid, len(ids), Sampling(**sampling), ids, resumed=resumed))
        k = 0
        while e.has_work():
            if resize and k in resize:
                await e.resize_kv(resize[k])
            r: StepResult = await e.step()
            k += 1
            for i, (tok, delta) in enumerate(zip(r.token_ids, r.texts)):
                tokens.append(tok)
                text += delta
                logprobs.append(r.logprobs[i] if r.logprobs is not None else None)
            reason = r.finished.get(rid, reason)

    asyncio.run(go())
    return tokens, text, logprobs, reason


def chat(e, content: str) -> list[int]:
    return e.encode_chat([{"role": "user", "content": content}])


@needs_vllm
@pytest.mark.slow
def test_logprobs_with_alternatives_greedy(engine):
    """Greedy: the chosen token's log probability is the first alternative's (the same
    token, decoded alone), alternatives are sorted, at most 0, as many as asked; without
    alternatives the chosen ones are the same numbers; without logprobs there are none."""
    e = engine
    ids = chat(e, "What is the capital of France?")
    tokens, text, lps, _ = run(e, "top", ids, max_tokens=8, logprobs=True, top_logprobs=5)
    assert len(lps) == len(tokens) == 8 and all(lp is not None for lp in lps)
    for token, lp in zip(tokens, lps):
        values = [v for _, v in lp.top]
        assert len(lp.top) == 5 and values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-5) and lp.logprob <= 0
        if e.decode([token]):  # not a special token
            assert lp.top[0][0] == e.decode([token])
    assert max(lp.logprob for lp in lps) - min(lp.logprob for lp in lps) > 0.01  # not a constant
    again, _, chosen, _ = run(e, "chosen", ids, max_tokens=8, logprobs=True)
    assert again == tokens and all(lp.top == () for lp in chosen)
    assert [lp.logprob for lp in chosen] == pytest.approx([lp.logprob for lp in lps], abs=1e-4)
    assert run(e, "plain", ids, max_tokens=8)[2] == [None] * 8


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.8}, {"presence_penalty": 2.0},
                                     {"frequency_penalty": 2.0}])
def test_penalties_change_the_output_deterministically(engine, penalty):
    e = engine
    ids = e.encode_prompt("apple apple apple apple apple apple apple apple apple apple")
    plain = run(e, "plain", ids, max_tokens=16, ignore_eos=True)[0]
    assert len(set(plain)) < len(plain)  # the model repeats itself: a penalty has something to change
    first = run(e, "p1", ids, max_tokens=16, ignore_eos=True, **penalty)[0]
    assert first != plain
    assert run(e, "p2", ids, max_tokens=16, ignore_eos=True, **penalty)[0] == first


@needs_vllm
@pytest.mark.slow
def test_json_schema_answers_parse_and_validate(engine):
    """Greedy and sampled answers under a JSON schema parse and validate; json_object's
    schema gives an object (one that ends parses); a structured request re-run by a KV resize, or resumed with half
    its answer, goes on to an answer that validates (its output was fed to its grammar,
    which would otherwise start the answer again inside it)."""
    import jsonschema

    e = engine
    ids = chat(e, "Describe a person as JSON with a name and an age.")
    schema = json.dumps(PERSON)
    greedy_tokens, greedy, _, reason = run(e, "g", ids, max_tokens=64, json_schema=schema)
    assert reason is FinishReason.STOP
    jsonschema.validate(json.loads(greedy), PERSON)
    for seed in (1, 2, 3):
        tokens, text, _, reason = run(e, f"s{seed}", ids, max_tokens=64, temperature=1.0, seed=seed,
                                      json_schema=schema)
        assert reason is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), PERSON)
    _, text, _, reason = run(e, "o", chat(e, "Give me a JSON object."), max_tokens=64, json_schema='{"type": "object"}')
    assert text.lstrip().startswith("{")  # an object, cut at max_tokens or whole:
    if reason is FinishReason.STOP:
        assert isinstance(json.loads(text), dict)
    block = e.block_size * e.kv_bytes_per_token
    before = e.num_blocks
    resized, text, _, reason = run(e, "r", ids, resize={3: (before + 4) * block}, max_tokens=64, json_schema=schema)
    assert e.last_resize["reran"] == 1 and reason is FinishReason.STOP, text
    jsonschema.validate(json.loads(text), PERSON)
    asyncio.run(e.resize_kv(before * block))
    half = len(greedy_tokens) // 2
    rest, _, _, reason = run(e, "h", ids + greedy_tokens[:half], resumed=half, max_tokens=64 - half,
                             json_schema=schema)
    whole = e.decode(greedy_tokens[:half] + rest)
    assert reason is FinishReason.STOP, whole
    jsonschema.validate(json.loads(whole), PERSON)


@needs_vllm
@pytest.mark.slow
def test_alternatives_through_the_service_and_the_sdk(tmp_path):
    """`mesh serve --vllm-cpu` with a Hugging Face folder (a tiny random Llama, served on the
    vLLM node) and the demo GGUF (CPU node only: --no-prepare): the OpenAI SDK gets real
    alternatives from the vLLM node, chat and completions, whole and streamed; the GGUF model,
    which no vLLM node can run, answers 400 naming the field."""
    openai = pytest.importorskip("openai")
    from mesh.modelfiles.local import write_tiny_llama
    from test_service_e2e import Server

    _vllm_python()
    allowed = tmp_path / "allowed"
    write_tiny_llama(allowed / "demo" / "tiny")
    server = Server(tmp_path / "data", allowed, tmp_path / "server.log", extra=("--vllm-cpu", "--no-prepare"))
    server.start()
    try:
        status, body = server.http("POST", "/v1/models", {"name": "tiny", "path": "tiny"}, token=server.key)
        assert status == 201, body
        c = server.client()
        messages = [{"role": "user", "content": "hello"}]
        six = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
        whole = c.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=3, **six)
        content = whole.choices[0].logprobs.content
        assert len(content) == whole.usage.completion_tokens == 6
        for entry in content:
            values = [a.logprob for a in entry.top_logprobs]
            assert len(values) == 3 and values == sorted(values, reverse=True) and values[0] <= 0
            assert values[0] == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the chosen token is the first
        chunks = list(c.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=3,
                                                stream=True, **six))
        streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
        assert [[a.token for a in e.top_logprobs] for e in streamed] == [[a.token for a in e.top_logprobs]
                                                                           for e in content]
        comp = c.completions.create(model="tiny", prompt="hello world", max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
        lp = comp.choices[0].logprobs
        assert len(lp.top_logprobs) == 4 and all(1 <= len(top) <= 2 for top in lp.top_logprobs)
        # greedy: no alternative is more likely than the chosen token (two may share a text: one {text: logprob})
        assert all(max(top.values()) <= chosen + 1e-5 for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="demo/smollm2", messages=messages, max_tokens=2, logprobs=True,
                                      top_logprobs=2)
        assert err.value.body["param"] == "top_logprobs"
    finally:
        assert server.stop() == 0
