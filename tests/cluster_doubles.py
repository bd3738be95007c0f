"""Small clusters with hand-checkable profiles, for dispatcher and replay tests."""
from __future__ import annotations

import asyncio
from typing import Callable

from mesh.control.dispatcher import Dispatcher
from mesh.control.fleet import ClusterConfig, Fleet, ModelSpec
from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.perf.load_times import ColdStart
from mesh.perf.profile import Profile, profile_from_dict
from mesh.policy.slo import SLO
from mesh.replay.simulator import simulated_cluster
from mesh.wire.served_request import ServedRequest

GB = 10**9
KV_PER_TOKEN = 100_000  # bytes
WEIGHTS = 2 * GB
CONTEXT = 1024


def _grid(top: int) -> list[int]:
    out, n = [], 16
    while n <= top:
        out.append(n)
        n *= 2
    return out


def linear_profile(
    model: str,
    kind: str,
    *,
    prefill_per_token: float = 0.0005,
    prefill_base: float = 0.01,
    decode_base: float = 0.05,
    decode_per_request: float = 0.0,
    weight_bytes: int = WEIGHTS,
    kv_bytes_per_token: int = KV_PER_TOKEN,
    max_context: int = CONTEXT,
) -> Profile:
    """Prefill a + b L; decode c + d B (flat in context): linear, so interpolation is exact."""
    lengths = _grid(max_context)
    batches = [2**k for k in range(9)]
    return profile_from_dict({
        "format": "mesh-profile/1", "model": model, "device": f"test-{kind}", "device_kind": kind,
        "engine": "test", "kv_bytes_per_token": kv_bytes_per_token, "weight_bytes": weight_bytes,
        "max_context": max_context,
        "prefill": {"prompt_lengths": lengths, "seconds": [prefill_base + prefill_per_token * n for n in lengths]},
        "decode": {"batch_sizes": batches, "context_lengths": lengths,
                   "seconds": [[decode_base + decode_per_request * b for _ in lengths] for b in batches]},
        "provenance": {"method": "measured", "hardware": {}},
    })


def spec(model: str = "llama-2-7b", **kw) -> ModelSpec:
    cpu = {k[4:]: v for k, v in kw.items() if k.startswith("cpu_")}
    gpu = {k[4:]: v for k, v in kw.items() if k.startswith("gpu_")}
    return ModelSpec(model, {"cpu": linear_profile(model, "cpu", **cpu), "gpu": linear_profile(model, "gpu", **gpu)})


def config(cpu: int = 1, gpu: int = 1, **kw) -> ClusterConfig:
    kw.setdefault("cold_start", ColdStart(pcie_bytes_per_s=20 * GB, cpu_load_bytes_per_s=40 * GB))
    kw.setdefault("cpu_memory_bytes", 64 * GB)
    kw.setdefault("gpu_memory_bytes", 40 * GB)
    return ClusterConfig(cpu_nodes=cpu, gpu_nodes=gpu, **kw)


async def build(
    policy: str,
    models: dict[str, str],
    cfg: ClusterConfig,
    catalog: dict[str, ModelSpec] | None = None,
    **dispatcher_kw,
) -> tuple[Fleet, Dispatcher]:
    """A started cluster and dispatcher (call inside a running loop)."""
    catalog = catalog or {b: spec(b) for b in set(models.values())}
    cluster = simulated_cluster(cfg, catalog, models, {b: 100.0 for b in catalog})
    d = Dispatcher.for_policy(cluster, policy, **dispatcher_kw)
    await cluster.start()
    return cluster, d


def request(rid: str, model: str, prompt: int = 100, out: int = 20, at: float | None = None,
            slo: SLO = SLO()) -> ServedRequest:
    at = asyncio.get_running_loop().time() if at is None else at
    return ServedRequest(EngineRequest(rid, prompt, Sampling(max_tokens=max(out, 1)), output_len=out), model, at, slo)


async def run_until(cond: Callable[[], bool], limit_s: float = 600.0, step_s: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in virtual time")
        await asyncio.sleep(step_s)
