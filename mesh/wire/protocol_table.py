"""The agent protocol's messages as docs/service.md tables them, written from their
declarations (mesh.wire.agent_protocol): each request with its fields and its reply's, each
event with its fields, and what each does (its docstring). `python -m mesh.wire.protocol_table
docs/service.md` rewrites them there; tests/test_agent_protocol.py checks the docs hold what
this writes."""
from __future__ import annotations

import sys
from pathlib import Path

from mesh.wire import agent_protocol as ap
from mesh.wire.codec import Declared, declared_fields

BEGIN = "<!-- the agent protocol's messages: written by `python -m mesh.wire.protocol_table` -->"
END = "<!-- end of the agent protocol's messages -->"


def field_list(kind: type[Declared]) -> str:
    """A message's fields: `name`, `name`? when it may be left out, a held message's fields
    in braces (a list of them in brackets)."""
    out = []
    for f in declared_fields(kind):
        text = f"`{f.name}`" + ("" if f.required else "?")
        if f.wire.holds is not None:
            inner = "{" + field_list(f.wire.holds) + "}"
            if f.wire.inline:
                out.append(field_list(f.wire.holds))
                continue
            text += f" [{inner}]" if f.many else f" {inner}"
        out.append(text)
    return ", ".join(out)


def what(kind: type) -> str:
    return " ".join((kind.__doc__ or "").split()).replace("|", "/")


def protocol_table() -> str:
    """docs/service.md's tables of the agent protocol's messages, between BEGIN and END."""
    lines = [BEGIN, "", "| control -> agent | fields | reply | what it does |", "|---|---|---|---|"]
    for t, kind in ap.REQUESTS.items():
        reply = field_list(kind.REPLY) or "`{}`"
        lines.append(f"| `{t}` | {field_list(kind)} | {reply} | {what(kind)} |")
    lines += ["", "| agent -> control (events) | fields | what it is |", "|---|---|---|"]
    for t, event in ap.EVENTS.items():
        lines.append(f"| `{t}` | {field_list(event)} | {what(event)} |")
    lines += ["", f"An ok=false reply: {field_list(ap.FailureReply)}. `name`?: may be left out (its default, or null).",
              "", END]
    return "\n".join(lines)


def with_table(doc: str) -> str:
    """`doc` with its text from BEGIN to END replaced by protocol_table()."""
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:start] + protocol_table() + doc[end:]


if __name__ == "__main__":
    path = Path(sys.argv[1])
    path.write_text(with_table(path.read_text()))
