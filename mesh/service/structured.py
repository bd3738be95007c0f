"""`response_format` -> the JSON schema an engine constrains the answer to, checked first
(`check_schema` also checks chat tools' parameters, mesh.service.tools).

A schema reaches OpenVINO GenAI's grammar compiler (xgrammar) inside the node's `pipe.step()`,
and one it refuses (`{"type": "foo"}`, an unresolved `$ref`) raises there and leaves the
pipeline broken for every request it holds (OpenVINO GenAI 2026.4.1). So the service accepts
only a subset of JSON Schema, each keyword of which the compiler was seen to take, and answers
400 naming `response_format` (and the keyword, with its path) for anything else:

- `type` (one of, or a list of, string, integer, number, boolean, null, object, array);
- objects: `properties`, `required` (names of properties), `additionalProperties` (a boolean
  or a schema);
- arrays: `items` (a schema), `minItems`, `maxItems`;
- strings: `minLength`, `maxLength`; numbers: `minimum`, `maximum`;
- `enum` (a non-empty list of strings, numbers, booleans or null), `const` (one such value),
  `anyOf` (a non-empty list of schemas);
- annotations, ignored: `title`, `description`, `default`, `examples`, `$schema`, and
  `strict` / `name` outside the schema.

`json_object` is the schema `{"type": "object"}`.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from mesh.service.errors import ApiError, bad_request

PARAM = "response_format"
TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
ANNOTATIONS = ("title", "description", "default", "examples", "$schema")
COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
BOUNDS = ("minimum", "maximum")
KEYWORDS = ("type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf",
            *COUNTS, *BOUNDS, *ANNOTATIONS)
# minLength, maxLength, minItems, maxItems: the grammar, and its compile time in the node's step,
# grow with them (maxLength 1000: 19 s)
MAX_COUNT = 128
MAX_SCHEMA_BYTES = 16 * 1024  # as compact JSON; within the wire's bound (mesh.wire.agent_protocol.MAX_SCHEMA_CHARS)


def response_schema(value: Any) -> str | None:
    """The JSON schema (compact JSON text) a request's `response_format` asks its answer to
    follow; None for none or `text`. 400 naming response_format for anything else."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("'response_format' must be an object such as {\"type\": \"json_schema\", \"json_schema\": "
                   "{\"name\": ..., \"schema\": {...}}}.")
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind != "json_schema":
        raise _bad(f"'response_format.type' must be text, json_object or json_schema, got {str(kind)[:40]!r}.")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise _bad("'response_format.json_schema' must be an object with a 'schema' object (and a 'name').")
    schema = spec["schema"]
    check_schema(schema, "schema")
    return schema_text(schema, "'response_format.json_schema.schema'")


def schema_text(schema: Mapping[str, Any], what: str, param: str = PARAM) -> str:
    """A checked schema as the compact JSON text the engine takes; 400 naming `param` past
    MAX_SCHEMA_BYTES."""
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
        raise _bad(f"{what} is larger than {MAX_SCHEMA_BYTES} bytes as JSON; send a smaller schema.", param)
    return text


def _bad(message: str, param: str = PARAM) -> ApiError:
    code = "invalid_response_format" if param == PARAM else "invalid_tools"
    return bad_request(message, param, code)


def check_schema(schema: Any, path: str, param: str = PARAM) -> None:
    """400 naming `param` (and the keyword's path, from `path`) for a schema outside the
    supported subset (module docstring); an explicit stack, no recursion."""
    stack = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            raise _bad(f"'{where}' must be a JSON schema object.", param)
        for key in node:
            if key not in KEYWORDS:
                raise _bad(f"'{where}' uses '{str(key)[:40]}', which this server does not support in a JSON "
                           f"schema; supported keywords: {', '.join(KEYWORDS)}.", param)
        stack += _children(node, where, param)


def _children(node: Mapping[str, Any], where: str, param: str) -> list[tuple[Any, str]]:
    """Check one schema object's own keywords; return its subschemas with their paths."""
    out: list[tuple[Any, str]] = []
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not kinds and "type" in node or any(k not in TYPES for k in kinds):
        raise _bad(f"'{where}.type' must be one of {', '.join(TYPES)} (or a list of them).", param)
    props = node.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise _bad(f"'{where}.properties' must be an object of schemas.", param)
        out += [(sub, f"{where}.properties.{name}") for name, sub in props.items()]
    required = node.get("required")
    if required is not None and (not isinstance(required, list) or not all(
            isinstance(r, str) and r in (props or {}) for r in required)):
        raise _bad(f"'{where}.required' must list names of its 'properties'.", param)
    extra = node.get("additionalProperties")
    if extra is not None and not isinstance(extra, bool):
        out.append((extra, f"{where}.additionalProperties"))
    if "items" in node:
        out.append((node["items"], f"{where}.items"))
    any_of = node.get("anyOf")
    if any_of is not None:
        if not isinstance(any_of, list) or not any_of:
            raise _bad(f"'{where}.anyOf' must be a non-empty list of schemas.", param)
        out += [(sub, f"{where}.anyOf[{i}]") for i, sub in enumerate(any_of)]
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]
                           or not all(_scalar(v) for v in node["enum"])):
        raise _bad(f"'{where}.enum' must be a non-empty list of strings, numbers, booleans or null.", param)
    if "const" in node and not _scalar(node["const"]):
        raise _bad(f"'{where}.const' must be a string, number, boolean or null.", param)
    for key in COUNTS:
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT):
            raise _bad(f"'{where}.{key}' must be an integer from 0 to {MAX_COUNT}.", param)
    for low, high in (("minItems", "maxItems"), ("minLength", "maxLength"), ("minimum", "maximum")):
        if isinstance(node.get(low), (int, float)) and isinstance(node.get(high), (int, float)) and \
                node[low] > node[high]:
            raise _bad(f"'{where}.{low}' is above '{where}.{high}'; no value could follow it.", param)
    for key in BOUNDS:
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _bad(f"'{where}.{key}' must be a number.", param)
    return out


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))
