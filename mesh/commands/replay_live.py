"""`mesh replay --live URL`: the trace sent to a running service, and the same requests
replayed in virtual time on a simulated cluster of the service's nodes (mesh.bench.live).

On the mixed rig (`mesh serve --cpu-nodes N --emulate a100-80gb:M`: real OpenVINO agents
beside emulated GPU nodes) the replay is the real model's, and the twin's GPU profile is the
one the emulated nodes run it with (the roofline's profile of its architecture on their
device, mesh.engines.emulation), its CPU side as below.

Against emulated nodes (`mesh serve --emulate DEVICE:N,...`, the service reports each node's
device at `/admin/cluster`) each function's model is an emulated `--model` (`llama-2-7b`, ...)
registered by catalog name, the trace's lengths are sent unscaled, and the twin plans and
runs with the same catalog profiles on the same devices (mesh.replay.driver.build_catalog),
the replay's cold start (the weights' load, as the service's under --emulate) and the
service's maximum batch: live and simulated then differ only by what the live control plane
does differently (docs/evaluation.md, "Live at paper scale").

Otherwise the simulated side is the cluster the service reports at `/admin/cluster` (its CPU and GPU
node counts and memory), the model's prior profile (mesh.perf.times.prior_profile: the
times its agents plan with before it is calibrated), or `--profiles`' calibrated one, the
service's keep-alive and deadline rule, and a cold start of `--cold-start-s` seconds. The
gap between the two SLO rates is the simulator's error at cluster level.

Otherwise the simulated side is the cluster the service reports at `/admin/cluster` (its CPU and GPU
node counts and memory), the service's keep-alive and deadline rule, and the model's times:
after the live run, what the service learnt (`GET /admin/learnt`: the prior
or `--profiles`' profile times the nodes' learnt factors per grid region, their learnt
margin, their median measured cold start; `learnt_twin`), so the gap between the two SLO
rates is the simulator's error at cluster level, not a stale prior's. The twin with the
prior (mesh.perf.times.prior_profile, a cold start of `--cold-start-s`) runs first, before
any live traffic (a policy that cannot run fails early), and is printed beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import aiohttp

from mesh.bench.live import ClusterShape, LiveConfig, LiveReplayError, cluster_shape, cold_start_bytes_per_s, run_live
from mesh.control.fleet import ClusterConfig, ModelSpec
from mesh.control.schedulers import scheduler_spec
from mesh.engines.emulation import emulated_cold_start
from mesh.engines.engine_api import DEFAULT_CONTEXT_CAP, EngineError
from mesh.modelfiles.demo import ModelFetchError
from mesh.perf.load_times import ANY_MODEL, PARKED_PRIOR_S, ColdStart
from mesh.perf.profile import load_profile
from mesh.perf.times import learnt_profile, prior_profile
from mesh.policy.dispatch_rules import CPU, GPU
from mesh.policy.queueing import DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_TIMEOUT_S
from mesh.replay.driver import ReplayConfig, run_policy
from mesh.replay.metrics import json_ready, request_figures, summarize, table
from mesh.service.cluster_control import ClusterSettings
from mesh.wire.served_request import ServedRequest
from workloads.workload import Workload

BASE = "smollm2-135m"  # the base model name of every replica (one model file, one profile)
LIVE_LENGTH_SCALE = 8.0  # the trace's lengths / 8 suit a 135M model on a small CPU (as `mesh bench fidelity`)
LIVE_KEEP_ALIVE_S = 60.0  # the service's default (mesh.service.cluster_control.ClusterSettings)
LIVE_COLD_START_S = 7.5  # measured: the demo model starts in 7.0-7.9 s on a 2-core node (docs/evaluation.md)


def _model_shape(path: Path) -> tuple[int, int, int]:
    """(weight bytes, KV bytes per token, context window as registered) of the model file,
    read from the engine a CPU agent builds for it (its KV cache precision included)."""
    from mesh.node.engine_host import make_engine
    from mesh.wire.agent_protocol import InstanceSpec

    engine = make_engine(InstanceSpec("twin", BASE, str(path)), lambda _exc: None)  # reads the shape; loads nothing
    return engine.weight_bytes, engine.kv_bytes_per_token, min(engine.context_window, DEFAULT_CONTEXT_CAP)


def _catalog(args: argparse.Namespace, weight_bytes: int, kv_per_token: int, window: int,
             emulated: dict[str, str] | None = None, model_path: Path | None = None) -> dict[str, ModelSpec]:
    """The twin's model: per kind its calibrated profile (--profiles) or prior; on the mixed
    rig's emulated kinds (`emulated`: kind -> device) the profile its emulated nodes run the
    model with (mesh.engines.emulation: the roofline's, from its architecture)."""
    profiles = {}
    for kind in (CPU, GPU):
        path = Path(args.profiles) / f"{BASE}__{kind}.json" if args.profiles else None
        if emulated and kind in emulated and model_path is not None:
            from mesh.engines.emulation import Emulation, shape_name
            from mesh.modelfiles.shape import architecture_of

            profiles[kind] = Emulation(emulated[kind]).profile(shape_name(architecture_of(model_path, BASE)))
        else:
            profiles[kind] = (load_profile(path) if path is not None and path.is_file()
                              else prior_profile(BASE, kind, weight_bytes, kv_per_token, window))
    return {BASE: ModelSpec(BASE, profiles)}


@dataclasses.dataclass(frozen=True)
class LearntTwin:
    """What the twin runs with from what the service learnt (`learnt_twin`); None where
    nothing was learnt (the flags' values stand)."""

    catalog: dict[str, ModelSpec]
    margin: float | None
    cold_start_s: float | None  # the median measured build (every load but parked ones)
    parked_s: float | None  # the median measured load from the parked tier


def learnt_twin(catalog: dict[str, ModelSpec], learnt: dict[str, Any], cold_kinds: tuple[str, ...] = (CPU, GPU)
                ) -> LearntTwin:
    """The twin that runs with what the service learnt (GET /admin/learnt's per-kind summary):
    each kind's profile times its learnt factors per grid region, the
    learnt margin, the median measured cold start of each tier (a build, an adopted parked
    worker). `cold_kinds`: the kinds whose measured cold starts count (the
    mixed rig's: its real CPU nodes only)."""
    summary = learnt.get("summary") or {}
    (base,) = catalog
    profiles = {kind: (learnt_profile(p, summary[kind]) if (summary.get(kind) or {}).get("observed") else p)
                for kind, p in catalog[base].profiles.items()}
    margins = [s["margin"] for s in summary.values() if s.get("margin") is not None]

    def tier(key: str) -> float | None:
        found = [s[key] for k, s in summary.items() if k in cold_kinds and s.get(key) is not None]
        return statistics.median(found) if found else None

    return LearntTwin({base: ModelSpec(base, profiles)}, max(margins) if margins else None,
                      tier("cold_start_s") or None, tier("parked_load_s"))


def _simulate(args: argparse.Namespace, workload: Workload, shape: ClusterShape, catalog: dict[str, ModelSpec],
              policy: str, margin: float | None = None, cold_start_s: float | None = None,
              runs: dict[str, Any] | None = None, parked_s: float | None = None) -> dict[str, Any]:
    """The twin: the service's nodes, deadline rule and queue settings, simulated; against
    emulated nodes also the service's cold start model and maximum batch; against real CPU
    nodes their parking (the budget the service reports: stopped instances parked, models
    built ahead where their first host copy lands, mesh.replay.local_node); with what the
    service learnt where given (its margin, its measured cold start of each tier)."""
    cpu, gpu = shape.counts()
    memory = shape.memory
    (base,) = catalog
    extra: dict[str, Any] = {} if margin is None else {"margin": margin}
    if shape.devices and not shape.mixed:  # emulated nodes: the replay's cold start, the service's batch limit
        cold_start = emulated_cold_start(shape.devices.values(), args.profiles)
        extra["max_batch"] = ClusterSettings().max_batch
    else:
        bps = cold_start_bytes_per_s(catalog[base].profiles[CPU].weight_bytes, cold_start_s or args.cold_start_s)
        parked = PARKED_PRIOR_S if parked_s is None else parked_s
        cold_start = ColdStart(bps, bps, parked_s=parked)
        if shape.mixed:  # the emulated GPU nodes load as the service has them (Fleet.simulated_load_s: its
            # cold start model, --cold-start-s plus the weights over PCIe), not at the CPU nodes' measured pace
            gpu_load = ColdStart(fixed_s=args.cold_start_s).load_s(catalog[base].profiles[GPU].weight_bytes, GPU)
            cold_start = ColdStart(cpu_load_bytes_per_s=bps, measured={(ANY_MODEL, GPU): gpu_load}, parked_s=parked)
        extra.update(park_bytes=shape.park_bytes, host_copies=True)
    keep_alive = args.keep_alive if args.keep_alive is not None else LIVE_KEEP_ALIVE_S
    cluster = ClusterConfig(cpu_nodes=cpu, gpu_nodes=gpu, cpu_memory_bytes=memory.get(CPU, 1),
                            gpu_memory_bytes=memory.get(GPU, 1), cold_start=cold_start, keep_alive_s=keep_alive,
                            noise=args.noise, seed=args.seed, deadlines=args.deadlines or shape.deadlines,
                            admission=shape.admission, **extra)
    config = ReplayConfig(cluster=cluster, queue_capacity=shape.queue_capacity, retry_interval_s=args.retry_interval,
                          queue_timeout_s=shape.queue_timeout_s, progress=not args.no_progress)
    prior = {base: float(sum(a.output_len for a in workload.arrivals) / max(1, len(workload)))}
    run = run_policy(workload, policy, config, catalog, prior)
    if runs is not None:  # --explain compares its requests with the live ones
        runs[policy] = run
    return summarize(run)


def run(args: argparse.Namespace, workload_for: Any) -> int:
    """`workload_for`: mesh.commands.replay's, so both modes read the trace flags the same way."""
    token = os.environ.get("MESH_ADMIN_TOKEN")
    if not token:
        print("mesh replay --live: error: set MESH_ADMIN_TOKEN to the service's admin token (it creates a tenant "
              "and registers models)", file=sys.stderr)
        return 2
    try:
        shape = asyncio.run(cluster_shape(args.live, token))
    except LiveReplayError as exc:
        print(f"mesh replay --live: error: {exc}", file=sys.stderr)
        return 1
    except aiohttp.ClientError as exc:
        print(f"mesh replay --live: error: cannot reach the service at {args.live}: {exc}", file=sys.stderr)
        return 1
    _beside_the_service(args.live, shape.service_cores)
    mixed = shape.mixed
    if shape.devices and not mixed:
        return _run_emulated(args, workload_for, token, shape)
    try:
        model_path = Path(args.model_path) if args.model_path else _demo_path()
        if not model_path.is_file():
            raise ValueError(f"--model-path {model_path}: no such file (a GGUF file the service can load)")
        weight_bytes, kv_per_token, window = _model_shape(model_path)
        policies = [p.strip() for p in (args.policies or "").split(",") if p.strip()]
        for name in policies:
            scheduler_spec(name)
        workload, queue_timeout_s = workload_for(args, {BASE: window}, {BASE: 1.0}, LIVE_LENGTH_SCALE)
        scale = workload.description.get("length_scale", 1.0)
        catalog = _catalog(args, weight_bytes, kv_per_token, window, shape.devices if mixed else None, model_path)
        cold_start_bytes_per_s(weight_bytes, args.cold_start_s)
    except (ValueError, OSError, ModelFetchError, EngineError) as exc:
        print(f"mesh replay --live: error: {exc}", file=sys.stderr)
        return 2
    d = workload.description
    print(f"live workload: {d['functions']} functions x {d['window']['minutes']} min, {len(workload)} requests "
          f"({d['mean_rps']:.2f} rps), lengths / {scale:g} within {window} tokens, to {args.live}", file=sys.stderr)
    config = LiveConfig(args.live, token, model_path, progress=not args.no_progress, context_length=window)
    return _compare(args, workload, config, shape, catalog, policies, queue_timeout_s,
                    {"model_path": str(model_path), "length_scale": scale, "context_window": window,
                     "cold_start_s": args.cold_start_s})


def _run_emulated(args: argparse.Namespace, workload_for: Any, token: str, shape: ClusterShape) -> int:
    """The live replay against emulated nodes: emulated `--model` replicas, unscaled lengths,
    the twin on the same catalog profiles (build_catalog on the service's devices)."""
    from mesh.perf.profile import ProfileError
    from mesh.replay.driver import DEFAULT_CPU_DEVICE, DEFAULT_GPU_DEVICE, build_catalog

    base = args.model
    try:
        catalog = build_catalog([base], cpu_device=shape.devices.get(CPU, DEFAULT_CPU_DEVICE),
                                gpu_device=shape.devices.get(GPU, DEFAULT_GPU_DEVICE), profile_dir=args.profiles)
        window = min(min(p.max_context for p in catalog[base].profiles.values()), DEFAULT_CONTEXT_CAP)
        policies = [p.strip() for p in (args.policies or "").split(",") if p.strip()]
        for name in policies:
            scheduler_spec(name)
        workload, queue_timeout_s = workload_for(args, {base: window}, {base: 1.0}, 1.0)
    except (ValueError, OSError, ProfileError) as exc:
        print(f"mesh replay --live: error: {exc}", file=sys.stderr)
        return 2
    d = workload.description
    print(f"live workload (emulated {base} on {', '.join(sorted(set(shape.devices.values())))}): {d['functions']} "
          f"functions x {d['window']['minutes']} min, {len(workload)} requests ({d['mean_rps']:.2f} rps), to "
          f"{args.live}", file=sys.stderr)
    config = LiveConfig(args.live, token, Path(base), progress=not args.no_progress, context_length=window,
                        emulate=base)
    return _compare(args, workload, config, shape, catalog, policies, queue_timeout_s,
                    {"emulated_model": base, "devices": shape.devices,
                     "length_scale": d.get("length_scale", 1.0), "context_window": window})


def _beside_the_service(url: str, cores: tuple[int, ...]) -> None:
    """A load client on the service's machine runs on the service's cores where the service
    keeps some off its nodes' (mesh serve's default split, or --node-cores service=...): the
    client then takes nothing from the nodes it measures. Elsewhere it is left where it is."""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    mine = os.sched_getaffinity(0)
    if host in ("127.0.0.1", "localhost", "::1") and cores and set(cores) < mine:
        os.sched_setaffinity(0, set(cores))
        print(f"mesh replay --live: the load client runs on the service's cores {','.join(map(str, cores))}, off "
              "its nodes'", file=sys.stderr)


def _compare(args: argparse.Namespace, workload: Workload, config: LiveConfig, shape: ClusterShape,
             catalog: dict[str, ModelSpec], policies: list[str], queue_timeout_s: float | None,
             about: dict[str, Any]) -> int:
    """Run the twins, then the live replay, and print (and write) both side by side."""
    d = workload.description
    try:
        # the twin of the policy the service runs, then any others asked for
        policies = [shape.policy, *(p for p in policies if p != shape.policy)]
        # the twin first: it needs only the service's nodes, and a policy that cannot run
        # on them fails here, not after minutes of live traffic
        asked = (args.queue_capacity, queue_timeout_s)
        if asked != (DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_TIMEOUT_S) and asked != (shape.queue_capacity,
                                                                                     shape.queue_timeout_s):
            print(f"mesh replay --live: the service's queue holds {shape.queue_capacity} requests for "
                  f"{'their SLO' if shape.queue_timeout_s is None else f'{shape.queue_timeout_s:g} s'}; the twin uses "
                  "that, not --queue-capacity/--queue-timeout (set them on `mesh serve`)", file=sys.stderr)
        prior = {p: _simulate(args, workload, shape, catalog, p) for p in policies}
        live = asyncio.run(run_live(workload, config))
        # the twin proper: the same policies with what the service learnt during the run
        twin = learnt_twin(catalog, live.learnt, (CPU,) if shape.mixed else (CPU, GPU))
        runs: dict[str, Any] = {}
        simulated = ({p: _simulate(args, workload, shape, twin.catalog, p, twin.margin, twin.cold_start_s,
                                   runs if p == shape.policy else None, twin.parked_s)
                      for p in policies} if live.learnt else prior)
        if not live.learnt and getattr(args, "explain", False):
            _simulate(args, workload, shape, catalog, shape.policy, runs=runs)
    except LiveReplayError as exc:
        print(f"mesh replay --live: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # ClusterError, UnknownScheduler: this cluster cannot run a policy
        print(f"mesh replay --live: error: {exc}", file=sys.stderr)
        return 2
    except aiohttp.ClientError as exc:
        print(f"mesh replay --live: error: cannot reach the service at {args.live}: {exc}", file=sys.stderr)
        return 1
    results = {f"live ({shape.policy})": request_figures(live.requests, live.usage, live.duration_s)}
    for p, figures in simulated.items():
        results[f"simulated ({p})"] = figures
    if live.learnt:
        results[f"simulated ({shape.policy}, prior)"] = prior[shape.policy]
    print(table(results))
    lag = ((live.service or {}).get("control_plane") or {}).get("loop_lag")
    if lag and lag.get("count"):
        print(f"the service's event-loop lag over its life: p50 {lag['p50_s'] * 1000:.1f} ms, p99 "
              f"{lag['p99_s'] * 1000:.1f} ms, max {lag['max_s'] * 1000:.1f} ms ({lag['count']} probes)")
    failed = [r.detail for r in live.requests if r.detail]
    if failed:
        print(f"live: {len(failed)} requests not served; the first: {failed[0]}", file=sys.stderr)
    explained = None
    if getattr(args, "explain", False) and shape.policy in runs:
        from mesh.bench.explain import differences, report

        explained = differences(live.requests, runs[shape.policy].requests)
        print(report(explained, len(live.requests)))
    if args.json:
        sims = {p: json_ready(m) for p, m in simulated.items()}
        out = {"live": {**json_ready(results[f"live ({shape.policy})"]), "policy": shape.policy, "wall_s": live.wall_s,
                        "tenant": live.tenant, "nodes": live.nodes, "service": live.service,
                        "requests_detail": [_outcome(r) for r in live.requests]},
               "simulated": sims[shape.policy], "simulated_by_policy": sims,
               "simulated_prior": json_ready(prior[shape.policy]),
               **({"explain": [d.to_dict() for d in explained]} if explained is not None else {}),
               "learnt": {"summary": live.learnt.get("summary"), "nodes": live.learnt.get("nodes"),
                          "twin_margin": twin.margin, "twin_cold_start_s": twin.cold_start_s,
                          "twin_parked_load_s": twin.parked_s, "twin_park_bytes": shape.park_bytes},
               "replay": {"command": "mesh replay " + " ".join(sys.argv[2:]), "url": args.live,
                          "workload": d, **about,
                          "deadlines": args.deadlines or shape.deadlines,
                          "queue": {"capacity": shape.queue_capacity, "timeout_s": shape.queue_timeout_s},
                          "nodes": live.nodes, "simulated_cluster": {"cpu_nodes": shape.counts()[0],
                                                                     "gpu_nodes": shape.counts()[1],
                                                                     "memory_bytes": shape.memory}}}
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, allow_nan=False, default=_plain) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _outcome(r: ServedRequest) -> dict[str, Any]:
    """One live request as the client saw it (times from the workload's start), for the JSON."""
    def seconds(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 4)

    return {"id": r.request_id, "model": r.model, "arrival_s": round(r.arrival_s, 4), "prompt_len": r.prompt_len,
            "tokens_out": r.tokens_out, "outcome": r.outcome.value if r.outcome else None, "slo_met": r.slo_met,
            "ttft_s": seconds(r.ttft_s), "ttft_slo_s": r.slo.ttft_s(r.prompt_len), "tpot_s": seconds(r.tpot_s),
            "detail": r.detail[:200]}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _demo_path() -> Path:
    from mesh.modelfiles.demo import demo_gguf_path

    return demo_gguf_path(fetch=False)
