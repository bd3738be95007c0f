"""`mesh replay --live URL`: the replay's workload sent to a running Mesh service through its
OpenAI API, with real engines, and the same requests replayed in virtual time beside it.

The live side (`run_live`) creates a tenant of its own with the admin token, lifts its
quotas, registers one model per trace function (uploads of `--model-path`, the demo GGUF by
default), sends every request at its arrival time as a streamed `/v1/completions` call with
the trace's prompt length (token ids) and output length (`max_tokens` with vLLM's
`ignore_eos`), and records what the client sees: the first token's and the last token's
times, the tokens, or the 429 or error. It polls `/admin/cluster` once a second for the
nodes that host an instance. At the end the tenant (models and uploads) is deleted.

Each request becomes a `ServedRequest` with the client's times, so the live figures are the
same function of the same records as a simulated replay's (mesh.replay.metrics): a 429 is
rejected, any other failure failed, and both are in the denominator.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
import numpy as np
from tqdm import tqdm

from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.policy.dispatch_rules import CPU, GPU
from mesh.policy.queueing import DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_TIMEOUT_S
from mesh.policy.slo import SLO
from mesh.service.limits import CLIENT_KEEPALIVE_S
from mesh.wire.served_request import Outcome, ServedRequest
from workloads.workload import Workload

POLL_S = 1.0
TOKEN_LOW, TOKEN_HIGH = 100, 30_000  # prompt token ids drawn here: ordinary tokens of a 49k vocabulary


class LiveReplayError(RuntimeError):
    """The service refused the set-up (tenant, quota, registration); the message says which call."""


@dataclass
class LiveRun:
    """What the client saw: every request (times from the workload's start), and the nodes
    hosting at least one instance, by kind, as change points (time, CPU nodes, GPU nodes)."""

    requests: list[ServedRequest]
    usage: list[tuple[float, int, int]]
    duration_s: float
    end_s: float
    wall_s: float
    nodes: dict[str, str] = field(default_factory=dict)  # node id -> kind, every node seen
    tenant: str = ""
    service: dict[str, Any] = field(default_factory=dict)  # /admin/cluster when the last request ended
    learnt: dict[str, Any] = field(default_factory=dict)  # /admin/learnt then (for the twin; {}: not read)


def prompt_ids(request_id: str, length: int) -> list[int]:
    """`length` token ids, the same for the same request every run."""
    seed = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(TOKEN_LOW, TOKEN_HIGH, size=length).tolist()


def function_name(replica: str) -> str:
    """The model name a trace replica ("smollm2-135m/f003") is registered under ("f003")."""
    return replica.rsplit("/", 1)[-1]


class _Service:
    def __init__(self, session: aiohttp.ClientSession, url: str, admin_token: str) -> None:
        self.session, self.url, self.admin = session, url.rstrip("/"), {"Authorization": f"Bearer {admin_token}"}

    async def call(self, method: str, path: str, what: str, *, expect: int = 200, headers: dict | None = None,
                   **kw: Any) -> Any:
        async with self.session.request(method, self.url + path, headers=headers or self.admin, **kw) as resp:
            body = await resp.text()
            if resp.status != expect:
                raise LiveReplayError(f"{what}: {method} {path} answered {resp.status}: {body[:500]}")
            return json.loads(body) if body else None


async def _set_up(svc: _Service, config: LiveConfig, replicas: list[str]) -> tuple[str, str]:
    """(tenant, its API key)."""
    tenant = config.tenant or f"replay-{secrets.token_hex(4)}"
    await svc.call("POST", "/admin/tenants", "creating the replay's tenant", expect=201, json={"name": tenant})
    key = (await svc.call("POST", f"/admin/tenants/{tenant}/keys", "issuing its key", expect=201,
                          json={"label": "mesh replay --live"}))["key"]
    await svc.call("PUT", f"/admin/tenants/{tenant}/quota", "lifting its quotas", json={
        "models": None, "model_bytes": None, "concurrent_requests": None, "requests_per_s": None, "burst": None})
    if config.emulate is not None:  # emulated nodes: the operator registers each function's model by catalog name
        for replica in replicas:
            await svc.call("POST", f"/admin/tenants/{tenant}/models", f"registering {function_name(replica)}",
                           expect=201, json={"name": function_name(replica), "emulate": config.emulate,
                                             "context_length": config.context_length,
                                             "slo": {"ttft_s": config.slo.ttft_min_s,
                                                     "ttft_s_per_prompt_token": config.slo.ttft_s_per_prompt_token,
                                                     "tpot_s": config.slo.tpot_s}})
        return tenant, key
    digest = await asyncio.to_thread(_sha256, config.model_path)
    for replica in replicas:
        params = {"name": function_name(replica), "sha256": digest, "ttft_s": config.slo.ttft_min_s,
                  "ttft_s_per_prompt_token": config.slo.ttft_s_per_prompt_token, "tpot_s": config.slo.tpot_s,
                  "context_length": config.context_length}
        with config.model_path.open("rb") as f:
            await svc.call("POST", "/v1/models", f"registering {params['name']}", expect=201, params=params,
                                  data=f, headers={"Authorization": f"Bearer {key}",
                                                   "Content-Type": "application/octet-stream"})
    return tenant, key


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def served_requests(workload: Workload, slo: SLO) -> list[ServedRequest]:
    return [ServedRequest(EngineRequest(a.request_id, a.prompt_len, Sampling(max_tokens=a.output_len),
                                        output_len=a.output_len), a.model, a.time_s, slo)
            for a in workload.arrivals]


def completion_body(req: ServedRequest) -> dict[str, Any]:
    """The streamed completion `req` stands for: its prompt as token ids, exactly its output
    length (vLLM's `ignore_eos`), greedy."""
    return {"model": function_name(req.model), "prompt": prompt_ids(req.request_id, req.prompt_len),
            "max_tokens": req.engine_request.sampling.max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


@dataclass(frozen=True)
class LiveConfig:
    url: str
    admin_token: str
    model_path: Path
    context_length: int = 2048  # each model's registered window (the workload's lengths fit it)
    tenant: str = ""  # "" : replay-<8 random hex digits>
    slo: SLO = SLO()
    request_timeout_s: float = 900.0
    progress: bool = True
    emulate: str | None = None  # a catalog name: register emulated models (mesh serve --emulate), not uploads
    body: Callable[[ServedRequest], dict[str, Any]] = completion_body  # each request's streamed completion


async def send_completion(session: aiohttp.ClientSession, url: str, key: str, req: ServedRequest, clock: Any,
                          timeout_s: float, body: dict[str, Any]) -> None:
    """One streamed completion `body` to any OpenAI server at `url`; fills `req` with the
    client's times (clock(): seconds since the workload's start): a 429 rejected, any other
    failure failed."""
    tokens = chunks = 0
    last = math.nan
    try:
        async with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                outcome = Outcome.REJECTED if resp.status == 429 else Outcome.FAILED
                req.end(outcome, clock(), f"HTTP {resp.status}: {text}")
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    req.end(Outcome.FAILED, clock(), f"error event: {event['error'].get('message', event['error'])}")
                    return
                if event.get("choices") and event["choices"][0].get("text"):
                    last = clock()
                    chunks += 1
                    if req.first_token_s is None:
                        req.first_token_s = last
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
        if req.first_token_s is None:
            req.end(Outcome.FAILED, clock(), "the stream ended without a token")
            return
        req.tokens_out = tokens or chunks  # the usage chunk's count; a chunk may carry several tokens
        req.end(Outcome.COMPLETED, last)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        req.end(Outcome.FAILED, clock(), f"{type(exc).__name__}: {exc}")


async def send_at_arrivals(session: aiohttp.ClientSession, requests: list[ServedRequest],
                           route: Callable[[ServedRequest], tuple[str, str] | None], clock: Callable[[], float],
                           timeout_s: float, bar: Any, body: Callable[[ServedRequest], dict[str, Any]]) -> None:
    """Each request sent at its arrival time (open loop) to the (URL, key) `route` gives its
    model; a request `route` has no server for (None) is rejected at once, never sent. `bar`:
    a tqdm bar, one step per request ended."""
    async def one(req: ServedRequest) -> None:
        await asyncio.sleep(max(0.0, req.arrival_s - clock()))
        where = route(req)
        if where is None:
            req.end(Outcome.REJECTED, clock(), "no server for its model")
        else:
            await send_completion(session, where[0], where[1], req, clock, timeout_s, body(req))
        bar.update(1)

    await asyncio.gather(*(one(r) for r in requests))


async def _watch_nodes(svc: _Service, clock: Any, usage: list[tuple[float, int, int]], kinds: dict[str, str]) -> None:
    """Nodes hosting an instance (any state), sampled every POLL_S; change points into `usage`."""
    while True:
        try:
            view = await svc.call("GET", "/admin/cluster", "reading the cluster")
        except (LiveReplayError, aiohttp.ClientError, asyncio.TimeoutError):
            await asyncio.sleep(POLL_S)
            continue
        used = {CPU: 0, GPU: 0}
        for node in view["nodes"]:
            kinds[node["node_id"]] = node["kind"]
            if node["instances"]:
                used[node["kind"]] = used.get(node["kind"], 0) + 1
        point = (clock(), used[CPU], used[GPU])
        if not usage or usage[-1][1:] != point[1:]:
            usage.append(point)
        await asyncio.sleep(POLL_S)


@dataclass(frozen=True)
class ClusterShape:
    """The service's nodes as `/admin/cluster` lists them."""

    kinds: dict[str, str]  # node id -> kind
    memory: dict[str, int]  # kind -> the smallest node's memory for instances
    policy: str = "mesh"  # the placement policy the service runs (`mesh serve --policy`)
    deadlines: str = "eq1"  # its agents' deadline rule (`mesh serve --deadlines`)
    queue_capacity: int = DEFAULT_QUEUE_CAPACITY  # its dispatcher's queue (`mesh serve --queue-capacity`)
    queue_timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S  # (`--queue-timeout`; None: 'slo')
    devices: dict[str, str] = field(default_factory=dict)  # kind -> the device its nodes emulate (mesh serve --emulate)
    admission: str = "reject"  # its default admission choice (`mesh serve --admission`)
    service_cores: tuple[int, ...] = ()  # the service process's cores (off its nodes' where the machine allows)
    park_bytes: int = 0  # the smallest parking budget of its real CPU nodes (0: they park nothing)

    def counts(self) -> tuple[int, int]:
        """(CPU nodes, GPU nodes)."""
        cpu = sum(1 for k in self.kinds.values() if k == CPU)
        return cpu, len(self.kinds) - cpu

    @property
    def mixed(self) -> bool:
        """The mixed rig (`mesh serve --cpu-nodes N --emulate GPU:M`): real CPU nodes beside
        emulated GPU nodes, which run the real model emulated from its architecture."""
        return bool(self.devices) and CPU not in self.devices and self.counts()[0] > 0


async def _shape(svc: _Service) -> ClusterShape:
    view = await svc.call("GET", "/admin/cluster", "reading the cluster (is MESH_ADMIN_TOKEN the service's?)")
    memory: dict[str, int] = {}
    for n in view["nodes"]:
        cap = int(n["memory"]["capacity_bytes"])
        memory[n["kind"]] = min(memory.get(n["kind"], cap), cap)
    rules = {n.get("deadlines") for n in view["nodes"]} - {None}
    parking = [int((n.get("parked") or {}).get("budget_bytes") or 0) for n in view["nodes"]
               if n["kind"] == CPU and not n.get("emulate")]
    dispatcher = view.get("dispatcher") or {}
    return ClusterShape({n["node_id"]: n["kind"] for n in view["nodes"]}, memory, dispatcher.get("policy", "mesh"),
                        rules.pop() if len(rules) == 1 else "eq1",
                        int(dispatcher.get("queue_capacity", DEFAULT_QUEUE_CAPACITY)),
                        dispatcher.get("queue_timeout_s", DEFAULT_QUEUE_TIMEOUT_S),
                        {n["kind"]: n["emulate"] for n in view["nodes"] if n.get("emulate")},
                        dispatcher.get("admission", "reject"),
                        tuple((view.get("control_plane") or {}).get("cores") or ()), min(parking, default=0))


async def cluster_shape(url: str, admin_token: str) -> ClusterShape:
    """The nodes of the service at `url`."""
    async with aiohttp.ClientSession() as session:
        return await _shape(_Service(session, url, admin_token))


async def run_live(workload: Workload, config: LiveConfig) -> LiveRun:
    """Send `workload` to the service at `config.url`; see the module's docstring."""
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector) as session:
        svc = _Service(session, config.url, config.admin_token)
        kinds = dict((await _shape(svc)).kinds)
        tenant, key = await _set_up(svc, config, sorted(workload.models))
        requests = served_requests(workload, config.slo)
        usage: list[tuple[float, int, int]] = []
        bar = tqdm(total=len(requests), unit="req", desc="live", disable=not config.progress, dynamic_ncols=True)
        start = loop.time()

        def clock() -> float:
            return loop.time() - start

        watcher = loop.create_task(_watch_nodes(svc, clock, usage, kinds))

        try:
            await send_at_arrivals(session, requests, lambda _req: (svc.url, key), clock, config.request_timeout_s,
                                   bar, config.body)
        finally:
            watcher.cancel()
            bar.close()
            end = clock()
            service = await _final_view(svc)
            try:  # before the tenant goes: its models' profiles are in it
                learnt = await svc.call("GET", "/admin/learnt", "reading what the service learnt")
            except (LiveReplayError, aiohttp.ClientError):
                learnt = {}
            try:
                await svc.call("DELETE", f"/admin/tenants/{tenant}", "deleting the replay's tenant")
            except (LiveReplayError, aiohttp.ClientError) as exc:  # the figures stand; say what is left behind
                print(f"mesh replay --live: could not delete tenant {tenant}: {exc}")
    if not usage or usage[0][0] > 0:
        usage.insert(0, (0.0, 0, 0))
    return LiveRun(requests, usage, workload.duration_s, max(end, workload.duration_s), end,
                   kinds, tenant, service, learnt)


async def _final_view(svc: _Service) -> dict[str, Any]:
    """What the service says of the run at its end, for the record: the dispatcher's counters
    (placements, preemptions, warm-ups, rejections by reason), its event-loop lag over its
    life (`control_plane`: p50/p99/max, and the part its own work caused) and per node its
    busy fraction, iterations and its instances' learnt time factors. Empty if it cannot be
    read."""
    try:
        view = await svc.call("GET", "/admin/cluster", "reading the cluster at the end")
    except (LiveReplayError, aiohttp.ClientError):
        return {}
    nodes = {n["node_id"]: {"kind": n["kind"], "busy_fraction": n.get("busy_fraction"),
                            "iterations": n.get("iterations"),
                            "time_factors": [i.get("time_factors") for i in n.get("instances", [])]}
             for n in view.get("nodes", [])}
    return {"dispatcher": view.get("dispatcher"), "control_plane": view.get("control_plane"), "nodes": nodes}


def cold_start_bytes_per_s(weight_bytes: int, load_s: float) -> float:
    """The simulated cold start's bandwidth that takes `load_s` for `weight_bytes`."""
    if not (load_s > 0 and math.isfinite(load_s)):
        raise ValueError(f"the cold start must be a positive number of seconds, got {load_s}")
    return weight_bytes / load_s
