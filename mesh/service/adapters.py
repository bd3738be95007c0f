"""Tenants' LoRA adapters: registration on a registered base, the adapter's model object, and
what a request naming an adapter runs (its base, with the adapter chosen per request).

POST /v1/models (or the operator's POST /admin/tenants/{tenant}/models) with a `base` registers
an adapter instead of a model:
    {"name": "my-tune", "base": "team/llama-1b",   # a registered model: the tenant's own; the
     "base_tenant": "shared",                      # operator may name another tenant's (optional)
     "path": "tunes/my-tune"}                      # a PEFT folder: adapter_config.json and
                                                   # adapter_model.safetensors (mesh.modelfiles.lora)
The adapter's requests go to the base's instances (the policy sees the base's model: one
instance's weights serve every adapter on it); OpenVINO runs the adapter per request
(mesh.engines.openvino_adapters), from the base's IR folder, so the base must have one (an IR
registered, or a Hugging Face folder the service exported). Adapters are read by the nodes from
the registered path: they do not travel by the weights plane yet.
"""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from mesh.engines.engine_api import Sampling
from mesh.modelfiles.lora import AdapterError, BaseLinears, read_adapter
from mesh.modelfiles.sources import SourceError, SourceNotFound, resolve_allowed
from mesh.policy.dispatch_rules import CPU
from mesh.service import errors
from mesh.service.registry import AdapterRecord, ModelRecord, RegistryError
from mesh.service.service_state import Service

KIND = "lora"  # the model object's mesh.kind for an adapter


def new_adapter_uid() -> str:
    return "a_" + secrets.token_hex(8)


def adapter_object(svc: Service, a: AdapterRecord) -> dict[str, Any]:
    """OpenAI's model object for an adapter, plus Mesh's: its base, rank, scale and size."""
    base = svc.registry.model_by_uid(a.base_uid)
    return {"id": a.name, "object": "model", "created": a.created_at, "owned_by": a.tenant,
            "mesh": {"kind": KIND, "base": base.name if base else None, "base_owner": base.tenant if base else None,
                     "node_kinds": [CPU], "rank": a.rank, "scale": a.scale, "weight_bytes": a.weight_bytes}}


def with_adapter(sampling: Sampling, adapter: AdapterRecord | None) -> Sampling:
    """A request's sampling with its adapter chosen (unchanged for a plain model)."""
    return sampling if adapter is None else replace(sampling, adapter=adapter.path, adapter_scale=adapter.scale)


async def register_adapter(svc: Service, tenant: str, name: str, data: Mapping[str, Any],
                           confined: bool) -> AdapterRecord:
    """Check and store an adapter: its base (400 if missing or without an IR folder), its folder
    (404 as a model's missing path; in the tenant's folder when `confined`), its files (400
    saying what is wrong). `confined` is a tenant's registration: its own bases only."""
    base = _base(svc, tenant, data, confined)
    folder = _ir_folder(base)
    given = data.get("path")
    if not isinstance(given, str):
        raise errors.bad_request("'path' is required: the adapter's PEFT folder (adapter_config.json and "
                                 "adapter_model.safetensors) under the server's allowed folder.", "path")
    try:
        path = await asyncio.to_thread(resolve_allowed, svc.config.allowed_dir, given, tenant if confined else None)
        facts = await asyncio.to_thread(lambda: read_adapter(path, BaseLinears.of_folder(folder)))
    except SourceNotFound as exc:
        raise errors.not_found(str(exc), "model_source_not_found", "path") from exc
    except (SourceError, AdapterError) as exc:
        raise errors.bad_request(f"Not a LoRA adapter for {base.name}: {exc}.", "path", "invalid_adapter") from exc
    svc.quotas.check_registration(tenant, facts.nbytes)
    record = AdapterRecord(new_adapter_uid(), tenant, name, base.uid, str(facts.weights), facts.rank, facts.scale,
                           facts.nbytes)
    try:
        return svc.registry.add_adapter(record)
    except RegistryError as exc:
        raise errors.conflict(str(exc), "name", "model_exists") from exc


def _base(svc: Service, tenant: str, data: Mapping[str, Any], confined: bool) -> ModelRecord:
    name, owner = data.get("base"), data.get("base_tenant", tenant)
    if not isinstance(name, str) or not isinstance(owner, str):
        raise errors.bad_request("'base' must be the name of a registered model (and 'base_tenant', if given, "
                                 "its tenant's name).", "base")
    if confined and owner != tenant:
        raise errors.ApiError(403, "Another tenant's model is a base only where the operator registers the adapter: "
                              "POST /admin/tenants/{tenant}/models with the admin token.", "permission_error",
                              "base_tenant", "admin_only")
    base = svc.registry.model(owner, name)
    if base is None:
        raise errors.bad_request(f"No base model '{name}'" + (f" of tenant {owner}" if owner != tenant else "")
                                 + ": register the base model first, then its adapters.", "base", "base_not_found")
    return base


def _ir_folder(base: ModelRecord) -> Path:
    """The base's OpenVINO IR folder, which adapters apply to; a 400 saying why it has none."""
    if base.kind == "ir":
        return Path(base.path)
    prepared = base.prepared_for(CPU)
    if base.kind == "hf" and prepared is not None and prepared.ready and prepared.format == "ir":
        return Path(prepared.path)
    why = {"gguf": "a GGUF file, whose weights carry no names an adapter's matrices can be matched to",
           "hf": "a Hugging Face folder whose OpenVINO IR is not ready",
           "emulated": "an emulated model"}.get(base.kind, f"a {base.kind} model")
    raise errors.bad_request(f"The base {base.name} is {why}: adapters run on OpenVINO from an IR folder exported by "
                             "optimum (`optimum-cli export openvino --task text-generation-with-past`). Register "
                             "that folder as the base.", "base", "unsupported_base")
