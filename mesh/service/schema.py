"""OpenAI request bodies -> checked dataclasses. Every problem is a 400 naming the field.

Supported: `model`, `messages` (chat; content as a string or a list of text parts) or
`prompt` (completions; a string, a one-element list of strings, token ids, or a
one-element list of token id lists), `max_tokens` (or `max_completion_tokens`),
`temperature` [0, 2], `top_p` (0, 1] (omitted: None here, the model's sampling defaults
later, mesh.modelfiles.sampling), `stop` (a string or up to 4, of at most 256
characters each), `seed`, `n` (1 to MAX_N choices, served as n sibling requests),
`logprobs` (each chosen token's log probability; chat: true/false, with `top_logprobs` 0-20,
the most likely tokens per position; completions: 0-5, that count), `presence_penalty` and
`frequency_penalty` [-2, 2],
vLLM's `repetition_penalty` (0, 10], `response_format` (text, json_object, json_schema of
a checked subset: mesh.service.structured), chat `tools`, `tool_choice` and
`parallel_tool_calls` (mesh.service.tools; history messages with `tool_calls` and role
`tool`), `stream`, `stream_options.include_usage` (a
last chunk with the usage; vLLM's `continuous_usage_stats` is ignored), vLLM's `ignore_eos`
(generate exactly `max_tokens`; benchmarks, guidellm and `mesh replay --live` use it) and
`min_tokens` (only where `ignore_eos` already guarantees it), and `user` (a string, not
used). Fields that would change the output in ways Mesh does not implement (echo,
completions' tools, ...) are refused with a 400 instead of being silently ignored; unknown fields
are ignored, as OpenAI clients send extras.
A body is decoded strictly: NaN and Infinity are not JSON, and no integer may have more than
MAX_INT_DIGITS digits; token ids are checked against the model's vocabulary before anything
goes to a node (mesh.service.cluster_control).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from mesh.engines.chat import ROLES
from mesh.engines.detokenize import MAX_STOP_CHARS
from mesh.engines.engine_api import MAX_TOP_LOGPROBS
from mesh.framing import MAX_INT_DIGITS, LongInteger, bounded_int, not_a_number
from mesh.modelfiles.sampling import MIN_POSITIVE
from mesh.service.errors import ApiError, bad_request
from mesh.service.structured import response_schema
from mesh.service.tools import ToolUse, history_message, tool_use, with_tools

MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5  # completions' `logprobs`: OpenAI's limit on its alternatives
MAX_N = 16  # choices of one request (each one is a request of its own in quotas and placement)
MAX_REPETITION_PENALTY = 10.0
MAX_TOKENS_CAP = 1_000_000
MAX_JSON_DEPTH = 64  # OpenAI bodies nest 4-5 levels; the C decoder recurses ~1000 deep before RecursionError
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; the model's own is checked once it is described


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: str  # "chat" or "completion"
    model: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None  # None: up to the context window
    temperature: float | None = None  # None: the model's default (mesh.modelfiles.sampling)
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    n: int = 1  # choices: n sibling requests
    logprobs: bool = False  # each chosen token's log probability
    top_logprobs: int = 0  # with logprobs: the most likely tokens at each position, this many
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None  # response_format: the schema the answer follows (mesh.service.structured)
    tools: ToolUse | None = None  # chat: the tools the model sees (mesh.service.tools); None: no tools


def parse_json(body: bytes) -> dict[str, Any]:
    """A JSON object from a request body; 400 otherwise (nesting deeper than MAX_JSON_DEPTH
    included: the decoder's recursion must never reach the interpreter's limit, a 500)."""
    if not body:
        raise bad_request("The request body is empty; send a JSON object.", None, "invalid_json")
    try:  # no integer of more than MAX_INT_DIGITS digits (a seed has at most 19), no NaN (mesh.framing)
        data = json.loads(body, parse_int=bounded_int, parse_constant=not_a_number)
    except LongInteger as exc:
        param = _key_before(body, exc.digits)
        where = f" in {param!r}" if param else ""
        raise bad_request(f"The request body holds an integer of {len(exc.digits.lstrip('-'))} digits{where}; no "
                          f"field takes more than {MAX_INT_DIGITS}.", param, "integer_too_long") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}.", None, "invalid_json") from exc
    except ValueError as exc:  # NaN, Infinity, -Infinity: not JSON (RFC 8259), though Python's decoder takes them
        raise bad_request(f"The request body is not valid JSON: {exc}.", None, "invalid_json") from exc
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_json")
    _check_depth(data)
    try:  # JSON may escape lone surrogates (\ud800), which are not text: refuse them here
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request("The request body holds invalid Unicode (a lone surrogate escape).", None,
                          "invalid_json") from exc
    return data


_KEY = re.compile(rb'"([A-Za-z_][A-Za-z0-9_]{0,63})"\s*:')


def _key_before(body: bytes, digits: str) -> str | None:
    """The name of the field nearest before the first occurrence of `digits` in `body` (the
    field that holds it, or the list it is in), for the error message; None if not found."""
    at = body.find(digits.encode())
    keys = list(_KEY.finditer(body, max(0, at - 4096), at)) if at > 0 else []
    return keys[-1].group(1).decode() if keys else None


def _too_deep() -> ApiError:
    return bad_request(f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
                       "no field of this API needs that. Flatten it.", None, "json_too_deep")


def _check_depth(data: Any) -> None:
    """400 past MAX_JSON_DEPTH levels (an explicit stack: no recursion of our own)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def parse_chat(data: Mapping[str, Any]) -> GenerationRequest:
    use = tool_use(data)
    req = _common("chat", data, messages=with_tools(_messages(data.get("messages")), use), tools=use)
    if use is None:
        return req
    if req.logprobs:
        raise bad_request("'logprobs' with 'tools' is not supported (the answer's text becomes tool calls); omit "
                          "one of them.", "logprobs", "unsupported_parameter")
    if not use.constrained:
        return req
    if req.json_schema is not None:
        raise bad_request("'tool_choice' \"required\" or a named function constrains the answer to tool calls; it "
                          "cannot also follow 'response_format'. Omit one of them.", "tool_choice")
    return replace(req, json_schema=use.schema())


