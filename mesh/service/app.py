"""The control service: aiohttp app and `run_service` (what `mesh serve` runs); the state its
routes share is mesh.service.service_state.

Routes: mesh.service.routes_openai (serving), routes_models (tenants' models), routes_admin
(operators), plus /healthz and /metrics here. One middleware turns every error into the
OpenAI format, refuses new work while draining, and counts responses.

Time: the service reads only the event loop's clock. OpenAI's `created` fields need Unix
time; the registry's database clock gives it once at start, and `Service.unix_now()`
advances it with the loop clock.

Shutdown (SIGINT or SIGTERM): new requests get 503 while open generations finish (up to
`drain_timeout_s`), then the HTTP server closes and the node agents are stopped, each step
within its bound (HTTP_CLOSE_S, CLUSTER_STOP_S; agents still running then are killed). A
second signal skips the drain; a signal during the stop cuts it (agents killed, exit at
once). Past the whole bound a thread ends the process (`_Signals`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import ssl
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from aiohttp import web

from mesh.service import errors
from mesh.service.auth import admin_token_ok, bearer_token
from mesh.service.config import ServeConfig
from mesh.service.errors import ApiError
from mesh.service.limits import listen
from mesh.service.prometheus import CONTENT_TYPE, ServiceMetrics
from mesh.service.registry import Registry
from mesh.service.service_state import ARRIVAL, SERVICE, Service, service_of

if TYPE_CHECKING:
    from mesh.policy.node_spec import NodeSpec

log = logging.getLogger(__name__)

# The stop after the drain, step by step (_stop_step): each gets this long, then the next
# runs; node agents still running then are killed. HTTP: aiohttp's own close waits up to its
# shutdown_timeout twice (for a handler to finish, then for it to end once cancelled); the
# agents: LocalAgent.stop's shutdown call, wait, SIGTERM and SIGKILL, about 18 s at worst.
HTTP_CLOSE_S = 15.0
CLUSTER_STOP_S = 30.0
EXIT_GRACE_S = 10.0  # then asyncio.run's own end (its tasks cancelled, its threads joined)
HURRY_S = 5.0  # a signal during the stop: the process is gone within this
CANCEL_GRACE_S = 1.0  # a step that overran: how long its cancellation may take before the stop goes on
# Signals less than this apart count as one: a parent that dies with several threads may send
# its PR_SET_PDEATHSIG once per thread as they exit (mesh.bench.serve_process), which must not
# read as an operator's second and third signal (skip the drain, cut the stop).
SIGNAL_BURST_S = 0.5
UNGUARDED = ("/healthz", "/health", "/metrics")


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    svc = request.app[SERVICE]
    request[ARRIVAL] = asyncio.get_running_loop().time()
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    status = 500
    try:
        if svc.draining and request.path not in UNGUARDED:
            raise errors.shutting_down()
        response = await handler(request)
        status = response.status
        return response
    except ApiError as exc:
        status = exc.status
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            status = exc.status
            raise
        err = errors.from_http_exception(exc)
        status = err.status
        return err.response()
    except UnicodeError:  # undecodable text in a path or query: the input's fault
        err = errors.bad_request("The request holds invalid Unicode.", None, "invalid_encoding")
        status = err.status
        return err.response()
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    except Exception:  # noqa: BLE001 - a bug: log it, answer in the OpenAI format
        log.exception("unhandled error on %s %s", request.method, request.path)
        err = errors.internal_error()
        return err.response()
    finally:
        svc.metrics.http.labels(route, str(status)).inc()


async def healthz(request: web.Request) -> web.Response:
    svc = service_of(request)
    nodes = {n["node_id"]: n["state"] for n in svc.control.view()["nodes"]}
    ok = svc.control.healthy() and not svc.draining
    status = "draining" if svc.draining else ("ok" if ok else "degraded")
    return web.json_response({"status": status, "nodes": nodes}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text; needs the metrics token or the admin token (it names every tenant and model)."""
    svc = service_of(request)
    token = bearer_token(request.headers.get("Authorization"))
    if not (admin_token_ok(token, svc.config.metrics_token) or admin_token_ok(token, svc.config.admin_token)):
        raise errors.metrics_unauthorized()
    return web.Response(body=svc.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def build_app(service: Service) -> web.Application:
    from mesh.service import openapi, routes_admin, routes_models, routes_openai

    app = web.Application(middlewares=[error_middleware], client_max_size=service.config.max_body_bytes)
    app[SERVICE] = service
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/health", healthz)  # the name vLLM, SGLang and TGI answer (load generators check it)
    app.router.add_get("/metrics", metrics)
    routes_openai.add_routes(app)
    routes_models.add_routes(app)
    routes_admin.add_routes(app)
    openapi.add_routes(app)
    return app


# ---- running it ------------------------------------------------------------------------------

class _CannotStart(Exception):
    """Why `mesh serve` cannot start (said on stderr) and its exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _tls_context(config: ServeConfig) -> ssl.SSLContext | None:
    """The server's TLS context from --tls-cert/--tls-key, if given."""
    if config.tls_cert is None:
        return None
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        tls.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:  # SSLError: not PEM, or the key is not the certificate's
        raise _CannotStart(f"mesh serve: cannot use the TLS certificate {config.tls_cert} with the key "
                           f"{config.tls_key}: {exc}", 1) from None
    return tls


def _open_registry(data_dir: Path) -> Registry:
    """The data folder (this user's only) and its registry, swept of orphaned uploads."""
    from mesh.service.uploads import sweep_orphans

    os.umask(0o077)  # uploads, the registry, node copies and the agents' files: this user's only
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data_dir.chmod(0o700)  # also a folder an older version made with the default umask
    registry = Registry(data_dir / "registry.sqlite3")
    for orphan in sweep_orphans(data_dir / "uploads", [m.path for m in registry.models() if m.owned_file]):
        log.warning("removed %s: a partial upload, or an upload no model names (left by a crash)", orphan)
    return registry


def _local_nodes(config: ServeConfig, memory: int | None) -> tuple[list[NodeSpec], dict[str, str],
                                                                  dict[str, tuple[int, ...]]]:
    """The nodes this machine runs (none with --ray: agents on its nodes), the devices the
    emulated ones emulate (node id -> device, mesh serve --emulate), and the cores of each
    computing node and of the service (mesh.control.supervisor.core_shares)."""
    from mesh.control.supervisor import SERVICE, core_shares, detect_local_nodes, parse_node_cores
    from mesh.control.vllm_nodes import CPU_NODE_ID

    nodes = detect_local_nodes(memory, config.cpu_nodes) if config.ray is None else []  # Ray: agents on its nodes
    emulated: dict[str, str] = {}  # node id -> the device it emulates (mesh serve --emulate)
    if config.emulate:
        from mesh.engines.emulation import emulated_nodes

        emulated_specs, emulated = emulated_nodes(config.emulate)
        if config.mixed_rig and any(n.kind != "cpu" for n in nodes):  # vLLM's nodes would share the GPU kind
            raise _CannotStart(f"mesh serve: the mixed rig (--cpu-nodes with --emulate) emulates the GPU nodes, so it "
                               f"cannot also run {', '.join(n.node_id for n in nodes if n.kind != 'cpu')} (drop "
                               f"--vllm-cpu)", 2)
        nodes = [*nodes, *emulated_specs] if config.mixed_rig else emulated_specs
    # the local nodes that compute on this machine's cores split them as they split its memory
    # (each one a machine): OpenVINO agents and the vLLM-on-CPU agent, not emulated ones
    computing = [n.node_id for n in nodes
                 if n.node_id not in emulated and (n.kind == "cpu" or n.node_id == CPU_NODE_ID)]
    if config.node_cores:
        try:
            cores = parse_node_cores(config.node_cores, computing)
        except ValueError as exc:
            raise _CannotStart(f"mesh serve: {exc}", 2) from None
    else:
        cores = core_shares(computing) if len(computing) > 1 else {}
    if cores.get(SERVICE):  # the service, its emulated agents and its conversions stay off the nodes' cores
        os.sched_setaffinity(0, set(cores[SERVICE]))
    if cores:
        log.info("cores: %s", ", ".join(f"{k} {','.join(map(str, v))}" for k, v in cores.items()))
    return nodes, emulated, cores


def _join_ray(config: ServeConfig, control: Any, memory: int | None, cluster_secret: Any) -> tuple[Any, Any]:
    """With --ray: the Ray cluster's membership (its agents) and, with --ray-autoscale, its autoscaler."""
    if config.ray is None:
        return None, None
    from mesh.ray.actor import AgentLaunch
    from mesh.ray.membership import RayMembership, connect

    try:
        connect(config.ray)
    except Exception as exc:  # noqa: BLE001 - ConnectionError, ValueError...: say why and stop
        raise _CannotStart(f"mesh serve: cannot join the Ray cluster at {config.ray}: {exc}", 1) from None
    launch = AgentLaunch(log_level=config.log_level, deadlines=config.deadlines,
                         watchdog_min_s=config.watchdog_min_s, memory_bytes=memory)  # no secret: Ray keeps it
    membership = RayMembership(control, launch, cluster_secret)
    if not config.ray_autoscale:
        return membership, None
    from mesh.ray.node_autoscaler import RayAutoscaler

    return membership, RayAutoscaler(control, membership)


def _warn_of_config(config: ServeConfig, service: Service) -> None:
    """Say what the configuration leaves off or short: admin routes, /metrics, file descriptors."""
    if not config.admin_token:
        print("mesh serve: no admin token (set MESH_ADMIN_TOKEN or admin_token in --config): admin routes are off",
              file=sys.stderr)
    if not config.admin_token and not config.metrics_token:
        print("mesh serve: no metrics token (set MESH_METRICS_TOKEN or metrics_token in --config): /metrics is off",
              file=sys.stderr)
    fds = service.limits.fit_fd_limit()
    if fds < service.limits.max_connections:
        print(f"mesh serve: this process may open {fds} files, fewer than max_connections "
              f"({service.limits.max_connections}); lower max_connections or raise `ulimit -n`", file=sys.stderr)


class _Signals:
    """SIGINT and SIGTERM while the service runs. The first stops it: the drain, then the stop.
    A further one (not in the same burst, SIGNAL_BURST_S) cuts the wait it arrives in: during
    the drain, the drain (the stop that follows
    still shuts the agents down); during the stop, the stop (the agents are killed and the
    process exits). A thread ends the process (and kills its agents) should its exit overrun
    the bound the first signal sets (the drain, the stop's steps, EXIT_GRACE_S) or, after a
    signal that cut the stop, HURRY_S: nothing awaited on the stop path, nor a task that ignores
    its cancellation, nor a thread the event loop waits for at exit, can keep it alive. The
    handlers stay the service's until its caller has stopped it (`remove`)."""

    def __init__(self, service: Service, kill_agents: Callable[[], None]) -> None:
        self.service = service
        self.kill_agents = kill_agents
        self.received = 0
        self.stopping = False  # the drain is over: a signal now cuts the stop
        self.stop = asyncio.Event()  # the first signal
        self.hurry = asyncio.Event()  # a signal during the stop
        self._timer: threading.Timer | None = None
        self._loop = asyncio.get_running_loop()
        self._last = float("-inf")  # loop time of the last signal
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self._on_signal)

    def remove(self) -> None:
        """The service has stopped: the handlers go back to the caller, and the process (whose
        main `run_service` is) has EXIT_GRACE_S left to exit."""
        for sig in (signal.SIGINT, signal.SIGTERM):  # the service's while it runs, not its caller's afterwards
            self._loop.remove_signal_handler(sig)
        if not self.hurry.is_set():
            self._exit_within(EXIT_GRACE_S)

    def _on_signal(self) -> None:
        now = self._loop.time()
        burst, self._last = now - self._last < SIGNAL_BURST_S, now
        if burst:
            return  # the same request again (see SIGNAL_BURST_S)
        self.received += 1
        if self.received == 1:
            self.stop.set()
            self._exit_within(self.service.config.drain_timeout_s + HTTP_CLOSE_S + CLUSTER_STOP_S + EXIT_GRACE_S)
        elif not self.stopping:
            print("mesh serve: a second signal: not waiting for the open requests", file=sys.stderr)
            self.service.idle.set()
        else:
            print("mesh serve: another signal: the node agents are killed and the service exits now", file=sys.stderr)
            self.hurry.set()
            self._exit_within(HURRY_S)

    def _exit_within(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(seconds, self._force_exit, (seconds,))
        self._timer.daemon = True  # a process that exits in time does not wait for it
        self._timer.start()

    def _force_exit(self, seconds: float) -> None:
        print(f"mesh serve: the stop overran its bound ({seconds:.0f} s); the node agents are killed and the "
              f"service exits now", file=sys.stderr, flush=True)
        try:
            self.kill_agents()
        finally:
            os._exit(1)

    async def drain(self) -> None:
        """New requests get 503 while the open ones finish, up to drain_timeout_s."""
        service = self.service
        service.draining = True
        if service.generating:
            timeout_s = service.config.drain_timeout_s
            print(f"mesh serve: draining {service.generating} open requests (up to {timeout_s:.0f} s)",
                  file=sys.stderr)
            try:
                await asyncio.wait_for(service.idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                print("mesh serve: drain timed out; closing the remaining requests", file=sys.stderr)
        self.stopping = True


async def _stop(runner: web.AppRunner, control: Any, membership: Any, autoscaler: Any,
                hurry: asyncio.Event | None = None) -> bool:
    """Close HTTP, then stop the cluster, each step within its bound (or until `hurry` is
    set); node agents still running after are killed. True if every step ended in time."""
    closed = await _stop_step("closing HTTP", runner.cleanup(), HTTP_CLOSE_S, hurry)
    stopped = await _stop_step("stopping the node agents", _stop_cluster(control, membership, autoscaler),
                               CLUSTER_STOP_S, hurry)
    if not stopped:
        control.kill_agents()  # none outlives the service
    return closed and stopped


async def _stop_step(what: str, work: Awaitable[None], timeout_s: float, hurry: asyncio.Event | None) -> bool:
    """Run one step of the stop within `timeout_s`, or until `hurry` is set; True if it ended
    in time without an error. One that did not is cancelled (and left, if it ignores that:
    the process exits without it)."""
    task = asyncio.ensure_future(work)
    cut = asyncio.ensure_future(hurry.wait() if hurry is not None else asyncio.Event().wait())
    try:
        await asyncio.wait({task, cut}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        cut.cancel()
    if task.done():
        if not task.cancelled() and task.exception() is None:
            return True
        log.error("%s failed", what, exc_info=None if task.cancelled() else task.exception())
        return False
    if hurry is None or not hurry.is_set():
        print(f"mesh serve: {what} did not end within {timeout_s:.0f} s; going on", file=sys.stderr)
    task.cancel()
    await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    return False


async def run_service(config: ServeConfig, ready: Any = print) -> int:
    """Start everything, print the ready line, serve until SIGINT/SIGTERM, drain, stop. The
    process's main (`mesh serve`): once it is signalled, the process ends within a bound (`_Signals`)."""
    from mesh.control.load_timing import WeightsConfig
    from mesh.control.remote_agents import RemoteAgent, parse_remote
    from mesh.control.supervisor import AgentHandle, AgentSettings, LocalAgent
    from mesh.control.weights_plane import WeightsPlane, WeightsSettings
    from mesh.policy.node_spec import NodeSpec
    from mesh.service.cluster_control import ClusterControl, ClusterSettings
    from mesh.service.demo_mode import ensure_demo, ready_line
    from mesh.service.preparation import FormatPreparer

    loop = asyncio.get_running_loop()
    try:
        tls = _tls_context(config)
    except _CannotStart as exc:
        print(exc, file=sys.stderr)
        return exc.status
    data_dir = config.data_dir
    registry = _open_registry(data_dir)
    memory = int(config.cpu_memory_gb * 2**30) if config.cpu_memory_gb else None
    weights_token = os.environ.get("MESH_WEIGHTS_TOKEN") or secrets.token_urlsafe(24)  # remote agents need it set
    cluster_secret = None
    if config.ray is not None:  # Ray agents derive their tokens from the cluster secret, as the service does here
        from mesh.ray.actor import cluster_secret as read_secret
        from mesh.ray.actor import weights_token as derived_weights_token

        cluster_secret = read_secret(create=True)
        weights_token = derived_weights_token(cluster_secret)
    from mesh.modelfiles.demo import models_dir

    # Where registered models can be: uploads and node copies (data folder), --allowed-dir, the demo cache;
    # and the calibration profiles agents read (--profile-dir). Agents open no file elsewhere.
    roots = (str(data_dir), *([str(config.allowed_dir)] if config.allowed_dir else []), str(models_dir()),
             *([str(config.profile_dir)] if config.profile_dir else []))
    try:
        nodes, emulated, cores = _local_nodes(config, memory)
    except _CannotStart as exc:
        print(exc, file=sys.stderr)
        registry.close()
        return exc.status
    settings = ClusterSettings(
        policy=config.policy, cold_start_s=config.cold_start_s, keep_alive_s=config.keep_alive_s,
        exact_moves=config.exact_moves, queue_capacity=config.queue_capacity, queue_timeout_s=config.queue_timeout_s,
        admission=config.admission,
        emulated_weights=(WeightsConfig(config.emulate_weights, plan=config.weights_plan)
                          if config.emulate and config.emulate_weights != "cached" else None),
        profile_dir=str(config.profile_dir) if config.profile_dir else None,
        agent=AgentSettings(heartbeat_timeout_s=config.heartbeat_timeout_s, log_level=config.log_level,
                            weights_root=str(data_dir / "nodes"), weights_token=weights_token,
                            models_roots=roots, deadlines=config.deadlines, cores=cores, emulate=emulated,
                            watchdog_min_s=config.watchdog_min_s))
    remote = dict(parse_remote(r) for r in config.remote_agents)
    nodes += [NodeSpec(node_id, "cpu", 0) for node_id in remote]  # kind and memory: from the agent's hello
    if remote and not os.environ.get("MESH_WEIGHTS_TOKEN"):
        print("mesh serve: MESH_WEIGHTS_TOKEN is not set: remote agents started with one will refuse the models "
              "this server sends them", file=sys.stderr)

    def make_agent(spec: NodeSpec, *callbacks: Any) -> AgentHandle:
        if spec.node_id in remote:
            return RemoteAgent(spec, remote[spec.node_id], os.environ.get("MESH_AGENT_TOKEN"), *callbacks)
        return LocalAgent(spec, *callbacks)

    def weights(agents: dict) -> WeightsPlane:  # host copies: up to each node's memory budget, on its disk
        return WeightsPlane(agents, WeightsSettings(plan=config.weights_plan, token=weights_token, source_roots=roots))

    formats = FormatPreparer(registry, data_dir, enabled=config.prepare_formats)
    control = ClusterControl(nodes, settings, agent_factory=make_agent, weights=weights, formats=formats)
    # tenants' defaults (PUT /admin/tenants/{t}/admission)
    for tenant, admission in registry.tenant_admissions().items():
        control.set_tenant_admission(tenant, admission)
    try:
        membership, autoscaler = _join_ray(config, control, memory, cluster_secret)
    except _CannotStart as exc:
        print(exc, file=sys.stderr)
        registry.close()
        return exc.status
    service = Service(config, registry, control, ServiceMetrics(control.view), data_dir)
    service.wall_offset = registry.now() - loop.time()
    service.idle.set()
    service.loop_lag.start()
    service.metrics.loop_lag = service.loop_lag.lag
    demo_key = demo_model = None
    if config.demo:
        demo_key, demo_model = await ensure_demo(registry, data_dir)
    _warn_of_config(config, service)
    app = build_app(service)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           **service.limits.runner_options())
    try:
        await control.start()
        if membership is not None:
            await membership.start()
            await membership.wait_joined(settings.start_timeout_s)
        if autoscaler is not None:
            await autoscaler.start()
        await runner.setup()
        await listen(runner, config.host, config.port, service.limits, tls)
    except (OSError, RuntimeError) as exc:
        print(f"mesh serve: cannot start: {exc}", file=sys.stderr)
        await _stop(runner, control, membership, autoscaler)
        await service.loop_lag.stop()
        registry.close()
        return 1
    host, port = runner.addresses[0][:2]
    if demo_model is not None:  # ready means the demo answers at once (its cold start is behind us)
        await control.preload(demo_model, wait=True)
    scheme = "https" if tls is not None else "http"
    # handlers before the ready line: whoever reads it may send SIGTERM at once (a CI run's bench did)
    signals = _Signals(service, control.kill_agents)
    ready(ready_line(f"{scheme}://{host}:{port}", demo_key, demo_model.name if demo_model else None))
    sys.stdout.flush()
    await signals.stop.wait()
    await signals.drain()
    in_time = await _stop(runner, control, membership, autoscaler, signals.hurry)
    await service.loop_lag.stop()
    registry.close()
    signals.remove()
    print("mesh serve: stopped" if in_time else "mesh serve: stopped (node agents killed)", file=sys.stderr)
    return 0 if in_time or signals.hurry.is_set() else 1


async def _stop_cluster(control: Any, membership: Any, autoscaler: Any) -> None:
    """Stop the cluster control and, with --ray, the autoscaler, the agents' actors and the Ray connection."""
    if autoscaler is not None:
        await autoscaler.stop()
    if membership is not None:
        await membership.stop_watching()
    await control.stop()
    if membership is not None:
        await membership.stop()
        import ray

        ray.shutdown()
