"""Tenants' models: register (by path or upload), list, get, delete. All scoped to the caller.
GET /v1/usage: the caller's own request, token and SLO figures per model, and its quotas.

POST /v1/models with a JSON body registers a model on the server's disk:
    {"name": "my-model", "path": "sub/dir/model.gguf",       # relative to <--allowed-dir>/<tenant>/
     "context_length": 2048,                                 # optional, <= the trained window
     "slo": {"ttft_s": 2.0, "ttft_s_per_prompt_token": 0.002, "tpot_s": 0.25},   # optional
     "sampling_defaults": {"temperature": 0.2, "top_p": 0.9},  # optional: for requests that omit them;
                                                               # else the model's own (mesh.modelfiles.sampling)
     "cold_start": "serve_late",  # optional: a request its cold model cannot serve in time is served
                                  # late (default) or turned away at once ("reject"); docs/service.md
     "admission": "queue"}  # optional: a request that can no longer meet its SLO is turned away
                            # ("reject"), queued up to the queue's bound ("queue") or served late
                            # ("late"); null: the service's --admission; docs/service.md, "Admission"
POST /v1/models with `Content-Type: application/octet-stream` uploads a GGUF file as the body;
the settings go in the query: name, sha256 (required), context_length, ttft_s,
ttft_s_per_prompt_token, tpot_s, temperature, top_p (sampling defaults), cold_start, admission. The upload is streamed
to the data folder under a size limit and kept only if its SHA-256 matches.
Another tenant's model answers exactly like a model that does not exist.
A tenant registers paths only inside its own folder of the allowed folder,
`<allowed_dir>/<tenant>/` (relative paths are relative to it): a path outside it (another
tenant's file, `..`, a symlink or a folder's link that leaves it) answers the same 404 body as
a path that does not exist (mesh.modelfiles.sources.TENANT_NOT_FOUND), so a tenant learns
nothing about the files of the allowed folder.

POST /admin/tenants/{tenant}/models (admin token only) registers a model for the tenant: a
path anywhere in the allowed folder (the operator's; relative to --allowed-dir), with the
body of POST /v1/models, or an emulated model, on a service started with `mesh serve
--emulate` (mesh.engines.emulation):
    {"name": "f001", "emulate": "llama-2-7b",     # a catalog name: a model profiled on every emulated device
     "context_length": 2048, "slo": {...}}          # optional, as above (the window at most the profile's)
It answers 201 with the model object, as POST /v1/models. Emulated models are the operator's:
a tenant's POST /v1/models with "emulate" is a 403 (its key is not the admin token), and
a service without emulated nodes answers 400. Tenants then call them like any model.

Either route registers a LoRA adapter on a registered base when the body has `base`
(mesh.service.adapters); adapters are listed, read and deleted here as models are.
"""
from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any, Callable, Mapping

from aiohttp import web

from mesh.engines.engine_api import DEFAULT_CONTEXT_CAP
from mesh.modelfiles.formats import EMULATED, ENGINE_OF_KIND, FORMAT_NAMES
from mesh.modelfiles.sampling import SamplingDefaultsError
from mesh.modelfiles.sampling import check as check_sampling
from mesh.modelfiles.sources import SourceError, SourceInfo, SourceNotFound, inspect_source, resolve_allowed
from mesh.policy.dispatch_rules import ADMISSIONS, COLD_START_CHOICES, SERVE_LATE
from mesh.policy.slo import SLO
from mesh.service import errors
from mesh.service.adapters import adapter_object, register_adapter
from mesh.service.limits import body_chunks, read_json, refuse_encoded, refuse_mid_body
from mesh.service.registry import MODEL_NAME, ModelRecord, Registry, RegistryError, new_model_uid
from mesh.service.service_state import Service, service_of
from mesh.service.uploads import receive_upload

MIN_CONTEXT = 16


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/usage", usage)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/models", register_model)
    app.router.add_post("/admin/tenants/{tenant}/models", register_for_tenant)
    app.router.add_get("/v1/models/{name:.+}", get_model)
    app.router.add_delete("/v1/models/{name:.+}", delete_model)


