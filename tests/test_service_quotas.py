"""Tenant quotas: the rules (mesh.policy.quota, no clock) and the service enforcing them over
real HTTP (aiohttp's test server, a real SQLite registry, the cluster control with an in-process
node agent running simulated engines; the GGUF registered is the real demo file): a tenant
over each quota gets the named error while another tenant is served."""
from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from agent_doubles import InProcessAgent, use_simulated_engines
from mesh.policy.node_spec import NodeSpec
from mesh.policy.quota import (
    Quota,
    QuotaValueError,
    TokenBucket,
    check_overrides,
    concurrency_over,
    rate_over,
    registration_over,
)
from mesh.service.app import build_app
from mesh.service.cluster_control import ClusterControl, ClusterSettings
from mesh.service.config import ConfigError, ServeConfig, build_config
from mesh.service.prometheus import ServiceMetrics
from mesh.service.registry import Registry
from mesh.service.service_state import Service

ADMIN = "admin-secret"
METRICS = "metrics-secret"


# ---- the rules --------------------------------------------------------------------------

def test_token_bucket_refills_at_its_rate_up_to_its_size():
    b = TokenBucket.full(rate=2.0, size=3.0, now_s=10.0)
    assert [b.take(10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(10.0) == pytest.approx(0.5)  # one token takes 1/rate
    assert b.take(10.25) == pytest.approx(0.25)  # half refilled: nothing taken
    assert b.take(10.5) == 0.0
    assert b.take(100.0) == 0.0 and b.tokens == pytest.approx(2.0)  # capped at its size
    assert b.take(99.0) == 0.0  # a clock that goes back refills nothing


def test_quota_rules_name_the_quota():
    q = Quota(models=2, model_bytes=1000, concurrent_requests=1, requests_per_s=1.0)
    assert registration_over(q, 1, 500, 400) is None
    assert registration_over(q, 2, 0, 1).quota == "models"
    over = registration_over(q, 1, 700, 400)
    assert over.quota == "model_bytes" and over.used == 1100 and "model_bytes" in over.message()
    assert concurrency_over(q, 0) is None and concurrency_over(q, 1).quota == "concurrent_requests"
    assert registration_over(Quota(), 10**6, 10**15, 10**15) is None and concurrency_over(Quota(), 10**6) is None
    bucket = TokenBucket.full(1.0, q.bucket_size, 0.0)
    assert rate_over(q, bucket, 0.0) is None
    over = rate_over(q, bucket, 0.2)
    assert over.quota == "requests_per_s" and over.retry_after_s == pytest.approx(0.8)
    assert Quota(requests_per_s=0.5).bucket_size == 1.0 and Quota(requests_per_s=5).bucket_size == 5.0
    assert Quota(requests_per_s=5, burst=2).bucket_size == 2.0
    assert Quota(models=3).with_overrides({"models": None, "burst": 4}) == Quota(burst=4)


@pytest.mark.parametrize("data, bad", [({"models": -1}, "models"), ({"models": 1.5}, "models"),
                                       ({"requests_per_s": 0}, "requests_per_s"), ({"burst": 0}, "burst"),
                                       ({"models": True}, "models"), ({"tokens": 3}, "unknown quota"),
                                       ({"model_bytes": "1G"}, "model_bytes"),
                                       ({"requests_per_s": math.inf}, "requests_per_s")])
def test_bad_quota_settings_are_named(data, bad):
    with pytest.raises(QuotaValueError, match=bad):
        check_overrides(data)


def test_quota_defaults_from_the_config(tmp_path):
    c = build_config({"quota_models": 4, "quota_model_gb": 0.5}, {"quota_requests_per_s": 2.5})
    assert c.default_quota == Quota(models=4, model_bytes=2**29, concurrent_requests=1024, requests_per_s=2.5,
                                    burst=2000)
    # finite by default (a shared service), and "none" is no limit, in the file or on the command line
    assert all(v is not None for v in build_config({}, {}).default_quota.as_dict().values())
    c = build_config({"quota_models": "none"}, {"quota_burst": "None", "quota_concurrent_requests": "none"})
    assert (c.default_quota.models, c.default_quota.burst, c.default_quota.concurrent_requests) == (None, None, None)
    with pytest.raises(ConfigError, match="quota_burst"):
        build_config({}, {"quota_burst": 0})
    with pytest.raises(ConfigError, match="quota_model_gb"):
        build_config({"quota_model_gb": -1}, {})


# ---- over HTTP ----------------------------------------------------------------------------

class Api:
    def __init__(self, server: TestServer, session: aiohttp.ClientSession) -> None:
        self.server, self.session = server, session

    async def call(self, method: str, path: str, token: str | None = None, body: Any = None) -> tuple[int, Any, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.request(method, self.server.make_url(path), json=body, headers=headers) as r:
            text = await r.text()
            try:
                data = await r.json(content_type=None)
            except ValueError:
                data = text
            return r.status, data, r.headers

    async def tenant(self, name: str) -> str:
        assert (await self.call("POST", "/admin/tenants", ADMIN, {"name": name}))[0] == 201
        status, key, _ = await self.call("POST", f"/admin/tenants/{name}/keys", ADMIN)
        assert status == 201
        return key["key"]

    async def complete(self, key: str, model: str, max_tokens: int = 2) -> tuple[int, Any, Any]:
        return await self.call("POST", "/v1/completions", key,
                               {"model": model, "prompt": list(range(1, 21)), "max_tokens": max_tokens})


def _allowed(tmp_path: Path, demo_gguf: Path, tenants: tuple[str, ...] = ("a", "b")) -> Path:
    """An allowed folder where each tenant's folder holds the demo GGUF (a hard link where possible)."""
    import os
    import shutil

    allowed = tmp_path / "allowed"
    for tenant in tenants:
        (allowed / tenant).mkdir(parents=True, exist_ok=True)
        try:
            os.link(demo_gguf, allowed / tenant / demo_gguf.name)
        except OSError:
            shutil.copy(demo_gguf, allowed / tenant / demo_gguf.name)
    return allowed


async def _serve(tmp_path: Path, allowed: Path, **config: Any) -> tuple[Api, Any]:
    cfg = ServeConfig(admin_token=ADMIN, metrics_token=METRICS, allowed_dir=allowed, data_dir=tmp_path, **config)
    registry = Registry(tmp_path / "registry.sqlite3")
    control = ClusterControl([NodeSpec("cpu-0", "cpu", 10**10)], ClusterSettings(cold_start_s=0.0),
                                 agent_factory=InProcessAgent)
    service = Service(cfg, registry, control, ServiceMetrics(control.view), tmp_path)
    service.idle.set()
    await control.start()
    server = TestServer(build_app(service))
    await server.start_server()
    session = aiohttp.ClientSession()

    async def close() -> None:
        await session.close()
        await server.close()
        await control.stop()
        registry.close()

    return Api(server, session), close


@pytest.fixture
def simulated(monkeypatch):
    use_simulated_engines(monkeypatch)


def test_registration_quotas_name_the_quota_while_another_tenant_registers(simulated, tmp_path, demo_gguf):
    size = demo_gguf.stat().st_size

    async def main() -> None:
        api, close = await _serve(tmp_path, _allowed(tmp_path, demo_gguf), quota_models=5)
        try:
            a, b = await api.tenant("a"), await api.tenant("b")
            assert (await api.call("PUT", "/admin/tenants/a/quota", ADMIN, {"models": 1}))[0] == 200
            body = {"name": "m1", "path": demo_gguf.name}
            assert (await api.call("POST", "/v1/models", a, body))[0] == 201
            status, err, _ = await api.call("POST", "/v1/models", a, {**body, "name": "m2"})
            assert status == 403 and err["error"]["code"] == "quota_exceeded" and err["error"]["param"] == "models"
            assert "'models' allows 1" in err["error"]["message"]
            for name in ("m1", "m2"):  # b is under the defaults (5 models)
                assert (await api.call("POST", "/v1/models", b, {**body, "name": name}))[0] == 201

            # bytes: the registered models' weights (what their host copies hold)
            limit = size + size // 2
            status, view, _ = await api.call("PUT", "/admin/tenants/a/quota", ADMIN, {"model_bytes": limit})
            assert view["quota"]["models"] == 5 and view["quota"]["model_bytes"] == limit  # models: the default
            status, err, _ = await api.call("POST", "/v1/models", a, {**body, "name": "m2"})
            assert status == 413 and err["error"]["param"] == "model_bytes"
            assert str(2 * size) in err["error"]["message"] and str(limit) in err["error"]["message"]
            assert (await api.call("POST", "/v1/models", b, {**body, "name": "m3"}))[0] == 201
            assert (await api.call("DELETE", "/v1/models/m1", a))[0] == 200  # room again
            assert (await api.call("POST", "/v1/models", a, {**body, "name": "m2"}))[0] == 201

            status, view, _ = await api.call("GET", "/admin/tenants/a/quota", ADMIN)
            assert status == 200 and view["usage"] == {"models": 1, "model_bytes": size, "concurrent_requests": 0}
            assert view["settings"] == {"model_bytes": limit} and view["defaults"]["models"] == 5
            # bad settings, unknown tenants, tenants' keys
            status, err, _ = await api.call("PUT", "/admin/tenants/a/quota", ADMIN, {"models": -2})
            assert status == 400 and "models" in err["error"]["message"]
            assert (await api.call("PUT", "/admin/tenants/zz/quota", ADMIN, {}))[0] == 404
            assert (await api.call("PUT", "/admin/tenants/a/quota", a, {"models": 100}))[0] == 401
            assert (await api.call("GET", "/admin/tenants/a/quota"))[0] == 401
        finally:
            await close()

    asyncio.run(main())


def test_request_quotas_give_429_naming_the_quota_while_another_tenant_is_served(simulated, tmp_path, demo_gguf):
    async def main() -> None:
        api, close = await _serve(tmp_path, _allowed(tmp_path, demo_gguf))
        try:
            a, b = await api.tenant("a"), await api.tenant("b")
            for key in (a, b):
                assert (await api.call("POST", "/v1/models", key, {"name": "m", "path": demo_gguf.name}))[0] == 201
            assert (await api.complete(a, "m"))[0] == 200  # loads the instance

            # concurrency: one open request
            await api.call("PUT", "/admin/tenants/a/quota", ADMIN, {"concurrent_requests": 1})
            long = asyncio.ensure_future(api.complete(a, "m", max_tokens=150))  # ~1.5 s of decoding
            for _ in range(200):
                if (await api.call("GET", "/admin/tenants/a/quota", ADMIN))[1]["usage"]["concurrent_requests"]:
                    break
                await asyncio.sleep(0.01)
            status, err, headers = await api.complete(a, "m")
            assert status == 429 and err["error"]["param"] == "concurrent_requests"
            assert err["error"]["code"] == "quota_exceeded" and int(headers["Retry-After"]) >= 1
            assert (await api.complete(b, "m"))[0] == 200 and not long.done()  # b is served meanwhile
            status, body, _ = await long
            assert status == 200 and body["usage"]["completion_tokens"] == 150
            assert (await api.complete(a, "m"))[0] == 200  # closed again: served

            # rate: 1 request per second, bursts of 2
            await api.call("PUT", "/admin/tenants/a/quota", ADMIN, {"requests_per_s": 1, "burst": 2})
            assert [(await api.complete(a, "m"))[0] for _ in range(2)] == [200, 200]
            status, err, headers = await api.complete(a, "m")
            assert status == 429 and err["error"]["param"] == "requests_per_s"
            assert "1 requests per second" in err["error"]["message"] and headers["Retry-After"] == "1"
            assert [(await api.complete(b, "m"))[0] for _ in range(4)] == [200] * 4
            await asyncio.sleep(1.05)
            assert (await api.complete(a, "m"))[0] == 200

            # every refusal is counted in the metrics, as over_quota
            status, text, _ = await api.call("GET", "/metrics", METRICS)
            assert status == 200
            assert 'mesh_requests_total{model="m",outcome="over_quota",tenant="a"} 2.0' in text
            # the dispatcher placed every request it was given (one CPU node), none waits now
            placed = sum(float(line.split()[-1]) for line in text.splitlines()
                         if line.startswith('mesh_dispatcher_placements_total{kind="cpu"}'))
            assert placed >= 7 and "mesh_dispatcher_preemptions_total 0.0" in text
            assert "mesh_dispatcher_waiting_requests{" not in text
        finally:
            await close()

    asyncio.run(main())


def test_metrics_need_a_token_and_tenants_see_only_their_own_usage(simulated, tmp_path, demo_gguf):
    async def main() -> None:
        api, close = await _serve(tmp_path, _allowed(tmp_path, demo_gguf))
        try:
            a, b = await api.tenant("a"), await api.tenant("b")
            for key, name in ((a, "ma"), (b, "mb")):
                assert (await api.call("POST", "/v1/models", key, {"name": name, "path": demo_gguf.name}))[0] == 201
            assert [(await api.complete(a, "ma", max_tokens=3))[0] for _ in range(3)] == [200] * 3
            assert (await api.complete(b, "mb", max_tokens=4))[0] == 200
            assert (await api.call("POST", "/v1/completions", a, {"model": "ma", "prompt": list(range(10**4)),
                                                                 "max_tokens": 1}))[0] == 400  # over the window

            for token in (None, a, "wrong"):  # a tenant cannot read /metrics
                status, err, _ = await api.call("GET", "/metrics", token)
                assert status == 401 and err["error"]["code"] == "invalid_metrics_token"
                assert "/v1/usage" in err["error"]["message"]
            for token in (METRICS, ADMIN):
                status, text, _ = await api.call("GET", "/metrics", token)
                assert status == 200 and 'tenant="b"' in text

            status, usage, _ = await api.call("GET", "/v1/usage", a)
            assert status == 200 and usage["tenant"] == "a"
            (ma,) = usage["data"]  # b's model is not there
            assert ma["model"] == "ma" and ma["requests"] == {"completed": 3, "invalid": 1, "total": 4}
            assert ma["prompt_tokens"] == 60 and ma["completion_tokens"] == 9
            assert ma["slo"]["placed"] == 3 and ma["slo"]["attainment"] == ma["slo"]["met"] / 3
            assert "ttft_s_mean" in ma and "tpot_s_mean" in ma  # simulated engines send no first token: None
            assert usage["quota_usage"] == {"models": 1, "model_bytes": demo_gguf.stat().st_size,
                                            "concurrent_requests": 0}
            # the same counters /metrics exports
            _, text, _ = await api.call("GET", "/metrics", METRICS)
            assert 'mesh_generated_tokens_total{model="ma",tenant="a"} 9.0' in text
            status, usage_b, _ = await api.call("GET", "/v1/usage", b)
            assert [m["model"] for m in usage_b["data"]] == ["mb"] and usage_b["data"][0]["completion_tokens"] == 4
            assert (await api.call("GET", "/v1/usage"))[0] == 401
        finally:
            await close()

    asyncio.run(main())


def test_the_queue_is_set_on_serve_and_checked():
    c = build_config({"queue_capacity": 5}, {"queue_timeout_s": "slo"})
    assert (c.queue_capacity, c.queue_timeout_s) == (5, None)
    assert build_config({}, {"queue_timeout_s": 12.5}).queue_timeout_s == 12.5
    for bad in ({"queue_capacity": 0}, {"queue_capacity": True}, {"queue_timeout_s": -1}, {"queue_timeout_s": "soon"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            build_config(bad, {})
