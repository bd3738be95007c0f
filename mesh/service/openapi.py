"""`GET /openapi.json`: the service's API as OpenAPI 3.1, built from the app's own route table.

Paths and methods come from the aiohttp router (`build_spec(app)`), so a route cannot be
served without appearing here; what each operation takes (summary, auth, path/query
parameters, JSON body) comes from OPERATIONS, whose bodies are written from the parsers'
own limits (mesh.service.schema, registry name patterns, quota fields, SLO and sampling
bounds). A route missing from OPERATIONS is still listed, marked undocumented, and the
tests refuse that. HEAD, which aiohttp adds to every GET, is left implicit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mesh.engines.chat import ROLES
from mesh.modelfiles.sampling import FIELDS as SAMPLING_FIELDS
from mesh.policy.dispatch_rules import ADMISSIONS, COLD_START_CHOICES
from mesh.policy.quota import QUOTA_FIELDS
from mesh.service.registry import MODEL_NAME, TENANT_NAME
from mesh.service.schema import (
    MAX_COMPLETION_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TOKENS_CAP,
    MAX_TOP_LOGPROBS,
)
from mesh.service.tools import MAX_TOOLS, TOOL_NAME

TENANT, ADMIN, METRICS = "tenantKey", "adminToken", "metricsToken"

_SAMPLING = {"temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
             "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1}}
_COMMON_GENERATION: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "description": "one of your models (GET /v1/models)"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_TOKENS_CAP,
                   "description": "omitted: up to the context window"},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_TOKENS_CAP},
    **_SAMPLING,
    "stop": {"oneOf": [{"type": "string", "maxLength": MAX_STOP_CHARS},
                       {"type": "array", "items": {"type": "string", "maxLength": MAX_STOP_CHARS},
                        "maxItems": MAX_STOP},
                       {"type": "null"}]},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N,
          "description": "choices, each served as a request of its own (counted n times in quotas)"},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY},
    "response_format": {"type": ["object", "null"], "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {
            "name": {"type": "string"}, "strict": {"type": ["boolean", "null"]},
            "schema": {"type": "object", "description": "a subset of JSON Schema (docs/service.md)"}}}}},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": ["string", "null"], "description": "an end-user id (not used)"},
}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_FUNCTION_NAME = {"type": "string", "pattern": TOOL_NAME.pattern}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _FUNCTION_NAME, "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a subset of JSON Schema (docs/service.md)"}}}}}
_NAMED_CHOICE = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {"name": _FUNCTION_NAME}}}}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text"}}}}}
CHAT_BODY: dict[str, Any] = {
    "type": "object", "required": ["model", "messages"],
    "properties": {
        **_COMMON_GENERATION,
        "logprobs": {"type": ["boolean", "null"], "description": "each chosen token's log probability"},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                         "description": "with logprobs: the most likely tokens at each position, this many (above "
                                        "0: vLLM nodes only)"},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"enum": list(ROLES)},
                           "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART},
                                                 {"type": "null"}]},
                           "tool_calls": {"type": "array", "items": _TOOL_CALL,
                                          "description": "an assistant message's calls"},
                           "tool_call_id": {"type": "string", "description": "a tool message's call"}}}},
        "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS, "items": _TOOL},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, _NAMED_CHOICE, {"type": "null"}]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
    },
}
COMPLETION_BODY: dict[str, Any] = {
    "type": "object", "required": ["model", "prompt"],
    "properties": {
        **_COMMON_GENERATION,
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS,
                     "description": "each chosen token's log probability and the most likely tokens at each "
                                    "position, this many (above 0: vLLM nodes only)"},
        "prompt": {"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
        ]},
    },
}
_COLD_START = {"type": "string", "enum": list(COLD_START_CHOICES),
               "description": "a request its cold model cannot serve within its TTFT: served late (default) or "
                              "turned away at once"}
REGISTER_BODY: dict[str, Any] = {
    "type": "object", "required": ["name", "path"],
    "properties": {
        "name": {"type": "string", "pattern": MODEL_NAME.pattern},
        "path": {"type": "string", "minLength": 1, "description": "a GGUF file or OpenVINO folder under --allowed-dir "
                 "(with `base`: a LoRA adapter's PEFT folder)"},
        "base": {"type": "string", "description": "registers a LoRA adapter on this registered model (an OpenVINO "
                 "IR base) instead of a model"},
        "base_tenant": {"type": "string", "description": "the base's tenant (default: the caller; another "
                        "tenant's only on the operator's route)"},
        "context_length": {"type": ["integer", "null"], "minimum": 16},
        "slo": {"type": ["object", "null"], "additionalProperties": False, "properties": {
            "ttft_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
            "ttft_s_per_prompt_token": {"type": "number", "minimum": 0, "maximum": 10},
            "tpot_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 60}}},
        "sampling_defaults": {"type": ["object", "null"], "additionalProperties": False,
                              "properties": {k: _SAMPLING[k] for k in SAMPLING_FIELDS}},
        "cold_start": _COLD_START,
        "admission": {"enum": [*ADMISSIONS, None], "description": "a request that can no longer meet its SLO: "
                      "turned away (reject), queued up to the queue's bound (queue) or served late (late); "
                      "null: the service's --admission"},
    },
}
TENANT_BODY = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string",
                                                                                "pattern": TENANT_NAME.pattern}}}
KEY_BODY = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 200}}}
SCALE_BODY = {"type": "object", "required": ["tenant", "model", "nodes"],
              "properties": {"tenant": {"type": "string"}, "model": {"type": "string"},
                             "nodes": {"type": "array", "minItems": 1, "items": {"type": "string"}}}}
EMULATED_BODY = {"type": "object", "required": ["name", "emulate"],
                 "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 128},
                                "emulate": {"type": "string", "description": "a catalog model, e.g. llama-2-7b"},
                                "context_length": {"type": "integer", "minimum": 1}}}
ADMIN_MODEL_BODY = {"anyOf": [
    EMULATED_BODY,
    {**REGISTER_BODY, "properties": {**REGISTER_BODY["properties"], "path": {
        "type": "string", "minLength": 1, "description": "a GGUF file or model folder anywhere under --allowed-dir "
                                                        "(relative to it)"}}}]}
QUOTA_BODY = {"type": "object", "additionalProperties": False,
              "properties": {name: {"type": ["number", "null"], "minimum": 0} for name in QUOTA_FIELDS}}


@dataclass(frozen=True)
class Operation:
    summary: str
    auth: str | None = TENANT
    body: dict[str, Any] | None = None
    body_required: bool = True
    ok: int = 200
    server_errors: dict[int, str] | None = None  # 5xx answers that are the request's own outcome


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("GET", "/healthz"): Operation("liveness and node readiness", auth=None),
    ("GET", "/health"): Operation("the same as /healthz, under the name vLLM, SGLang and TGI use", auth=None),
    ("GET", "/openapi.json"): Operation("this description", auth=None),
    ("GET", "/metrics"): Operation("Prometheus metrics (metrics or admin token)", auth=METRICS),
    ("POST", "/v1/chat/completions"): Operation("OpenAI chat completion, streamed with stream=true", body=CHAT_BODY),
    ("POST", "/v1/completions"): Operation("OpenAI text completion, streamed with stream=true", body=COMPLETION_BODY),
    ("GET", "/v1/usage"): Operation("the caller's requests, tokens and SLO attainment per model, and its quotas"),
    ("GET", "/v1/models"): Operation("the caller's models"),
    ("POST", "/v1/models"): Operation("register a model from a path in the caller's folder <--allowed-dir>/<tenant>/ "
                                      "(JSON; absent or not the caller's: the same 404), or upload a GGUF "
                                      "(application/octet-stream, settings in the query; no Content-Encoding: 415; "
                                      "capped by what is left of the quota model_bytes: 413; max_uploads_per_tenant, "
                                      "or max_uploads of all tenants, at once: 429)",
                                      body=REGISTER_BODY, ok=201,
                                      server_errors={507: "the server's disk is full: the partial upload was removed"}),
    ("GET", "/v1/models/{name}"): Operation("one of the caller's models"),
    ("DELETE", "/v1/models/{name}"): Operation("delete one of the caller's models"),
    ("POST", "/admin/tenants"): Operation("create a tenant", auth=ADMIN, body=TENANT_BODY, ok=201),
    ("GET", "/admin/tenants"): Operation("list tenants", auth=ADMIN),
    ("DELETE", "/admin/tenants/{tenant}"): Operation("delete a tenant and its models", auth=ADMIN),
    ("POST", "/admin/tenants/{tenant}/keys"): Operation("issue an API key", auth=ADMIN, body=KEY_BODY,
                                                        body_required=False, ok=201),
    ("GET", "/admin/tenants/{tenant}/keys"): Operation("list a tenant's keys", auth=ADMIN),
    ("DELETE", "/admin/keys/{key_id}"): Operation("revoke a key", auth=ADMIN),
    ("GET", "/admin/models"): Operation("every tenant's models", auth=ADMIN),
    ("GET", "/admin/cluster"): Operation("nodes, instances, weights copies, the control plane's own cost "
                                         "(event-loop lag, decision times, frames from the agents)", auth=ADMIN),
    ("GET", "/admin/learnt"): Operation("what the nodes learnt: speed probes, time factors, margins, cold starts, "
                                        "profiles (for the live replay's twin)", auth=ADMIN),
    ("POST", "/admin/scale"): Operation("start a model on chosen nodes now", auth=ADMIN, body=SCALE_BODY),
    ("POST", "/admin/tenants/{tenant}/models"): Operation("register a model for a tenant: a path anywhere under "
                                                          "--allowed-dir, or an emulated model (mesh serve --emulate)",
                                                          auth=ADMIN, body=ADMIN_MODEL_BODY, ok=201),
    ("GET", "/admin/tenants/{tenant}/quota"): Operation("a tenant's quotas and use", auth=ADMIN),
    ("PUT", "/admin/tenants/{tenant}/quota"): Operation("set a tenant's quotas (null: no limit)", auth=ADMIN,
                                                        body=QUOTA_BODY),
    ("GET", "/admin/tenants/{tenant}/admission"): Operation("a tenant's default admission choice", auth=ADMIN),
    ("PUT", "/admin/tenants/{tenant}/admission"): Operation(
        "set a tenant's default admission choice for its models without their own (null: the service's)",
        auth=ADMIN, body={"type": "object", "required": ["admission"],
                          "properties": {"admission": {"enum": [*ADMISSIONS, None]}}}),
}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                     "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, HEAD left out, paths as OpenAPI writes them."""
    out = []
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        out.append((route.method, route.resource.canonical))
    return out


