"""Chat tools without an engine: the request's tools and tool_choice checked (400s naming the
field), rendered into the prompt in the Hermes format, the answer's text parsed into calls,
and streamed as `delta.tool_calls` that the OpenAI SDK's own stream state accumulates."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from mesh.engines.engine_api import Sampling
from mesh.policy.slo import SLO
from mesh.service.errors import ApiError
from mesh.service.registry import ModelRecord
from mesh.service.routes_openai import _Answer
from mesh.service.schema import parse_chat, parse_completion
from mesh.service.streams import Finished, Job, RequestStream, Tokens
from mesh.service.tool_calls import CallFilter, parse_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _chat(**fields: Any):
    return parse_chat({"model": "acme/m", "messages": USER, **fields})


def test_auto_puts_the_tools_in_a_system_message_and_constrains_nothing():
    req = _chat(tools=[WEATHER, TIME])
    assert req.tools.mode == "auto" and req.json_schema is None
    system = req.messages[0]
    assert system["role"] == "system" and req.messages[1:] == USER
    listed = system["content"].split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [WEATHER, TIME]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system["content"]
    own = parse_chat({"model": "acme/m", "tools": [WEATHER],
                      "messages": [{"role": "system", "content": "Be brief."}, *USER]})
    assert own.messages[0]["content"].startswith("Be brief.\n\n# Tools") and len(own.messages) == 2


def test_none_leaves_the_tools_out():
    for req in (_chat(tools=[WEATHER], tool_choice="none"), _chat(tool_choice="auto"), _chat()):
        assert req.tools is None and req.messages == USER and req.json_schema is None


def test_named_and_required_are_constrained_to_the_calls_schema():
    named = _chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tools.mode == "named" and json.loads(named.json_schema) == WEATHER["function"]["parameters"]
    assert json.loads(_chat(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
                      .json_schema) == {"type": "object"}
    required = json.loads(_chat(tools=[WEATHER, TIME], tool_choice="required").json_schema)
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    names = [branch["properties"]["name"]["const"] for branch in required["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    one = json.loads(_chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).json_schema)
    assert one["maxItems"] == 1 and one["items"]["properties"]["parameters"] == WEATHER["function"]["parameters"]


def _with(function: dict) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": [_with({"description": "no name"})]}, "tools[0].function.name", "required"),
    ({"tools": [_with({"name": "a b"})]}, "tools[0].function.name", "letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "already"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function"),
    ({"tools": {"a": 1}}, "tools", "list"),
    ({"tools": [_with({"name": "f", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}}})]},
     "tools[0].function.parameters", "$ref"),
    ({"tools": [_with({"name": "f", "parameters": {"type": "string", "pattern": "a+"}})]},
     "tools[0].function.parameters", "pattern"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "none of 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    ({"tools": [WEATHER], "logprobs": True}, "logprobs", "tools"),
    ({"functions": [WEATHER["function"]]}, "functions", "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls", "arguments"),
])
def test_bad_tools_are_400s_naming_the_field(fields, param, words):
    with pytest.raises(ApiError) as err:
        _chat(**fields)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message, err.value.message


def test_completions_take_no_tools():
    with pytest.raises(ApiError) as err:
        parse_completion({"model": "acme/m", "prompt": "hi", "tools": [WEATHER]})
    assert err.value.param == "tools" and "chat" in err.value.message


def test_history_with_calls_and_tool_results_is_in_the_hermes_format():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    req = parse_chat({"model": "acme/m", "tools": [WEATHER], "messages": [
        *USER, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]})
    assert req.messages[2] == {"role": "assistant", "content":
                               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert req.messages[3] == {"role": "user", "content": "<tool_response>\n21 C, sunny\n</tool_response>"}


# ---- the answer's text -> calls ----------------------------------------------------------------

AUTO = _chat(tools=[WEATHER, TIME]).tools
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_auto_answers_are_parsed_for_hermes_blocks():
    content, calls = parse_calls("Let me look.\n" + CALL + '\n<tool_call>{"name": "get_time", "arguments": {}}',
                                 AUTO)
    assert content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert parse_calls(CALL, AUTO)[0] is None
    for text in ("It is sunny.", "<tool_call>{not json}</tool_call>", CALL.replace("get_weather", "get_news"),
                 '<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>'):
        assert parse_calls(text, AUTO) == (text, []), text


def test_constrained_answers_are_the_calls():
    named = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tools
    content, calls = parse_calls(' {"city": "Oslo"}', named)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert parse_calls('{"city": "Os', named) == ('{"city": "Os', [])  # cut short: text
    required = _chat(tools=[WEATHER, TIME], tool_choice="required").tools
    _, calls = parse_calls('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": '
                           '{"city": "Rome"}}]', required)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Rome"})]


def test_the_filter_streams_text_and_holds_back_what_may_open_a_call():
    text = "Sure, <toolbox> here. " + CALL
    for size in (1, 3, 7, len(text)):
        f = CallFilter(AUTO)
        sent = "".join(f.feed(text[i:i + size]) for i in range(0, len(text), size))
        rest, calls = f.end()
        assert sent + rest == "Sure, <toolbox> here. " and [c.name for c in calls] == ["get_weather"], size
        assert "<tool" not in sent.replace("<toolbox>", "")
    f = CallFilter(AUTO)
    assert f.feed("plain <tool_c") == "plain " and f.end() == ("<tool_c", [])  # no call: the held text goes out


# ---- streamed deltas, accumulated by the OpenAI SDK ----------------------------------------------

def _stream(fields: dict, pieces: list[str], reason: str = "stop") -> list[dict]:
    req = _chat(stream=True, **fields)
    model = ModelRecord("u1", "acme", "acme/m", "emulated", "llama-2-7b", 4096, SLO())
    job = Job("chatcmpl-0123abcd", model, 0.0, Sampling(max_tokens=64))
    answer = _Answer(SimpleNamespace(unix_now=lambda: 1_700_000_000), None, req, model, job,
                     [RequestStream(job.request_id, 3)])
    events: list[Tokens | Finished] = [*(Tokens(p, [i]) for i, p in enumerate(pieces)), Finished(reason, len(pieces))]

    async def send() -> bytes:  # an answer's end is timed on the running loop
        return b"".join(c for e in events for c in answer._sse_chunks(0, e))

    raw = asyncio.run(send())
    frames = [f[len(b"data: "):] for f in raw.split(b"\n\n") if f]
    assert frames[-1] == b"[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def _accumulated(chunks: list[dict]) -> Any:
    stream = pytest.importorskip("openai.lib.streaming.chat")
    from openai.types.chat import ChatCompletionChunk

    state = stream.ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion().choices[0]


def test_streamed_calls_accumulate_in_the_sdk():
    text = "Checking.\n" + CALL
    chunks = _stream({"tools": [WEATHER, TIME]}, [text[i:i + 4] for i in range(0, len(text), 4)])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Checking.\n"
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    choice = _accumulated(chunks)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_named_call_streams_as_one_delta_and_text_streams_as_text():
    chunks = _stream({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                     ['{"city"', ': "Lima"}'])
    choice = _accumulated(chunks)
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Lima"}
    plain = _accumulated(_stream({"tools": [WEATHER]}, ["It is", " sunny. <tool"]))
    assert plain.finish_reason == "stop" and plain.message.content == "It is sunny. <tool" \
        and not plain.message.tool_calls
