"""Errors in the OpenAI format: {"error": {"message", "type", "param", "code"}}.

Every error the service answers is an ApiError (or an aiohttp HTTP error mapped by
`from_http_exception`); the app's middleware turns them into JSON responses, and anything
else into a logged 500 that says nothing about internals. Bad input is always an ApiError.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mesh.policy.dispatch_rules import ADMIT_LATE, ADMIT_QUEUE, ADMIT_REJECT


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = self.headers
        if self.status == 429 and "Retry-After" not in (headers or {}):  # every 429 says when to retry
            headers = {**(headers or {}), "Retry-After": "1"}
        return web.json_response(self.body(), status=self.status, headers=headers)

    def sse(self) -> bytes:
        """The error as one server-sent event (a stream that fails after it started)."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str = "Incorrect or missing API key. Pass it as 'Authorization: Bearer <key>'.") -> ApiError:
    return ApiError(401, message, "invalid_request_error", None, "invalid_api_key")


def admin_unauthorized() -> ApiError:
    return ApiError(401, "Admin routes need the admin token: 'Authorization: Bearer <MESH_ADMIN_TOKEN>'.",
                    "invalid_request_error", None, "invalid_admin_token")


def metrics_unauthorized() -> ApiError:
    return ApiError(401, "/metrics needs the metrics token or the admin token: 'Authorization: Bearer "
                    "<MESH_METRICS_TOKEN>'. Tenants see their own figures at GET /v1/usage.",
                    "invalid_request_error", None, "invalid_metrics_token")


def model_not_found(name: str) -> ApiError:
    # Same answer for a model that does not exist and for another tenant's: no hint.
    return ApiError(404, f"The model '{name}' does not exist or you do not have access to it.",
                    "invalid_request_error", "model", "model_not_found")


def not_found(message: str, code: str = "not_found", param: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", param, code)


def conflict(message: str, param: str | None = None, code: str = "conflict") -> ApiError:
    return ApiError(409, message, "invalid_request_error", param, code)


def too_large(limit_bytes: int, what: str = "request body") -> ApiError:
    return ApiError(413, f"The {what} exceeds the limit of {limit_bytes / 2**20:.0f} MiB.",
                    "invalid_request_error", None, "request_too_large")


def context_too_long(prompt_tokens: int, window: int, param: str) -> ApiError:
    return ApiError(400, f"This model's maximum context length is {window} tokens; your prompt has "
                    f"{prompt_tokens} tokens, which leaves no room for output. Shorten the prompt.",
                    "invalid_request_error", param, "context_length_exceeded")


def max_tokens_too_large(max_tokens: int, prompt_tokens: int, window: int) -> ApiError:
    """More output asked for than the context window leaves after the prompt (as vLLM and
    OpenAI answer): the request would otherwise run to the window's end."""
    return ApiError(400, f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is {window} "
                    f"tokens and your prompt has {prompt_tokens} tokens, so the largest value allowed is "
                    f"{window - prompt_tokens}. Lower max_tokens, or omit it to generate up to the context window.",
                    "invalid_request_error", "max_tokens", "context_length_exceeded")


ADMISSION_MEANING = {ADMIT_REJECT: "turn away what cannot meet its SLO",
                     ADMIT_QUEUE: "wait up to the queue's bound, then be turned away",
                     ADMIT_LATE: "wait, without a time bound, to be served late"}


def overloaded(reason: str, retry_after_s: float = 1.0, admission: str | None = None) -> ApiError:
    """A request the dispatcher turned away (its SLO could not be met in time, the queue was
    full or it waited too long); Retry-After: when it may do better (a cold start's end).
    The message names the model's admission choice that applied (mesh.policy.dispatch_rules.ADMISSIONS)."""
    retry = max(1, math.ceil(retry_after_s))
    choice = (f" The model's admission is '{admission}' ({ADMISSION_MEANING.get(admission, admission)}); "
              "its owner or the operator may choose 'queue' or 'late' instead (docs/service.md, \"Admission\").") \
        if admission else ""
    return ApiError(429, f"The service could not place this request in time for its SLO ({reason}).{choice} "
                    f"Retry in {retry} s.", "rate_limit_error", None, "slo_unattainable",
                    {"Retry-After": str(retry)})


def over_quota(quota: str, message: str, status: int, retry_after_s: float | None = None) -> ApiError:
    """A tenant over one of its quotas (mesh.policy.quota): `param` names the quota. 429 for
    requests (with Retry-After), 403 (model count) or 413 (model bytes) for registrations."""
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    return ApiError(status, f"{message} Ask the operator to raise it" + (
        ", or retry later." if status == 429 else ", or delete a model first."), kind, quota, "quota_exceeded", headers)


def node_unavailable(reason: str) -> ApiError:
    return ApiError(503, f"No node can serve this request now: {reason}. Retry shortly.", "server_error",
                    None, "node_unavailable", {"Retry-After": "1"})


def model_preparing(reason: str, retry_after_s: float = 10.0) -> ApiError:
    """The model's format for the nodes this server may use is still being prepared
    (mesh.service.preparation): a wait, not a fault."""
    return ApiError(503, f"The model cannot be served yet: {reason}. Retry in a little while.", "server_error",
                    "model", "model_preparing", {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down.", "server_error", None, "shutting_down",
                    {"Retry-After": "1"})


def internal_error() -> ApiError:
    return ApiError(500, "The server had an internal error; it is logged.", "server_error", None, "internal_error")


_HTTP_CODES = {
    400: ("invalid_request_error", "bad_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    431: ("invalid_request_error", "headers_too_large"),
}


def from_http_exception(exc: web.HTTPException) -> ApiError:
    """aiohttp's own errors (no route, wrong method, body over client_max_size, ...)."""
    status = exc.status
    kind, code = _HTTP_CODES.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    if status == 404:
        message = "Unknown route. The API is under /v1 (OpenAI) and /admin; see docs/service.md."
    elif status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        message = f"Method {getattr(exc, 'method', '')} is not allowed on this route" + (
            f"; use {allowed}." if allowed else ".")
    elif status == 413:
        message = f"The request body is too large. {exc.text or ''}".strip()
    else:
        message = exc.text or exc.reason
    return ApiError(status, message, kind, None, code)