def parse_completion(data: Mapping[str, Any]) -> GenerationRequest:
    prompt, ids = _prompt(data.get("prompt"))
    if data.get("tools") or data.get("functions") or data.get("tool_choice") not in (None, "none", "auto"):
        raise bad_request("'tools' is supported on chat completions (POST /v1/chat/completions) only.", "tools",
                          "unsupported_parameter")
    if data.get("echo"):
        raise _unsupported("echo")
    best_of = data.get("best_of")
    if best_of not in (None, 1):
        raise _unsupported("best_of")
    if data.get("suffix"):
        raise _unsupported("suffix")
    return _common("completion", data, prompt=prompt, prompt_token_ids=ids)


def _common(kind: str, d: Mapping[str, Any], **fields: Any) -> GenerationRequest:
    model = d.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: the name of one of your models (GET /v1/models).", "model")
    max_tokens = d.get("max_completion_tokens") if d.get("max_completion_tokens") is not None else d.get("max_tokens")
    param = "max_completion_tokens" if d.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None:
        max_tokens = _int(max_tokens, param, 1, MAX_TOKENS_CAP)
    temperature = _number(d.get("temperature"), "temperature", 0.0, 2.0, None)
    top_p = _number(d.get("top_p"), "top_p", 0.0, 1.0, None)
    if top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0 and at most 1.", "top_p")
    seed = d.get("seed")
    if seed is not None:
        seed = _int(seed, "seed", 0, 2**63 - 1)
    n = 1 if d.get("n") is None else _int(d.get("n"), "n", 1, MAX_N)
    stream = d.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false.", "stream")
    include_usage = False
    options = d.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object.", "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad_request("'stream_options.include_usage' must be true or false.", "stream_options")
    ignore_eos = d.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be true or false.", "ignore_eos")
    if ignore_eos and max_tokens is None:
        raise bad_request("'ignore_eos' needs 'max_tokens': the number of tokens to generate.", "ignore_eos")
    min_tokens = 0 if d.get("min_tokens") is None else _int(d.get("min_tokens"), "min_tokens", 0, MAX_TOKENS_CAP)
    if min_tokens > 0 and not (
            ignore_eos and min_tokens <= max_tokens):
        raise bad_request("'min_tokens' is supported only with 'ignore_eos': true and 'max_tokens' >= min_tokens "
                          "(exactly max_tokens are generated then); send those, or omit min_tokens.", "min_tokens",
                          "unsupported_parameter")
    if d.get("user") is not None and not isinstance(d.get("user"), str):
        raise bad_request("'user' must be a string (an end-user id; it is not used).", "user")
    presence_penalty = _number(d.get("presence_penalty"), "presence_penalty", -2.0, 2.0, 0.0)
    frequency_penalty = _number(d.get("frequency_penalty"), "frequency_penalty", -2.0, 2.0, 0.0)
    repetition_penalty = _number(d.get("repetition_penalty"), "repetition_penalty", 0.0, MAX_REPETITION_PENALTY, 1.0)
    if repetition_penalty == 0.0:
        raise bad_request(f"'repetition_penalty' must be greater than 0 and at most {MAX_REPETITION_PENALTY:g} "
                          "(1 is no penalty).", "repetition_penalty")
    repetition_penalty = max(repetition_penalty, MIN_POSITIVE)  # not 0 in an engine's float32
    logprobs, top_logprobs = _logprobs(kind, d)
    if d.get("logit_bias"):
        raise _unsupported("logit_bias")
    json_schema = response_schema(d.get("response_format"))
    return GenerationRequest(kind, model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             stop=_stop(d.get("stop")), seed=seed, stream=stream, include_usage=include_usage,
                             ignore_eos=ignore_eos, n=n, logprobs=logprobs, top_logprobs=top_logprobs,
                             presence_penalty=presence_penalty,
                             frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                             json_schema=json_schema, **fields)