def model_object(svc: Service, m: ModelRecord) -> dict[str, Any]:
    """OpenAI's model object, plus Mesh's: the registered format, the kinds of node it runs
    on now (`node_kinds`) and each kind's format with its state (`formats`: ready, preparing,
    failed or unavailable, with the reason; mesh.service.preparation)."""
    return {"id": m.name, "object": "model", "created": m.created_at, "owned_by": m.tenant,
            "mesh": {"kind": m.kind, "source": "upload" if m.owned_file else "path",
                     "node_kinds": list(m.node_kinds), "formats": svc.control.model_formats(m),
                     "context_length": m.context_length, "weight_bytes": m.weight_bytes, "sha256": m.sha256,
                     "slo": {"ttft_s": m.slo.ttft_min_s, "ttft_s_per_prompt_token": m.slo.ttft_s_per_prompt_token,
                             "tpot_s": m.slo.tpot_s},
                     "sampling_defaults": dict(m.sampling_defaults or {}), "cold_start": m.cold_start,
                     "admission": m.admission}}


async def usage(request: web.Request) -> web.Response:
    """The caller's own figures since the service started (the counters /metrics exports), per
    model, and its quotas with what it uses of them."""
    svc = service_of(request)
    tenant = svc.tenant_of(request)
    quota = svc.quotas.view(tenant)
    return web.json_response({"object": "usage", "tenant": tenant, "data": svc.metrics.usage(tenant),
                              "quota": quota["quota"], "quota_usage": quota["usage"]})


async def list_models(request: web.Request) -> web.Response:
    svc = service_of(request)
    tenant = svc.tenant_of(request)
    return web.json_response({"object": "list", "data": [model_object(svc, m) for m in svc.registry.models(tenant)]
                              + [adapter_object(svc, a) for a in svc.registry.adapters(tenant)]})


def _tenants_model(request: web.Request, take: Callable[[Registry, str, str], ModelRecord | None]) -> ModelRecord:
    """The caller's model named in the path, read (or deleted) by `take`; 404 if it has none."""
    svc = service_of(request)
    name = request.match_info["name"]
    record = take(svc.registry, svc.tenant_of(request), name)
    if record is None:
        raise errors.model_not_found(name)
    return record


async def get_model(request: web.Request) -> web.Response:
    svc = service_of(request)
    adapter = svc.registry.adapter(svc.tenant_of(request), request.match_info["name"])
    if adapter is not None:
        return web.json_response(adapter_object(svc, adapter))
    return web.json_response(model_object(svc, _tenants_model(request, Registry.model)))


async def delete_model(request: web.Request) -> web.Response:
    svc = service_of(request)
    adapter = svc.registry.delete_adapter(svc.tenant_of(request), request.match_info["name"])
    if adapter is not None:  # its base's instances stay; only its metric series go
        svc.metrics.forget_model(adapter.tenant, adapter.name)
        return web.json_response({"id": request.match_info["name"], "object": "model", "deleted": True})
    record = _tenants_model(request, Registry.delete_model)
    await forget_files(service_of(request), [record])
    return web.json_response({"id": request.match_info["name"], "object": "model", "deleted": True})


async def forget_files(svc: Service, records: list[ModelRecord]) -> None:
    """Unload deleted models' instances and delete their uploaded files; their metric series
    go once their last request has ended (and again then: one that ended after this recorded it)."""
    for record in records:
        svc.metrics.forget_model(record.tenant, record.name)
        await svc.control.forget_model(  # (unless the name was registered again meanwhile)
            record.uid, lambda r=record: None if svc.registry.model(r.tenant, r.name) is not None
            else svc.metrics.forget_model(r.tenant, r.name))
        if record.owned_file:
            Path(record.path).unlink(missing_ok=True)


async def register_model(request: web.Request) -> web.Response:
    svc = service_of(request)
    tenant = svc.tenant_of(request)
    if request.content_type == "application/octet-stream":
        return await _register_upload(svc, request, tenant)
    data = await read_json(request, svc.limits)
    if "emulate" in data:
        raise errors.ApiError(403, "Emulated models are registered by the operator: POST "
                              "/admin/tenants/{tenant}/models with the admin token.", "permission_error", "emulate",
                              "admin_only")
    name = _name(data.get("name"))
    if svc.registry.model(tenant, name) is not None or svc.registry.adapter(tenant, name) is not None:
        raise errors.conflict(f"You already have a model named '{name}'; delete it first or pick another name.",
                              "name", "model_exists")
    svc.quotas.take_registration(tenant, asyncio.get_running_loop().time())  # 429 past its rate, before the work
    if "base" in data:
        return web.json_response(adapter_object(svc, await register_adapter(svc, tenant, name, data, True)),
                                 status=201)
    record = await _by_path(svc, tenant, name, data, confined=True)
    return _created(svc, record)


