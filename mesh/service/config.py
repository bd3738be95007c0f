"""`mesh serve` settings: defaults, then a config file (TOML or JSON), then the command line.

The admin token comes from $MESH_ADMIN_TOKEN, else the config file's `admin_token`. Without
one, the admin routes answer 401 and a warning says so. The metrics token (for Prometheus:
`/metrics` takes it or the admin token) comes from $MESH_METRICS_TOKEN, else `metrics_token`.

Tenant quota defaults (mesh.policy.quota): quota_models (default 100), quota_model_gb (256),
quota_concurrent_requests (1024), quota_requests_per_s (1000), quota_burst (2000). They are
finite, so that one tenant of a shared service cannot take all of it by default, and generous,
so that a benchmark or a demo never meets them; "none" (`--quota-models none`, or the string in
the config file) is no limit. The operator sets a tenant's own with PUT
/admin/tenants/{name}/quota.

Config file keys (all optional): host, port, data_dir, admin_token, allowed_dir, max_body_mb,
max_upload_mb, demo, keep_alive_s, cpu_memory_gb, cpu_nodes, node_cores, remote_agents, ray, ray_autoscale,
weights_plan, drain_timeout_s, heartbeat_timeout_s, profile_dir, log_level, tls_cert, tls_key, metrics_token,
quota_models, quota_model_gb, quota_concurrent_requests, quota_requests_per_s, quota_burst,
deadlines, policy, cold_start_s, exact_moves, prepare_formats, emulate, emulate_weights, watchdog_min_s (and
the HTTP limits: http_head_timeout_s, http_body_timeout_s, max_connections,
max_connections_per_client, max_uploads_per_tenant, max_uploads).

`watchdog_min_s` (default 30; `mesh serve --watchdog-min-s`): the node agents' engine
watchdog fails an instance whose iteration runs past max(this, 20 x its predicted time)
(mesh.node.runtime.hung_bound_s): its worker is killed and restarted on demand, and its
requests are placed again, as evictions. Lower it to see a hung worker caught sooner (the
tests do); on a busy shared machine a low floor can take a slow iteration for a hung one.

`emulate` ("DEVICE:N,...", e.g. "xeon-6462c:4,a100-80gb:4"; `mesh serve --emulate`): instead of
this machine's nodes, N emulated nodes of each profiled device (mesh.engines.emulation): real
node agents whose engines keep the device's profile times on the wall clock. They run only
emulated models, which the operator registers by catalog name (POST
/admin/tenants/{tenant}/models {"name", "emulate": "llama-2-7b"}). The cold start then defaults
to the replay's (the weights' load, no fixed start-up). With cpu_nodes given too it is the
mixed rig instead: this machine's CPU nodes beside emulated GPU nodes, which run its real
models emulated from their architecture (docs/service.md, "The mixed rig"; cold start 7.5 s).

`emulate_weights` (default "cached"; `mesh serve --emulate-weights`): where emulated nodes'
loads get their weights, as `mesh replay --weights` models it (mesh.control.load_timing):
"cached" (host memory over PCIe), "ssd", "host", "multicast" (the parameter pool's host copy
and running instances over a 200 Gbit/s network, `weights_plan`'s plan) or "multicast-live"
(multicast, and a new instance serves before its last layer: ZigZag with a full instance on
another node, mesh.node.lending; docs/multicast.md, "Live scaling in `mesh serve`").

`prepare_formats` (default true; `mesh serve --no-prepare` turns it off): prepare each
registered model's format for the other kind of node in the background (a GGUF converted to
a Hugging Face folder for vLLM on GPU nodes; mesh.service.preparation), so the dispatcher can
run it on either kind.

`policy` (default `mesh`): the cluster dispatcher's placement policy, one of those `mesh
replay` evaluates (mesh.control.schedulers): mesh, sllm, sllm+cpu, mesh-no-share, mesh-no-cpu,
mesh-no-defrag. `cold_start_s` (default 7.5, the demo model measured on a 2-core node): the
start-up of a new instance besides moving its weights, which validation counts in a
request's TTFT. `exact_moves` (default false): CPU instances compute so that a stream
moved to another node (preemption, eviction) continues exactly as it would have, at about
2x the compute (mesh.engines.openvino_engine.EXACT_RECOMPUTE); off, a moved stream loses,
repeats and reorders nothing but may continue differently at a near-tie.

`deadlines` (default `eq1`, the paper's Eq. 1, as `mesh replay` evaluates by default): when
a request's tokens after the first are due on the node agents the service starts
(mesh.policy.slo.DeadlineRule): `eq1` from its arrival, or `pace` from its first token, so
admission protects the per-token pace clients measure at the price of turning more
requests away (docs/evaluation.md, "Live replay").

`ray` ("auto" or a Ray address; docs/cluster.md): run the node agents on the machines of a
Ray cluster, one per Ray node (and per GPU), instead of on this machine; `ray_autoscale`:
ask Ray's autoscaler for the nodes Mesh uses and release idle ones.
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from mesh.control.load_timing import MODES as WEIGHTS_MODES
from mesh.policy.queueing import DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_TIMEOUT_S
from mesh.policy.quota import Quota, QuotaValueError, check_overrides
from mesh.policy.slo import DeadlineRule
from mesh.service.limits import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT


class ConfigError(ValueError):
    """The config file or a setting is wrong; the message says which and why."""


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path | None = None  # None: mesh.paths.data_dir()
    admin_token: str | None = None
    allowed_dir: Path | None = None  # registration by path is off without it
    max_body_mb: float = 8.0
    max_upload_mb: float = 16384.0
    demo: bool = False
    keep_alive_s: float = 60.0
    cpu_memory_gb: float | None = None  # None: half the machine's memory, split over the CPU nodes
    cpu_nodes: int = 1  # CPU node agents on this machine (each a node of the weights plane)
    # the local nodes' core sets, "0;1" or "cpu-0=0-3;cpu-1=4-7;service=8" (mesh.control.supervisor.parse_node_cores);
    # None: split among them (core_shares) when there are two or more
    node_cores: str | None = None
    weights_plan: str = "binomial"  # multicast plan for scale-outs: naive, chain, binomial
    remote_agents: list[str] = field(default_factory=list)  # "ID=HOST:PORT" of agents on other machines
    ray: str | None = None  # "auto" or a Ray cluster's address: node agents on its nodes (docs/cluster.md)
    ray_autoscale: bool = False  # ask Ray's autoscaler for the nodes Mesh uses, release idle ones
    drain_timeout_s: float = 30.0
    heartbeat_timeout_s: float = 10.0
    profile_dir: Path | None = None  # calibration profiles, <dir>/<model uid>.json
    log_level: str = "WARNING"
    tls_cert: Path | None = None  # PEM certificate chain: serve HTTPS (with tls_key)
    tls_key: Path | None = None  # its PEM private key
    metrics_token: str | None = None  # what Prometheus sends to /metrics (the admin token works too)
    # per-tenant defaults (None: no limit); finite by default, for a shared service
    quota_models: int | None = 100
    quota_model_gb: float | None = 256.0  # GiB of registered model weights
    quota_concurrent_requests: int | None = 1024
    quota_requests_per_s: float | None = 1000.0
    quota_burst: int | None = 2000  # None: one second of quota_requests_per_s
    deadlines: DeadlineRule = DeadlineRule.EQ1  # deadline rule of the local agents (mesh.policy.slo)
    policy: str = "mesh"  # the dispatcher's placement policy (mesh.control.schedulers)
    # a new instance's start-up besides its weights (mesh.perf.load_times.ColdStart); None: 7.5 s,
    # or 0 under `emulate` (the replay's cold start: the weights' load alone)
    cold_start_s: float | None = None
    exact_moves: bool = False  # CPU instances recompute moved streams exactly, at ~2x compute
    prepare_formats: bool = True  # prepare each model's format for the other kind of node (mesh.service.preparation)
    queue_capacity: int = DEFAULT_QUEUE_CAPACITY  # requests the dispatcher's waiting queue holds (mesh.policy.queueing)
    # seconds a request may wait for capacity; None ("slo"): until it can no longer meet its SLO
    queue_timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S
    # a request that can no longer meet its SLO (mesh.policy.dispatch_rules.ADMISSIONS), for models without
    # their own choice; None: "queue" with demo (a benchmark user expects queueing), else "reject"
    admission: str | None = None
    http_head_timeout_s: float = 10.0  # a request head, and the idle time between requests (mesh.service.limits)
    http_body_timeout_s: float = 60.0  # a JSON body
    max_connections: int = MAX_CONNECTIONS  # open HTTP connections in all (mesh.service.limits)
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT  # ...from one client address
    max_uploads_per_tenant: int = 2  # uploads one tenant may stream at once
    max_uploads: int = 8  # uploads all tenants together may stream at once (disk and CPU for their sha256)
    watchdog_min_s: float = 30.0  # the engine watchdog's floor (mesh.node.runtime.HUNG_MIN_S)
    # "DEVICE:N,...": emulated nodes instead of this machine's (mesh.engines.emulation; docs/service.md)
    emulate: str | None = None
    # emulated loads' weights (mesh.control.load_timing.MODES, or "cached": host memory, ColdStart's)
    emulate_weights: str = "cached"
    # derived, not a key: emulate with cpu_nodes given too is the mixed rig, this machine's CPU nodes
    # beside emulated GPU nodes that emulate its real models (mesh.engines.emulation)
    mixed_rig: bool = False

    @property
    def default_quota(self) -> Quota:
        return Quota(self.quota_models, None if self.quota_model_gb is None else int(self.quota_model_gb * 2**30),
                     self.quota_concurrent_requests, self.quota_requests_per_s, self.quota_burst)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)


_PATHS = {"data_dir", "allowed_dir", "profile_dir", "tls_cert", "tls_key"}
NO_LIMIT = "none"  # a quota setting's value for no limit (the config file has no null)


def quota_value(kind: type) -> Callable[[str], Any]:
    """An argparse type for a --quota-* option: a number of `kind`, or NO_LIMIT."""
    def parse(text: str) -> Any:
        return NO_LIMIT if text.strip().lower() == NO_LIMIT else kind(text)
    parse.__name__ = kind.__name__
    return parse


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text) if p.suffix != ".json" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the config must be a table/object of settings")
    known = {f.name for f in fields(ServeConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{p}: unknown settings {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return data


def build_config(file_values: dict[str, Any], cli_values: dict[str, Any]) -> ServeConfig:
    """Merge defaults < config file < command line (None on the command line: not given)."""
    config = ServeConfig()
    config.mixed_rig = "cpu_nodes" in file_values or cli_values.get("cpu_nodes") is not None  # kept if emulate
    for source in (file_values, {k: v for k, v in cli_values.items() if v is not None}):
        for key, value in source.items():
            if key in _PATHS and value is not None:
                value = Path(value).expanduser()
            if key.startswith("quota_") and isinstance(value, str) and value.lower() == NO_LIMIT:
                value = None
            setattr(config, key, value)
    env_token = os.environ.get("MESH_ADMIN_TOKEN")
    if env_token:
        config.admin_token = env_token
    env_metrics = os.environ.get("MESH_METRICS_TOKEN")
    if env_metrics:
        config.metrics_token = env_metrics
    _check(config)
    return config


def _check(c: ServeConfig) -> None:
    if not isinstance(c.port, int) or not 0 <= c.port <= 65535:
        raise ConfigError(f"port must be 0-65535, got {c.port!r}")
    for name in ("max_body_mb", "max_upload_mb", "keep_alive_s", "drain_timeout_s", "heartbeat_timeout_s",
                 "http_head_timeout_s", "http_body_timeout_s"):
        value = getattr(c, name)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{name} must be a positive number, got {value!r}")
    for name in ("max_connections", "max_connections_per_client", "max_uploads_per_tenant", "max_uploads"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer of at least 1, got {value!r}")
    if isinstance(c.cpu_nodes, bool) or not isinstance(c.cpu_nodes, int) or not 1 <= c.cpu_nodes <= 64:
        raise ConfigError(f"cpu_nodes must be an integer from 1 to 64, got {c.cpu_nodes!r}")
    if c.node_cores is not None and (not isinstance(c.node_cores, str) or not c.node_cores.strip()):
        raise ConfigError(f"node_cores must be core sets like '0;1' or 'cpu-0=0-3;cpu-1=4-7', got {c.node_cores!r}")
    if not isinstance(c.remote_agents, list):
        raise ConfigError(f"remote_agents must be a list of 'ID=HOST:PORT', got {c.remote_agents!r}")
    from mesh.control.remote_agents import parse_remote

    ids = []
    for entry in c.remote_agents:
        try:
            ids.append(parse_remote(str(entry))[0])
        except ValueError as exc:
            raise ConfigError(f"remote_agents: {exc}") from exc
    local = {f"cpu-{i}" for i in range(c.cpu_nodes)}
    clash = sorted({i for i in ids if ids.count(i) > 1 or i in local})
    if clash:
        raise ConfigError(f"remote agent ids must be unique and differ from the local nodes "
                          f"cpu-0..cpu-{c.cpu_nodes - 1}: {', '.join(clash)}")
    if c.ray is not None and (not isinstance(c.ray, str) or not c.ray.strip()):
        raise ConfigError(f"ray must be 'auto' or a Ray cluster's address (HOST:PORT), got {c.ray!r}")
    if c.ray_autoscale and c.ray is None:
        raise ConfigError("ray_autoscale needs ray (--ray auto or --ray ADDRESS)")
    try:
        c.deadlines = DeadlineRule.parse(c.deadlines)
    except ValueError as exc:
        raise ConfigError(f"deadlines: {exc}") from None
    if isinstance(c.queue_capacity, bool) or not isinstance(c.queue_capacity, int) or c.queue_capacity < 1:
        raise ConfigError(f"queue_capacity must be an integer >= 1, got {c.queue_capacity!r}")
    if c.queue_timeout_s == "slo":
        c.queue_timeout_s = None
    if c.queue_timeout_s is not None and (isinstance(c.queue_timeout_s, bool)
                                          or not isinstance(c.queue_timeout_s, (int, float)) or c.queue_timeout_s < 0):
        raise ConfigError(f"queue_timeout_s must be a number of seconds >= 0 or 'slo', got {c.queue_timeout_s!r}")
    from mesh.control.schedulers import POLICIES
    from mesh.policy.dispatch_rules import ADMISSIONS, ADMIT_QUEUE, ADMIT_REJECT

    if c.admission is None:
        c.admission = ADMIT_QUEUE if c.demo else ADMIT_REJECT
    if c.admission not in ADMISSIONS:
        raise ConfigError(f"admission must be one of {', '.join(ADMISSIONS)}, got {c.admission!r}")

    if c.policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {c.policy!r}")
    if not isinstance(c.exact_moves, bool):
        raise ConfigError(f"exact_moves must be true or false, got {c.exact_moves!r}")
    c.mixed_rig = bool(c.emulate) and c.mixed_rig
    if c.cold_start_s is None:
        c.cold_start_s = 0.0 if c.emulate and not c.mixed_rig else 7.5
    if isinstance(c.cold_start_s, bool) or not isinstance(c.cold_start_s, (int, float)) or c.cold_start_s < 0:
        raise ConfigError(f"cold_start_s must be a number of seconds >= 0, got {c.cold_start_s!r}")
    if not isinstance(c.prepare_formats, bool):
        raise ConfigError(f"prepare_formats must be true or false, got {c.prepare_formats!r}")
    if c.emulate is not None:
        from mesh.engines.emulation import emulated_nodes
        from mesh.perf.profile import ProfileError

        if c.demo and not c.mixed_rig:
            raise ConfigError("emulate runs emulated models only: it cannot serve the demo model (drop --demo, or "
                              "give cpu_nodes too for the mixed rig: this machine's CPU nodes beside emulated GPU "
                              "nodes)")
        if c.ray is not None or c.remote_agents:
            raise ConfigError("emulate runs its own nodes on this machine: it cannot be combined with ray or "
                              "remote_agents")
        try:
            nodes, _devices = emulated_nodes(str(c.emulate))
        except (ValueError, ProfileError) as exc:
            raise ConfigError(f"emulate: {exc}") from None
        if c.mixed_rig and any(n.kind != "gpu" for n in nodes):
            raise ConfigError(f"emulate {c.emulate!r} with cpu_nodes is the mixed rig: its CPU nodes are this "
                              "machine's, so it emulates GPU devices only (e.g. --cpu-nodes 2 --emulate a100-80gb:1)")
    if c.emulate_weights not in ("cached", *WEIGHTS_MODES):
        raise ConfigError(f"emulate_weights must be cached, {', '.join(WEIGHTS_MODES)}, got {c.emulate_weights!r}")
    if c.weights_plan not in ("naive", "chain", "binomial"):
        raise ConfigError(f"weights_plan must be naive, chain or binomial, got {c.weights_plan!r}")
    if isinstance(c.watchdog_min_s, bool) or not isinstance(c.watchdog_min_s, (int, float)) or not c.watchdog_min_s > 0:
        raise ConfigError(f"watchdog_min_s must be a number of seconds > 0, got {c.watchdog_min_s!r}")
    if c.cpu_memory_gb is not None and c.cpu_memory_gb <= 0:
        raise ConfigError(f"cpu_memory_gb must be positive, got {c.cpu_memory_gb!r}")
    if c.allowed_dir is not None and not c.allowed_dir.is_dir():
        raise ConfigError(f"allowed_dir {c.allowed_dir} is not a folder")
    if (c.tls_cert is None) != (c.tls_key is None):
        raise ConfigError("HTTPS needs both tls_cert and tls_key (--tls-cert and --tls-key)")
    for name in ("tls_cert", "tls_key"):
        path = getattr(c, name)
        if path is not None and not path.is_file():
            raise ConfigError(f"{name} {path} is not a file")
    for name in ("admin_token", "metrics_token"):
        value = getattr(c, name)
        if value is not None and (not isinstance(value, str) or len(value) < 1):
            raise ConfigError(f"{name} must be a non-empty string")
    if c.quota_model_gb is not None and (isinstance(c.quota_model_gb, bool) or not isinstance(
            c.quota_model_gb, (int, float)) or c.quota_model_gb < 0):
        raise ConfigError(f"quota_model_gb must be a number of GiB, at least 0, got {c.quota_model_gb!r}")
    for quota in ("models", "concurrent_requests", "requests_per_s", "burst"):
        try:
            check_overrides({quota: getattr(c, f"quota_{quota}")})
        except QuotaValueError as exc:
            raise ConfigError(f"quota_{quota}: {exc}") from exc