def _logprobs(kind: str, d: Mapping[str, Any]) -> tuple[bool, int]:
    """Whether each chosen token's log probability is asked for, and how many alternatives
    per token. Chat: `logprobs` true/false with `top_logprobs` 0-20 (which needs logprobs
    true); completions: `logprobs` 0-5, the count of alternatives. Which engines give
    alternatives is the placement's question (mesh.modelfiles.formats.ENGINE_FEATURES)."""
    value, top = d.get("logprobs"), d.get("top_logprobs")
    if kind == "chat":
        if value is not None and not isinstance(value, bool):
            raise bad_request("'logprobs' must be true or false.", "logprobs")
        count = 0 if top is None else _int(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not value:
            raise bad_request("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        return bool(value), count
    if value is None or value is False:
        return False, 0
    return True, _int(value, "logprobs", 0, MAX_COMPLETION_LOGPROBS)


def _unsupported(param: str) -> ApiError:
    return bad_request(f"'{param}' is not supported by this server.", param, "unsupported_parameter")


def _int(value: Any, param: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise bad_request(f"'{param}' must be an integer.", param)
    value = int(value)
    if not low <= value <= high:
        raise bad_request(f"'{param}' must be between {low} and {high}, got {value}.", param)
    return value


def _number(value: Any, param: str, low: float, high: float, default: float | None) -> float | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{param}' must be a number.", param)
    if not low <= value <= high:
        raise bad_request(f"'{param}' must be between {low:g} and {high:g}, got {value}.", param)
    return float(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("'stop' must be a string or a list of strings.", "stop")
    if len(value) > MAX_STOP:
        raise bad_request(f"'stop' takes at most {MAX_STOP} strings.", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise bad_request(f"Each 'stop' string may be at most {MAX_STOP_CHARS} characters long.", "stop")
    return tuple(s for s in value if s)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects.", "messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise bad_request(f"'messages[{i}]' must be an object with 'role' and 'content'.", f"messages[{i}]")
        role = msg.get("role")
        if role not in ROLES:
            raise bad_request(f"'messages[{i}].role' must be one of {', '.join(ROLES)}.", f"messages[{i}].role")
        out.append(history_message(msg, _content(msg.get("content"), f"messages[{i}].content"), f"messages[{i}]"))
    return out


def _content(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{param}' parts must be text parts ({{\"type\": \"text\", \"text\": ...}}); "
                                  "images and audio are not supported.", param)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"'{param}' must be a string or a list of text parts.", param)


def _prompt(value: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise bad_request("'prompt' must not be empty.", "prompt")
        return value, None
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 for t in value):
            raise bad_request("'prompt' token ids must be non-negative.", "prompt", "invalid_token_id")
        if any(t > MAX_TOKEN_ID for t in value):
            raise bad_request(f"'prompt' token ids must be below {MAX_TOKEN_ID + 1} (and the model's vocabulary "
                              "size).", "prompt", "invalid_token_id")
        return None, list(value)
    if isinstance(value, list) and len(value) > 1:
        raise bad_request("Only one prompt per request is supported; send separate requests.", "prompt")
    raise bad_request("'prompt' must be a non-empty string or a list of token ids.", "prompt")