def _operation(method: str, path: str, op: Operation | None) -> dict[str, Any]:
    op = op or Operation("undocumented")
    out: dict[str, Any] = {
        "operationId": f"{method.lower()}{path.replace('/', '_').replace('{', '').replace('}', '').replace('.', '_')}",
        "summary": op.summary,
        "responses": {str(op.ok): {"description": "success"},
                      "4XX": {"description": "a clear error naming the problem",
                              "content": {"application/json": {"schema": ERROR}}}},
    }
    for status, why in (op.server_errors or {}).items():
        out["responses"][str(status)] = {"description": why, "content": {"application/json": {"schema": ERROR}}}
    params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
              for n in _path_names(path)]
    if params:
        out["parameters"] = params
    if op.auth:
        out["security"] = [{op.auth: []}]
    if op.body is not None:
        out["requestBody"] = {"required": op.body_required, "content": {"application/json": {"schema": op.body}}}
    return out


def _path_names(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]


def build_spec(app: web.Application, version: str = "") -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes(app):
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, OPERATIONS.get((method, path)))
    return {
        "openapi": "3.1.0",
        "info": {"title": "Mesh", "version": version or "0",
                 "description": "Serverless LLM inference: OpenAI-compatible generation, tenants' models, "
                                "admin routes (docs/service.md)."},
        "paths": paths,
        "components": {"securitySchemes": {
            TENANT: {"type": "http", "scheme": "bearer", "description": "a tenant's API key"},
            ADMIN: {"type": "http", "scheme": "bearer", "description": "MESH_ADMIN_TOKEN"},
            METRICS: {"type": "http", "scheme": "bearer", "description": "MESH_METRICS_TOKEN or the admin token"},
        }},
    }


async def openapi_json(request: web.Request) -> web.Response:
    from mesh import __version__

    return web.json_response(build_spec(request.app, __version__))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi_json)
