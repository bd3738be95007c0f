"""The token path's shortcuts give what the plain path gives: an SSE token chunk from its
template is byte for byte the chunk built whole, and a stream's batches are its events."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from mesh.engines.engine_api import Sampling
from mesh.policy.slo import SLO
from mesh.service.errors import ApiError
from mesh.service.registry import ModelRecord
from mesh.service.routes_openai import _Answer
from mesh.service.schema import parse_chat, parse_completion
from mesh.service.streams import Finished, Job, RequestStream, Tokens

TEXTS = [" hello", "", "é\"\\\n\t東京🙂", "\x00\x1f</script>", "\ue000mesh-text\ue000"]


def _answer(kind: str, include_usage: bool) -> _Answer:
    body = {"model": "acme/m", "stream": True, "stream_options": {"include_usage": include_usage}}
    req = (parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]}) if kind == "chat"
           else parse_completion({**body, "prompt": "hi"}))
    model = ModelRecord("u1", "acme", "acme/m", "emulated", "llama-2-7b", 4096, SLO())
    job = Job("chatcmpl-0123abcd", model, 0.0, Sampling(max_tokens=8))
    svc = SimpleNamespace(unix_now=lambda: 1_700_000_000)
    return _Answer(svc, None, req, model, job, [RequestStream(job.request_id, 3)])


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_token_chunk_from_its_template_is_the_chunk_built_whole(kind, include_usage):
    answer = _answer(kind, include_usage)
    for text in TEXTS:
        assert answer._text_chunk(text) == answer._chunk(text, None, False), text
        json.loads(answer._text_chunk(text)[len(b"data: "):])


def test_batches_are_the_events_as_they_wait():
    async def main() -> None:
        stream = RequestStream("r", 3)
        for i in range(3):
            stream.push(Tokens(f" t{i}", [i]))
        got = []
        async for batch in stream.batches():
            got.append(batch)
            if len(got) == 1:  # what arrives later comes in a batch of its own
                stream.push(Tokens(" t3", [3]))
                stream.push(Finished("length", 4))
        assert [len(b) for b in got] == [3, 2] and isinstance(got[-1][-1], Finished)

        failing = RequestStream("r2", 3)
        failing.push(Tokens(" a", [1]))
        failing.push(ApiError(503, "node gone", "server_error"))
        seen = []
        with pytest.raises(ApiError):
            async for batch in failing.batches():
                seen.extend(batch)
        assert [e.text for e in seen] == [" a"]  # the tokens before the error went out first

    asyncio.run(main())


# ---- frames: orjson where it is installed, the same JSON either way ------------------------------

MESSAGES = [
    {"t": "tokens", "items": [["cmpl-0a1b", [300, 301], " héllo 東京 🙂"], ["cmpl-2", [], ""]]},
    {"t": "done", "request_id": "r", "outcome": "completed", "reason": None, "ttft_s": 0.125, "tpot_s": 1e-7,
     "tokens_out": 2**40, "detail": "null \"quoted\" \\ \n"},
    {"t": "stats", "nested": {"a": [1, 2.5, True, False, None], "b": {}}, "tuple": (1, 2)},
]


@pytest.mark.parametrize("message", MESSAGES)
def test_frames_are_the_json_the_standard_codec_reads_back(message):
    from mesh.framing import decode_header, encode_frame

    frame = encode_frame(message)
    body = frame[4:]
    assert int.from_bytes(frame[:4], "big") == len(body)
    expected = json.loads(json.dumps(message))
    assert json.loads(body) == expected and decode_header(body, "t") == expected


def test_what_orjson_does_not_take_goes_the_standard_way():
    from mesh.framing import ProtocolError, decode_header, encode_frame

    with pytest.raises(ValueError):  # NaN and infinities are refused, as the standard codec refuses them
        encode_frame({"t": "x", "v": [1.0, float("nan")]})
    with pytest.raises(ValueError):
        encode_frame({"t": "x", "v": {"w": float("-inf")}})
    assert json.loads(encode_frame({"t": "x", "v": 2**70})[4:])["v"] == 2**70  # past 64 bits
    assert json.loads(encode_frame({"t": "x", 1: 2})[4:]) == {"t": "x", "1": 2}  # a key that is not a string
    for bad in (b"\xff\xfe", b"[1, 2]", b'{"t": 1}', b"{nope"):
        with pytest.raises(ProtocolError):
            decode_header(bad, "t")
