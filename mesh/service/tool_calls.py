"""A chat answer's tool calls, read from its text as vLLM's `hermes` tool parser reads them.

- tool_choice "auto": every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block
  (the last may lack its closing tag: the answer ran out) is a call; the text before the
  first block is the content. A block that is not such JSON, or names a function the request
  did not offer, makes the whole answer text (vLLM: the same, less the name check).
- "required": the answer is a JSON array of `{"name", "parameters"}` (structured output).
- a named function: the answer is its arguments (structured output).
An answer cut short (finish_reason "length") may not parse: it is then text.

`CallFilter` is the streamed side: the text a stream may send as content now, holding back
what may begin a `<tool_call>` block, and at the end the calls.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from mesh.service.tools import ToolUse

OPEN = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call as OpenAI answers it: `arguments` is JSON text."""

    id: str
    name: str
    arguments: str

    def message(self) -> dict[str, Any]:
        """Its entry of `message.tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict[str, Any]:
        """Its entry of a streamed `delta.tool_calls`, whole in one chunk."""
        return {"index": index, **self.message()}


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_calls(text: str, use: ToolUse) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of an answer's text: no calls and the whole text as content where it
    holds none, or none that parse (module docstring)."""
    found = _read(text, use)
    if not found:
        return text, []
    calls = [ToolCall(call_id(), name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in found]
    content = text[:text.find(OPEN)] if use.mode == "auto" else ""
    return content or None, calls


def _read(text: str, use: ToolUse) -> list[tuple[str, Any]]:
    """The (name, arguments) the text calls; empty if it holds no call that parses."""
    if use.mode == "named":
        arguments = _json(text)
        return [(use.named, arguments)] if isinstance(arguments, dict) else []
    if use.mode == "required":
        items = _json(text)
        found = [(c.get("name"), c.get("parameters")) for c in items if isinstance(c, dict)] \
            if isinstance(items, list) else []
    else:
        found = []
        for closed, open_ended in _BLOCK.findall(text):
            call = _json(closed or open_ended)
            found.append((call.get("name"), call.get("arguments", {})) if isinstance(call, dict) else (None, None))
    names = use.names()
    if not found or any(name not in names or not isinstance(arguments, dict) for name, arguments in found):
        return []
    return found


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class CallFilter:
    """One streamed choice's text through the tool parser: `feed` gives the content that may
    go out now, `end` what follows it at the end (the rest of the content, the calls)."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.text = ""
        self.sent = 0  # characters of `text` already given out as content

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.use.mode != "auto":
            return ""  # the whole answer is the call(s)
        at = self.text.find(OPEN, max(0, self.sent - len(OPEN)))
        if at < 0:
            at = len(self.text) - _partial_open(self.text)
        out, self.sent = self.text[self.sent:max(at, self.sent)], max(at, self.sent)
        return out

    def end(self) -> tuple[str, list[ToolCall]]:
        """(content not yet given out, the calls)."""
        content, calls = parse_calls(self.text, self.use)
        if not calls:
            return self.text[self.sent:], []
        return (content or "")[self.sent:], calls


def _partial_open(text: str) -> int:
    """The length of the longest end of `text` that begins `<tool_call>` (held back: the tag
    may be arriving)."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
