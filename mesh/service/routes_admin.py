"""Operator routes, all behind the admin token (`Authorization: Bearer <MESH_ADMIN_TOKEN>`).

    POST   /admin/tenants                 {"name": "acme"}           create a tenant
    GET    /admin/tenants                                            list tenants
    DELETE /admin/tenants/{tenant}                                   delete it, its keys and models
    POST   /admin/tenants/{tenant}/keys   {"label": "ci"} (optional)  issue an API key (shown once)
    GET    /admin/tenants/{tenant}/keys                              list its keys (no secrets)
    DELETE /admin/keys/{key_id}                                      revoke a key
    GET    /admin/models                                             every tenant's models
    GET    /admin/cluster                                            nodes, instances, memory, queues,
                                                                     weights (host copies, transfers), the
                                                                     control plane's own cost (loop lag,
                                                                     decisions, frames from the agents)
    GET    /admin/learnt                                             what nodes learnt: speed probes, time
                                                                     factors, margins, cold starts, profiles
    POST   /admin/scale   {"tenant", "model", "nodes": [...]}        start the model on those nodes now
    GET    /admin/tenants/{tenant}/quota                             its quotas, their defaults, its usage
    PUT    /admin/tenants/{tenant}/quota  {"models": 3, ...}         set its quotas (mesh.policy.quota): the
                                                                     ones given (null: no limit); the rest
                                                                     follow the service's defaults
    GET    /admin/tenants/{tenant}/admission                         its default admission choice
    PUT    /admin/tenants/{tenant}/admission {"admission": "queue"}  set it: reject, queue, late, or null (the
                                                                     service's --admission); a model's own
                                                                     choice (its registration) comes first
"""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from aiohttp import web

from mesh.policy.dispatch_rules import ADMISSIONS
from mesh.policy.quota import QuotaValueError, check_overrides
from mesh.service import errors
from mesh.service.adapters import adapter_object
from mesh.service.auth import new_api_key
from mesh.service.registry import RegistryError
from mesh.service.routes_learnt import learnt_view
from mesh.service.routes_models import forget_files, model_object
from mesh.service.schema import parse_json
from mesh.service.service_state import Service, service_of


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/tenants", create_tenant)
    app.router.add_get("/admin/tenants", list_tenants)
    app.router.add_delete("/admin/tenants/{tenant}", delete_tenant)
    app.router.add_post("/admin/tenants/{tenant}/keys", issue_key)
    app.router.add_get("/admin/tenants/{tenant}/keys", list_keys)
    app.router.add_delete("/admin/keys/{key_id}", revoke_key)
    app.router.add_get("/admin/models", list_all_models)
    app.router.add_get("/admin/cluster", cluster)
    app.router.add_get("/admin/learnt", learnt)
    app.router.add_post("/admin/scale", scale)
    app.router.add_get("/admin/tenants/{tenant}/quota", get_quota)
    app.router.add_put("/admin/tenants/{tenant}/quota", put_quota)
    app.router.add_get("/admin/tenants/{tenant}/admission", get_admission)
    app.router.add_put("/admin/tenants/{tenant}/admission", put_admission)