async def _by_path(svc: Service, tenant: str, name: str, data: Mapping[str, Any], confined: bool) -> ModelRecord:
    """The record of a model registered from a path: in the tenant's folder of the allowed
    folder (`confined`), else anywhere in it (the operator's registration)."""
    given = data.get("path", data.get("source"))
    if not isinstance(given, str):
        raise errors.bad_request("'path' is required: a GGUF file, OpenVINO IR folder or Hugging Face folder under "
                                 "the server's allowed folder (or upload a GGUF file with Content-Type: "
                                 "application/octet-stream).", "path")
    try:
        # both walk the file system (a folder's rglob): off the event loop
        info = await asyncio.to_thread(
            lambda: inspect_source(resolve_allowed(svc.config.allowed_dir, given, tenant if confined else None)))
    except SourceNotFound as exc:
        raise errors.not_found(str(exc), "model_source_not_found", "path") from exc
    except SourceError as exc:
        raise errors.bad_request(str(exc), "path", "invalid_model_source") from exc
    return _record(tenant, name, info, data, owned=False)


async def register_for_tenant(request: web.Request) -> web.Response:
    """A model for a tenant (admin only): a path anywhere in the allowed folder, or a catalog
    name the emulated devices profile."""
    svc = service_of(request)
    svc.require_admin(request)
    tenant = request.match_info["tenant"]
    if svc.registry.tenant(tenant) is None:
        raise errors.not_found(f"No tenant named '{tenant}'.", "tenant_not_found", "tenant")
    data = await read_json(request, svc.limits)
    if "emulate" not in data and ("path" in data or "source" in data):
        name = _name(data.get("name"))
        if svc.registry.model(tenant, name) is not None or svc.registry.adapter(tenant, name) is not None:
            raise errors.conflict(f"Tenant {tenant} already has a model named '{name}'.", "name", "model_exists")
        if "base" in data:
            return web.json_response(adapter_object(svc, await register_adapter(svc, tenant, name, data, False)),
                                     status=201)
        return _created(svc, await _by_path(svc, tenant, name, data, confined=False))
    if not svc.config.emulate:
        raise errors.bad_request("This service runs no emulated nodes (start it with mesh serve --emulate "
                                 "DEVICE:N,...).", "emulate", "not_emulating")
    name = _name(data.get("name"))
    if svc.registry.model(tenant, name) is not None:
        raise errors.conflict(f"Tenant {tenant} already has a model named '{name}'.", "name", "model_exists")
    from mesh.engines.emulation import emulated_profiles

    catalog = data.get("emulate")
    try:
        profiles = emulated_profiles(str(catalog), svc.config.emulate) if isinstance(catalog, str) else None
    except ValueError as exc:
        raise errors.bad_request(f"{exc}.", "emulate", "unknown_emulated_model") from exc
    if profiles is None:
        raise errors.bad_request("'emulate' must be a catalog model name such as llama-2-7b.", "emulate")
    window = min(p.max_context for p in profiles)
    info = SourceInfo(EMULATED, Path(catalog), window, max(p.weight_bytes for p in profiles))
    return _created(svc, _record(tenant, name, info, data, owned=False))


