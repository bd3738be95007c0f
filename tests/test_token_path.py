"""The token path's shortcuts give what the plain path gives: an SSE token chunk from its
template is byte for byte the chunk built whole, and a stream's batches are its events."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from engines.protocol import Sampling
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
    return _Answer(svc, None, req, model, job, RequestStream(job.request_id, 3))


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
