"""The control service's shared state (`Service`), as every route reads it (`service_of`).

Its own module so that the app (mesh.service.app) and its routes (routes_openai,
routes_models, routes_admin) all read it without importing each other."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from mesh.control.latency import LoopLagProbe
from mesh.service import errors
from mesh.service.auth import admin_token_ok, bearer_token, hash_key
from mesh.service.cluster_control import ClusterInterface
from mesh.service.config import ServeConfig
from mesh.service.limits import HttpLimits
from mesh.service.prometheus import ServiceMetrics
from mesh.service.quotas import Quotas
from mesh.service.registry import Registry

ARRIVAL = "mesh_arrival_s"  # the request's key of its arrival time on the loop clock (set by the app's middleware)


@dataclass
class Service:
    """What every route of the service shares: its configuration, registry, cluster side,
    metrics, tenants' quotas and HTTP limits, and whether it drains."""

    config: ServeConfig
    registry: Registry
    control: ClusterInterface  # the cluster side (ClusterControl)
    metrics: ServiceMetrics
    data_dir: Path
    wall_offset: float = 0.0  # unix time = loop.time() + wall_offset
    draining: bool = False
    generating: int = 0  # open generation requests (what shutdown drains)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    quotas: Quotas = field(init=False)
    limits: HttpLimits = field(init=False)
    uploading: dict[str, int] = field(default_factory=dict)  # tenant -> uploads it streams now
    loop_lag: LoopLagProbe = field(default_factory=LoopLagProbe)  # the event loop's lag (run_service starts it)

    def __post_init__(self) -> None:
        self.quotas = Quotas(self.registry, self.config.default_quota)
        c = self.config
        self.limits = HttpLimits(head_timeout_s=c.http_head_timeout_s, body_timeout_s=c.http_body_timeout_s,
                                 max_connections=c.max_connections,
                                 max_connections_per_client=c.max_connections_per_client)

    def unix_now(self) -> int:
        return int(asyncio.get_running_loop().time() + self.wall_offset)

    def tenant_of(self, request: web.Request) -> str:
        """The caller's tenant from its API key; 401 otherwise."""
        token = bearer_token(request.headers.get("Authorization"))
        if token is None:
            raise errors.unauthorized()
        tenant = self.registry.tenant_for_key_hash(hash_key(token))
        if tenant is None:
            raise errors.unauthorized()
        return tenant

    def require_admin(self, request: web.Request) -> None:
        if not admin_token_ok(bearer_token(request.headers.get("Authorization")), self.config.admin_token):
            raise errors.admin_unauthorized()

    def begin_generation(self) -> None:
        self.generating += 1
        self.idle.clear()

    def end_generation(self) -> None:
        self.generating -= 1
        if self.generating == 0:
            self.idle.set()


SERVICE = web.AppKey("service", Service)


def service_of(request: web.Request) -> Service:
    return request.app[SERVICE]