async def _register_upload(svc: Service, request: web.Request, tenant: str) -> web.Response:
    q = request.query
    name = _name(q.get("name"))
    if svc.registry.model(tenant, name) is not None:
        raise errors.conflict(f"You already have a model named '{name}'.", "name", "model_exists")
    sha256 = q.get("sha256")
    if not sha256:
        raise errors.bad_request("Uploads need '?sha256=<hex digest of the file>' so the server can verify them.",
                                 "sha256")
    refuse_encoded(request, "Uploads")  # stored as sent and counted against the quota: never inflated
    svc.quotas.check_registration(tenant, request.content_length or 0)  # before receiving any of it
    limit, over_limit = _upload_cap(svc, tenant)
    if request.content_length is not None and request.content_length > limit:
        raise over_limit()
    if svc.uploading.get(tenant, 0) >= svc.config.max_uploads_per_tenant:
        raise errors.ApiError(429, f"You are already uploading {svc.config.max_uploads_per_tenant} files at once, "
                              "the most a tenant may. Retry when one has finished.", "rate_limit_error", None,
                              "too_many_uploads", {"Retry-After": "5"})
    if sum(svc.uploading.values()) >= svc.config.max_uploads:  # one bound for the whole service
        raise errors.ApiError(429, f"The server is receiving {svc.config.max_uploads} uploads at once, the most it "
                              "takes. Retry shortly.", "rate_limit_error", None, "too_many_uploads",
                              {"Retry-After": "5"})
    settings = _query_settings(q)
    svc.quotas.take_registration(tenant, asyncio.get_running_loop().time())  # 429 past its rate, before the body
    uid = new_model_uid()
    target = svc.data_dir / "uploads" / f"{uid}.gguf"
    svc.uploading[tenant] = svc.uploading.get(tenant, 0) + 1
    refused = None
    try:
        await receive_upload(body_chunks(request, svc.limits), target, limit, sha256, over_limit)
    except errors.ApiError as exc:
        if exc.status != 413 or request.content.at_eof():
            raise
        refused = exc  # past the cap while the client still sends
    finally:
        svc.uploading[tenant] -= 1
        if not svc.uploading[tenant]:
            del svc.uploading[tenant]
    if refused is not None:
        return await refuse_mid_body(request, refused, svc.limits)
    try:
        info = await asyncio.to_thread(inspect_source, target)
        record = _record(tenant, name, info, settings, owned=True, uid=uid, sha256=sha256.lower())
        return _created(svc, record)
    except BaseException as exc:
        target.unlink(missing_ok=True)
        if isinstance(exc, SourceError):
            raise errors.bad_request(str(exc), "body", "invalid_model_source") from exc
        raise


def _upload_cap(svc: Service, tenant: str) -> tuple[int, Callable[[], errors.ApiError]]:
    """The most bytes this upload may have: max_upload_bytes, or what is left of the tenant's
    `model_bytes` quota when that is less; and the error for a body past it."""
    limit = svc.config.max_upload_bytes
    quota = svc.quotas.of(tenant).model_bytes
    if quota is not None:
        used = svc.registry.usage(tenant)[1]
        if quota - used < limit:
            return max(0, quota - used), lambda: svc.quotas.upload_over(tenant, quota, used)
    return limit, lambda: errors.too_large(limit, "upload")


def _created(svc: Service, record: ModelRecord) -> web.Response:
    svc.quotas.check_registration(record.tenant, record.weight_bytes)  # 403 / 413 naming the quota
    here = {n["kind"] for n in svc.control.view()["nodes"]}
    if record.native_kind not in here:  # servable only if its format for a kind the server has can be prepared
        others = {k: f for k, f in svc.control.model_formats(record).items() if k != record.native_kind}
        if not any(k in here and f["state"] != "unavailable" for k, f in others.items()):
            why = "; ".join(f"its {k.upper()} format cannot be prepared: {f.get('reason') or f['state']}"
                            for k, f in others.items())
            hint = (" Export it to OpenVINO IR (`optimum-cli export openvino --model DIR --task "
                    "text-generation-with-past OUT`) under the allowed folder and register OUT."
                    if record.kind == "hf" else "")
            raise errors.bad_request(
                f"This is a {FORMAT_NAMES[record.kind]}, which runs on {record.native_kind.upper()} nodes "
                f"({ENGINE_OF_KIND[record.native_kind]}), and this server has none ({why}).{hint}", "path",
                "unsupported_model_format")
    try:
        stored = svc.registry.add_model(record)
    except RegistryError as exc:
        if "already exists" in str(exc):
            raise errors.conflict(str(exc), "name", "model_exists") from exc
        raise errors.bad_request(str(exc), "name") from exc
    svc.control.model_registered(stored)  # the first host copy goes to a node (BlitzScale 5.3)
    return web.json_response(model_object(svc, stored), status=201)


def _name(value: Any) -> str:
    if not isinstance(value, str) or not MODEL_NAME.match(value) or ".." in value or "//" in value:
        raise errors.bad_request("'name' is required: 1-128 characters of letters, digits, '_', '.', ':', '/', '-', "
                                 "starting with a letter or digit.", "name")
    return value