async def get_quota(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    return web.json_response(svc.quotas.view(_tenant(request)))


async def put_quota(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    name = _tenant(request)
    data = parse_json(await request.read())
    try:
        settings = check_overrides(data)
    except QuotaValueError as exc:
        raise errors.bad_request(f"{exc}.", None, "invalid_quota") from exc
    svc.registry.set_quota_settings(name, settings)
    svc.quotas.changed(name)
    return web.json_response(svc.quotas.view(name))


def _admission_view(svc: Service, tenant: str) -> dict[str, Any]:
    own = svc.registry.tenant_admissions().get(tenant)
    return {"tenant": tenant, "admission": own, "service_default": svc.config.admission,
            "effective": own or svc.config.admission}


async def get_admission(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    return web.json_response(_admission_view(svc, _tenant(request)))


async def put_admission(request: web.Request) -> web.Response:
    """A tenant's default admission choice for its models registered without their own
    (mesh.policy.dispatch_rules.ADMISSIONS; docs/service.md, "Admission")."""
    svc = service_of(request)
    svc.require_admin(request)
    name = _tenant(request)
    data = parse_json(await request.read())
    choice = data.get("admission")
    if "admission" not in data or (choice is not None and choice not in ADMISSIONS):
        raise errors.bad_request(f"'admission' must be one of {', '.join(map(repr, ADMISSIONS))}, or null for the "
                                 "service's default (--admission).", "admission")
    svc.registry.set_tenant_admission(name, choice)
    svc.control.set_tenant_admission(name, choice)
    return web.json_response(_admission_view(svc, name))


async def create_tenant(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    data = parse_json(await request.read())
    try:
        tenant = svc.registry.create_tenant(data.get("name"))
    except RegistryError as exc:
        if "already exists" in str(exc):
            raise errors.conflict(str(exc), "name", "tenant_exists") from exc
        raise errors.bad_request(str(exc), "name") from exc
    return web.json_response(asdict(tenant), status=201)


async def list_tenants(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    out = []
    for t in svc.registry.tenants():
        keys = svc.registry.keys(t.name)
        out.append({**asdict(t), "models": len(svc.registry.models(t.name)),
                    "active_keys": sum(1 for k in keys if k.revoked_at is None)})
    return web.json_response({"object": "list", "data": out})


def _tenant(request: web.Request) -> str:
    svc = service_of(request)
    name = request.match_info["tenant"]
    if svc.registry.tenant(name) is None:
        raise errors.not_found(f"No tenant '{name}'.", "tenant_not_found", "tenant")
    return name


async def delete_tenant(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    name = _tenant(request)
    models = svc.registry.delete_tenant(name)
    svc.control.set_tenant_admission(name, None)
    await forget_files(svc, models)
    return web.json_response({"name": name, "deleted": True, "models_deleted": len(models)})


async def issue_key(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    name = _tenant(request)
    label = ""
    if request.can_read_body:
        body = await request.read()
        if body.strip():
            data = parse_json(body)
            label = data.get("label", "")
            if not isinstance(label, str) or len(label) > 200:
                raise errors.bad_request("'label' must be a string of at most 200 characters.", "label")
    key = new_api_key()
    info = svc.registry.add_key(name, key.key_hash, key.display, label)
    return web.json_response({**asdict(info), "key": key.key}, status=201)


async def list_keys(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    name = _tenant(request)
    return web.json_response({"object": "list", "data": [asdict(k) for k in svc.registry.keys(name)]})


async def revoke_key(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    key_id = request.match_info["key_id"]
    try:
        info = svc.registry.revoke_key(key_id)
    except RegistryError as exc:
        raise errors.not_found(str(exc), "key_not_found", "key_id") from exc
    return web.json_response({**asdict(info), "revoked": True})


async def list_all_models(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    return web.json_response({"object": "list", "data": [model_object(svc, m) for m in svc.registry.models()]
                              + [adapter_object(svc, a) for a in svc.registry.adapters()]})


async def cluster(request: web.Request) -> web.Response:
    svc = service_of(request)
    svc.require_admin(request)
    view: dict[str, Any] = svc.control.view()
    view["models"] = len(svc.registry.models())
    view["tenants"] = len(svc.registry.tenants())
    view["open_requests"] = svc.generating
    view["control_plane"] = {"pid": os.getpid(), "loop_lag": svc.loop_lag.view(),  # mesh bench control-plane
                             "cores": sorted(os.sched_getaffinity(0))}  # the service's own (mesh serve --node-cores)
    return web.json_response(view)


async def learnt(request: web.Request) -> web.Response:
    """What the service learnt about its machines (mesh.service.routes_learnt), for the live replay's twin."""
    svc = service_of(request)
    svc.require_admin(request)
    return web.json_response(learnt_view(svc.control))


async def scale(request: web.Request) -> web.Response:
    """Start a model on chosen nodes now: `{"tenant", "model", "nodes": [node id, ...]}`. The
    nodes that lack its weights get them in one multicast. Answers per node."""
    svc = service_of(request)
    svc.require_admin(request)
    data = parse_json(await request.read())
    tenant, name, nodes = data.get("tenant"), data.get("model"), data.get("nodes")
    if not isinstance(tenant, str) or not isinstance(name, str):
        raise errors.bad_request("'tenant' and 'model' (the model's name) are required strings.", "model")
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
        raise errors.bad_request("'nodes' must be a non-empty list of node ids (GET /admin/cluster lists them).",
                                 "nodes")
    record = svc.registry.model(tenant, name)
    if record is None:
        raise errors.not_found(f"Tenant '{tenant}' has no model '{name}'.", "model_not_found", "model")
    return web.json_response(await svc.control.scale_out(record, list(dict.fromkeys(nodes))))
