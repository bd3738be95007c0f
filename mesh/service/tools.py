"""Chat `tools` and `tool_choice` -> what the prompt says and what the answer is held to.

As vLLM's OpenAI server with its `hermes` tool parser: the tools reach the model as a system
message in the Hermes format (the one Qwen2.5's and Hermes-2-Pro's templates write: the
functions inside `<tools></tools>`, calls asked for as `<tool_call>{"name": ..., "arguments":
...}</tool_call>`), rendered here for every model so that one parser (mesh.service.tool_calls)
reads every answer. `tool_choice`:

- "none": the tools are left out of the prompt;
- "auto" (the default with tools): the model may answer text or calls;
- "required": the answer is constrained (structured output) to a JSON array of calls
  `[{"name": ..., "parameters": {...}}]`, each one of the tools with its parameters' schema;
- `{"type": "function", "function": {"name": ...}}`: constrained to that function's
  `parameters` schema (the answer is the call's arguments).

History in the Hermes format too: an assistant message's `tool_calls` become `<tool_call>`
blocks of its content, a `tool` message a user turn `<tool_response>...</tool_response>`.
Parameters schemas must lie in the subset of JSON Schema that structured output accepts
(mesh.service.structured), whatever the tool_choice: the same tools constrain a later turn.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from mesh.service.errors import ApiError, bad_request
from mesh.service.structured import check_schema, schema_text

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MODES = ("auto", "required", "named")

SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str | None
    parameters: Mapping[str, Any] | None  # a checked JSON schema; None: no parameters

    def declared(self) -> dict[str, Any]:
        """The tool as the prompt lists it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    def schema(self) -> Mapping[str, Any]:
        """What its arguments must be."""
        return self.parameters if self.parameters is not None else {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A chat request's tools and how it lets the model use them."""

    tools: tuple[Tool, ...]
    mode: str  # one of MODES
    named: str | None = None  # mode "named": the function the answer calls
    parallel: bool = True  # mode "required": more than one call allowed

    @property
    def constrained(self) -> bool:
        """Whether structured output holds the answer to the call(s)."""
        return self.mode != "auto"

    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def schema(self) -> str | None:
        """The JSON schema (compact text) the answer is constrained to; None for auto."""
        if self.mode == "auto":
            return None
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.named)
            return schema_text(tool.schema(), f"'tools' function {tool.name!r}'s parameters", "tools")
        call = [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.schema()},
                 "required": ["name", "parameters"]} for t in self.tools]
        array: dict[str, Any] = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call},
                                 "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return schema_text(array, "The schema of a call to one of 'tools'", "tools")

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t.declared(), ensure_ascii=False)
                                                    for t in self.tools))


def tool_use(d: Mapping[str, Any]) -> ToolUse | None:
    """The request's tools and tool_choice, checked; None where the model sees no tools (none
    sent, or tool_choice "none"). 400 naming the field otherwise."""
    if d.get("functions") is not None or d.get("function_call") is not None:
        param = "functions" if d.get("functions") is not None else "function_call"
        raise bad_request(f"'{param}' (deprecated by OpenAI) is not supported; send 'tools' and 'tool_choice'.",
                          param, "unsupported_parameter")
    raw, choice = d.get("tools"), d.get("tool_choice")
    tools = _tools(raw) if raw is not None else ()
    parallel = d.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true or false.", "parallel_tool_calls")
    if choice == "none" or (choice in (None, "auto") and not tools):
        return None
    if choice in (None, "auto"):
        return ToolUse(tools, "auto", parallel=parallel is not False)
    if not tools:
        raise bad_request("'tool_choice' other than none/auto needs 'tools': the functions the model may call.",
                          "tool_choice")
    if choice == "required":
        return ToolUse(tools, "required", parallel=parallel is not False)
    name = _named(choice)
    if name not in {t.name for t in tools}:
        raise bad_request(f"'tool_choice' names function {name[:64]!r}, which is none of 'tools' "
                          f"({', '.join(t.name for t in tools)}); name one of them.", "tool_choice")
    return ToolUse(tools, "named", named=name, parallel=parallel is not False)


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}.", "tool_choice")
    return function["name"]


def _tools(raw: Any) -> tuple[Tool, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} {{\"type\": \"function\", \"function\": "
                          "{\"name\", \"description\", \"parameters\"}} objects.", "tools")
    out: list[Tool] = []
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(function, dict):
            raise _bad(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}.", where)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _bad(f"'{where}.function.name' is required: 1 to 64 letters, digits, '_' or '-'.",
                       f"{where}.function.name")
        if name in {t.name for t in out}:
            raise _bad(f"'{where}.function.name' {name!r} is already the name of an earlier tool; give each "
                       "tool its own name.", f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"'{where}.function.description' must be a string.", f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is not None:
            check_schema(parameters, f"{where}.function.parameters", f"{where}.function.parameters")
        out.append(Tool(name, description, parameters))
    return tuple(out)


def _bad(message: str, param: str) -> ApiError:
    return bad_request(message, param, "invalid_tools")


def history_message(msg: Mapping[str, Any], content: str, where: str) -> dict[str, str]:
    """One checked chat message ({role, content}, content already joined) in the Hermes
    format: an assistant's `tool_calls` appended to its content as `<tool_call>` blocks, a
    `tool` message as a user turn holding `<tool_response>`."""
    role = msg["role"]
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = msg.get("tool_calls")
    if calls is None or role != "assistant":
        return {"role": role, "content": content}
    if not isinstance(calls, list):
        raise bad_request(f"'{where}.tool_calls' must be a list of calls.", f"{where}.tool_calls")
    blocks = [content] if content else []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", "{}"), str):
            raise bad_request(f"'{where}.tool_calls[{j}]' must be {{\"id\", \"type\": \"function\", \"function\": "
                              "{\"name\": ..., \"arguments\": \"<JSON text>\"}}.", f"{where}.tool_calls")
        arguments = function.get("arguments", "{}")
        try:
            parsed: Any = json.loads(arguments)
        except ValueError:
            parsed = arguments  # as the client sent it: the model reads what it was shown
        blocks.append("<tool_call>\n" + json.dumps({"name": function["name"], "arguments": parsed},
                                                   ensure_ascii=False) + "\n</tool_call>")
    return {"role": role, "content": "\n".join(blocks)}


def with_tools(messages: list[dict[str, str]], use: ToolUse | None) -> list[dict[str, str]]:
    """The messages the model sees: the tools' system prompt after the request's own system
    message (or as the first message)."""
    if use is None:
        return messages
    prompt = use.system_prompt()
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{"role": "system", "content": f"{first}\n\n{prompt}" if first else prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