def _query_settings(q: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "context_length" in q:
        try:
            out["context_length"] = int(q["context_length"])
        except ValueError as exc:
            raise errors.bad_request("'context_length' must be an integer.", "context_length") from exc
    slo = _numbers(q, ("ttft_s", "ttft_s_per_prompt_token", "tpot_s"))
    if slo:
        out["slo"] = slo
    sampling = _numbers(q, ("temperature", "top_p"))
    if sampling:
        out["sampling_defaults"] = sampling
    for key in ("cold_start", "admission"):
        if key in q:
            out[key] = q[key]
    return out


def _numbers(q: Mapping[str, str], keys: tuple[str, ...]) -> dict[str, float]:
    """The query parameters among `keys` that are given, as numbers; a 400 naming one that is not."""
    out = {}
    for key in keys:
        if key in q:
            try:
                out[key] = float(q[key])
            except ValueError as exc:
                raise errors.bad_request(f"'{key}' must be a number.", key) from exc
    return out


def _record(tenant: str, name: str, info: SourceInfo, data: Mapping[str, Any], owned: bool,
            uid: str | None = None, sha256: str | None = None) -> ModelRecord:
    trained = info.context_length
    window = data.get("context_length")
    if window is None:
        window = min(trained, DEFAULT_CONTEXT_CAP) if trained else 2048
    elif isinstance(window, bool) or not isinstance(window, int) or window < MIN_CONTEXT:
        raise errors.bad_request(f"'context_length' must be an integer of at least {MIN_CONTEXT}.", "context_length")
    elif trained and window > trained:
        raise errors.bad_request(f"'context_length' {window} exceeds the model's trained window of {trained}.",
                                 "context_length")
    try:
        given = check_sampling(data.get("sampling_defaults"))
    except SamplingDefaultsError as exc:
        raise errors.bad_request(f"{exc}.", "sampling_defaults") from exc
    cold_start = data.get("cold_start", SERVE_LATE)
    if cold_start not in COLD_START_CHOICES:
        raise errors.bad_request(f"'cold_start' must be one of {', '.join(map(repr, COLD_START_CHOICES))}: what a "
                                 "request gets when its model is cold and cannot answer within its TTFT (served late, "
                                 "or turned away at once).", "cold_start")
    admission = data.get("admission")
    if admission is not None and admission not in ADMISSIONS:
        raise errors.bad_request(f"'admission' must be one of {', '.join(map(repr, ADMISSIONS))} or null (the "
                                 "service's default): what a request that can no longer meet its SLO gets (turned away "
                                 "at once, queued up to the queue's bound, or served late without a bound).",
                                 "admission")
    return ModelRecord(uid or new_model_uid(), tenant, name, info.kind, str(info.path), int(window),
                       _slo(data.get("slo")), info.weight_bytes, sha256, owned,
                       sampling_defaults={**(info.sampling_defaults or {}), **given}, cold_start=cold_start,
                       admission=admission)


def _slo(value: Any) -> SLO:
    if value is None:
        return SLO()
    if not isinstance(value, dict):
        raise errors.bad_request("'slo' must be an object: {\"ttft_s\": ..., \"tpot_s\": ...}.", "slo")
    unknown = set(value) - {"ttft_s", "ttft_s_per_prompt_token", "tpot_s"}
    if unknown:
        raise errors.bad_request(f"'slo' has unknown fields {sorted(unknown)}; use ttft_s, ttft_s_per_prompt_token, "
                                 "tpot_s.", "slo")
    default = SLO()
    out = []
    for key, fallback, high in (("ttft_s", default.ttft_min_s, 3600.0),
                                ("ttft_s_per_prompt_token", default.ttft_s_per_prompt_token, 10.0),
                                ("tpot_s", default.tpot_s, 60.0)):
        x = value.get(key, fallback)
        ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        low_ok = ok and (x >= 0 if key == "ttft_s_per_prompt_token" else x > 0)
        if not (low_ok and x <= high):
            raise errors.bad_request(f"'slo.{key}' must be a number in {'[0' if key.endswith('token') else '(0'}, "
                                     f"{high:g}] seconds.", f"slo.{key}")
        out.append(float(x))
    return SLO(out[0], out[1], out[2])
