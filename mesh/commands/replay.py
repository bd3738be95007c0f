"""`mesh replay`: replay Azure traces against a simulated cluster under several policies and
compare them (LLM-Mesh 8): a table, JSON with --json, PNG figures with --plot."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from mesh.control.dispatcher import DEFAULT_RETRY_INTERVAL_S
from mesh.control.fleet import ClusterConfig, check_cluster
from mesh.control.load_timing import MODES as WEIGHT_MODES
from mesh.control.load_timing import WeightsConfig
from mesh.control.schedulers import POLICIES, UnknownScheduler, scheduler_spec
from mesh.engines.simulated import SIMULATED_NOISE
from mesh.perf.load_times import PCIE_BYTES_PER_S, ColdStart
from mesh.perf.profile import ProfileError
from mesh.perf.roofline import host_to_device_bytes_per_s
from mesh.policy.dispatch_rules import ADMISSIONS
from mesh.policy.queueing import DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_TIMEOUT_S
from mesh.policy.slo import DeadlineRule
from mesh.replay.capacity import DEFAULT_REL_TOL, DEFAULT_TARGET, RunCache, search_capacity
from mesh.replay.cold_start_modes import Engines
from mesh.replay.driver import (
    DEFAULT_CPU_DEVICE,
    DEFAULT_GPU_DEVICE,
    NodeFailure,
    PolicyRun,
    ReplayConfig,
    build_catalog,
    known_models,
    run_policy,
    trace_mean_output,
)
from mesh.replay.metrics import aligned, json_ready, summarize, table
from workloads.azure_functions import load_function_trace
from workloads.azure_llm import load_lengths
from workloads.datasets import CONVERSATION_FILE, DATA_DIR, FUNCTIONS_FILE
from workloads.workload import Workload, build_workload, scale_lengths

GIB = 2**30
TRACE_FILE = FUNCTIONS_FILE
LENGTHS_FILE = CONVERSATION_FILE
MIX_MODELS = ("llama-3.2-3b", "llama-2-7b", "llama-2-13b")  # --mix A:B:C is 3B:7B:13B
DEFAULT_POLICIES = "mesh,sllm,sllm+cpu"
DEFAULT_NOISE = SIMULATED_NOISE
DEADLINE_TEXT = {
    "eq1": "eq1 (LLM-Mesh Eq. 1: token i due at arrival + TTFT + TPOT x (i-1))",
    "pace": "pace (token i >= 2 due at first token + TPOT x (i-1))",
}


class ReplayInputError(ValueError):
    pass


def default_data_dir() -> Path | None:
    """The Azure traces shipped with Mesh (workloads/data, copies of ../shared/data)."""
    return DATA_DIR if DATA_DIR.is_dir() else None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="replay Azure traces against the scheduler in virtual time and compare policies",
        description=__doc__,
    )
    data = p.add_argument_group("workload")
    data.add_argument("--data", metavar="DIR",
                      help="folder with the Azure traces (default: the copies shipped in workloads/data)")
    data.add_argument("--trace", metavar="FILE", help=f"Azure Functions per-minute trace (default: DATA/{TRACE_FILE})")
    data.add_argument("--lengths", metavar="FILE",
                      help=f"Azure LLM trace TIMESTAMP,ContextTokens,GeneratedTokens (default: DATA/{LENGTHS_FILE})")
    data.add_argument("--functions", type=int, default=32,
                      help="functions sampled, one model replica each (default: %(default)s)")
    data.add_argument("--minutes", type=int, default=30, help="trace minutes replayed (default: %(default)s)")
    data.add_argument("--start-minute", type=int, default=None, help="first trace minute (default: the file's first)")
    data.add_argument("--model", default="llama-2-7b", help="base model of every replica (default: %(default)s)")
    data.add_argument("--mix", metavar="A:B:C", help="3B:7B:13B replica mix instead of --model, e.g. 4:1:1")
    data.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: 0)")
    data.add_argument("--rate-scale", default="auto",
                      help="'auto' (0.1 rps per function, docs/workloads.md) or a factor")
    data.add_argument("--target-rps", type=float, default=None, help="aggregate mean rate for --rate-scale auto")
    data.add_argument("--arrivals", default="poisson", choices=("poisson", "uniform"),
                      help="arrivals within a minute (default: poisson)")
    cl = p.add_argument_group("cluster")
    cl.add_argument("--policies", default=None,
                    help=f"comma-separated, from: {', '.join(POLICIES)} (default: {DEFAULT_POLICIES}; with --live, the "
                         "policies the live run is simulated under besides the one the service runs)")
    cl.add_argument("--cpu-nodes", type=int, default=4, help="CPU nodes (default: 4)")
    cl.add_argument("--gpu-nodes", type=int, default=4, help="GPU nodes (default: 4)")
    cl.add_argument("--cpu-memory-gib", type=float, default=256.0,
                    help="memory of a CPU node for instances (default: %(default)s)")
    cl.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of a GPU (default: %(default)s)")
    cl.add_argument("--cpu-device", default=DEFAULT_CPU_DEVICE, help="CPU profile device (default: %(default)s)")
    cl.add_argument("--gpu-device", default=DEFAULT_GPU_DEVICE, help="GPU profile device (default: %(default)s)")
    cl.add_argument("--profiles", metavar="DIR", help="profiles <model>__<device>.json overriding the packaged ones")
    cl.add_argument("--pcie-gbps", type=float, default=None,
                    help="host-to-GPU weight load bandwidth from pinned host memory, GB/s (default: the GPU device's, "
                         "docs/roofline.md: a100-80gb 25 (PCIe 4.0 x16, assumed), h100 54.6 and h200 55.3 (measured))")
    cl.add_argument("--cpu-load-gbps", type=float, default=50.0,
                    help="CPU instance start-up pass over cached weights, GB/s (default: %(default)s)")
    cl.add_argument("--cold-starts", metavar="FILE", default=None,
                    help="take instances' loads from a measured cold-start table (JSON, format mesh-cold-starts/1, "
                         "mesh.perf.load_times.ColdStartTable): per model and node kind, '*' for models it does not "
                         "name; the weights' bandwidths then apply only to kinds it has no entry for")
    cl.add_argument("--weights", default="cached", choices=("cached", *WEIGHT_MODES),
                    help="where a cold start gets its weights: 'cached' (the paper's setup: host memory over PCIe on "
                         "GPU nodes, already in memory on CPU nodes), or, on every node, 'ssd', 'host' (a per-node "
                         "host cache), 'multicast' (the parameter pool's host copy and running instances over the "
                         "network, planner-timed), 'multicast-live' (serving before the last layer arrives); "
                         "docs/multicast.md (default: %(default)s)")
    cl.add_argument("--net-gbit", type=float, default=200.0,
                    help="per-node network bandwidth for --weights multicast*, Gbit/s (default: %(default)s)")
    cl.add_argument("--ssd-gbps", type=float, default=3.0,
                    help="SSD read bandwidth for --weights ssd/host, GB/s (default: %(default)s)")
    cl.add_argument("--multicast-plan", default="binomial", choices=("binomial", "chain", "naive"),
                    help="multicast plan (default: %(default)s)")
    cl.add_argument("--deadlines", default=None, choices=[r.value for r in DeadlineRule],
                    help="when a request's tokens after the first are due, for every policy's node scheduler and "
                         "Mesh's shadow validation: 'eq1' (the paper's Eq. 1: arrival + TTFT + TPOT x (i-1)) or "
                         "'pace' (first token + TPOT x (i-1), what `mesh serve` runs); docs/design.md "
                         "(default: eq1; with --live, the service's pace)")
    cl.add_argument("--keep-alive", type=float, default=None,
                    help="seconds an idle instance is kept (default: 1; with --live, the service's 60)")
    cl.add_argument("--noise", type=float, default=DEFAULT_NOISE,
                    help="relative std-dev of simulated iteration times (default: %(default)s)")
    cl.add_argument("--queue-capacity", type=int, default=DEFAULT_QUEUE_CAPACITY,
                    help="waiting requests held at most (default: %(default)s)")
    cl.add_argument("--queue-timeout", default=f"{DEFAULT_QUEUE_TIMEOUT_S:g}",
                    help="seconds a request may wait for capacity (a client timeout, the same for every policy; Mesh "
                    "also turns away at once a request that can no longer meet its SLO), or 'slo': every policy "
                    "turns requests away once they can no longer meet their SLO (default: %(default)s)")
    cl.add_argument("--admission", default="reject", choices=ADMISSIONS,
                    help="what a request that can no longer meet its SLO gets, as `mesh serve --admission`: "
                         "'reject' (LLM-Mesh's rule), 'queue' (waits up to --queue-timeout, served late), 'late' "
                         "(no time bound) (default: %(default)s)")
    cl.add_argument("--fail-node", action="append", default=[], metavar="NODE@SECONDS[+DOWN]",
                    help="lose a node at that time of the workload, as a node agent is lost live: its requests go "
                         "back to the dispatcher with their progress and it takes nothing for DOWN seconds (its "
                         "agent restarting; default 1), e.g. cpu0@120+2; repeat for several")
    cl.add_argument("--retry-interval", type=float, default=DEFAULT_RETRY_INTERVAL_S,
                    help="seconds between retries of waiting requests (default: %(default)s)")
    live = p.add_argument_group("live (docs/evaluation.md, 'Live replay')")
    live.add_argument("--live", metavar="URL",
                      help="send the trace to the Mesh service at URL through its OpenAI API (MESH_ADMIN_TOKEN in the "
                           "environment: a tenant of its own is created, one model registered per function, deleted "
                           "at the end), and replay the same requests in virtual time beside it")
    live.add_argument("--explain", action="store_true",
                      help="with --live: list every request whose outcome differs between live and its twin, with "
                           "the decision that differed (admission, failure, first token, pace) and why")
    live.add_argument("--model-path", metavar="FILE",
                      help="the GGUF each function's model is a copy of (default: the demo model)")
    live.add_argument("--length-scale", type=float, default=None,
                      help="divide the trace's prompt and output lengths by this (default: 1; with --live 8)")
    live.add_argument("--cold-start-s", type=float, default=7.5,
                      help="with --live: seconds an instance takes to start in the simulated twin (default: "
                           "%(default)s, the demo model measured on a 2-core node)")
    cap = p.add_argument_group("capacity")
    cap.add_argument("--capacity", action="store_true",
                     help="instead of one replay, search per policy the highest request rate (the trace's arrival rate "
                          "scaled) served with at least --capacity-target SLO attainment: doubling/halving from the "
                          "replay's own rate, then bisection to --capacity-tol; writes capacity_rps (Eq. 1 reading) "
                          "and capacity_rps_strict per policy")
    cap.add_argument("--capacity-target", type=float, default=DEFAULT_TARGET,
                     help="SLO attainment to reach (default: %(default)s)")
    cap.add_argument("--capacity-tol", type=float, default=DEFAULT_REL_TOL,
                     help="relative width of the final bracket (default: %(default)s)")
    cap.add_argument("--capacity-growth", type=float, default=2.0,
                     help="factor between bracketing runs (default: %(default)s; less overshoots into costly overload)")
    cap.add_argument("--capacity-reading", default="both", choices=("eq1", "strict", "both"),
                     help="SLO reading(s) searched: Eq. 1 (slo_rate), strict (slo_rate_strict) or both, the second "
                          "reusing the first one's runs (default: %(default)s)")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    out.add_argument("--plot", metavar="DIR", help="write PNG figures (TTFT CDF, node usage) into DIR")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def parse_mix(text: str) -> dict[str, float]:
    parts = text.split(":")
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        weights = []
    if len(weights) != 3 or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ReplayInputError(f"--mix must be three non-negative weights 3B:7B:13B such as 4:1:1, got {text!r}")
    return {m: w for m, w in zip(MIX_MODELS, weights) if w > 0}


def _inputs(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.trace and args.lengths:
        return Path(args.trace), Path(args.lengths)
    data = Path(args.data) if args.data else default_data_dir()
    if data is None:
        raise ReplayInputError(
            f"no data folder: {DATA_DIR} (the traces shipped with Mesh) is absent; pass --trace FILE and --lengths "
            "FILE (or --data DIR holding the Azure traces)"
        )
    if not data.is_dir():
        raise ReplayInputError(f"--data {data}: not a folder; pass --trace FILE and --lengths FILE instead")
    return Path(args.trace or data / TRACE_FILE), Path(args.lengths or data / LENGTHS_FILE)


def _check_file(path: Path, flag: str) -> None:
    if not path.is_file():
        raise ReplayInputError(f"{flag} {path}: no such file")


def configure(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a run needs, checked before anything runs."""
    args.policies = args.policies or DEFAULT_POLICIES
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise UnknownScheduler(f"--policies is empty; valid policies: {', '.join(POLICIES)}")
    for name in policies:
        scheduler_spec(name)
    if len(set(policies)) != len(policies):
        raise ReplayInputError(f"--policies lists a policy twice: {args.policies}")
    mix = parse_mix(args.mix) if args.mix else {args.model: 1.0}
    for name in mix:
        if name not in known_models() and not args.profiles:
            raise ProfileError(f"unknown model {name!r}; valid models: {', '.join(known_models())}")
    if args.noise < 0 or args.retry_interval <= 0 or args.queue_capacity < 1:
        raise ReplayInputError("--noise must be >= 0, --retry-interval > 0 and --queue-capacity >= 1")
    catalog = build_catalog(list(mix), cpu_device=args.cpu_device, gpu_device=args.gpu_device,
                            profile_dir=args.profiles)
    measured: dict[tuple[str, str], float] = {}
    if args.cold_starts:
        from mesh.perf.load_times import cold_start_times

        try:
            measured = cold_start_times(json.loads(Path(args.cold_starts).read_text()))
        except (OSError, ValueError) as exc:
            raise ReplayInputError(f"--cold-starts {args.cold_starts}: {exc}") from None
    if args.pcie_gbps is None:
        args.pcie_gbps = host_to_device_bytes_per_s(args.gpu_device, PCIE_BYTES_PER_S) / 1e9
    cold_start, engines = ColdStart(args.pcie_gbps * 1e9, args.cpu_load_gbps * 1e9, measured=measured), None
    if args.weights != "cached":
        try:
            weights = WeightsConfig(args.weights, ssd_bytes_per_s=args.ssd_gbps * 1e9,
                                    pcie_bytes_per_s=args.pcie_gbps * 1e9,
                                    net_bytes_per_s=args.net_gbit * 1e9 / 8, plan=args.multicast_plan)
        except ValueError as exc:
            raise ReplayInputError(f"--weights: {exc}") from None
        # The policies expect an uncontended cold start; the weights model times each one.
        nominal = weights.nominal_bytes_per_s()
        cold_start, engines = ColdStart(nominal, nominal), Engines(weights)
    cluster = ClusterConfig(
        cpu_nodes=args.cpu_nodes, gpu_nodes=args.gpu_nodes,
        cpu_memory_bytes=int(args.cpu_memory_gib * GIB), gpu_memory_bytes=int(args.gpu_memory_gib * GIB),
        cold_start=cold_start,
        keep_alive_s=1.0 if args.keep_alive is None else args.keep_alive, noise=args.noise, seed=args.seed,
        deadlines=args.deadlines or DeadlineRule.EQ1, admission=args.admission,
    )
    for name in policies:
        check_cluster(cluster, catalog, scheduler_spec(name).kinds, name)
    max_total = {b: spec.profiles["gpu"].max_context for b, spec in catalog.items()}
    workload, timeout = workload_for(args, max_total, mix)
    lengths = load_lengths(_inputs(args)[1])
    prior = {b: trace_mean_output(lengths, m) for b, m in max_total.items()}
    config = ReplayConfig(
        cluster=cluster, queue_capacity=args.queue_capacity, retry_interval_s=args.retry_interval,
        queue_timeout_s=timeout, progress=not args.no_progress, engines=engines,
        failures=tuple(parse_failure(text) for text in args.fail_node),
    )
    if args.capacity and not (0 < args.capacity_target <= 1 and args.capacity_tol > 0 and args.capacity_growth > 1):
        raise ReplayInputError("--capacity-target must be in (0, 1], --capacity-tol > 0 and --capacity-growth > 1")

    def build(rate_scale: float | str) -> Workload:
        """The same workload at another rate scale (the capacity search)."""
        return workload_for(argparse.Namespace(**{**vars(args), "rate_scale": rate_scale}), max_total, mix)[0]

    return {"policies": policies, "catalog": catalog, "workload": workload, "prior": prior, "config": config,
            "mix": mix,
            "build": build}


def parse_failure(text: str) -> NodeFailure:
    """`--fail-node NODE@SECONDS[+DOWN]`; ReplayInputError says what is wrong."""
    node, at, rest = text.partition("@")
    at_s, _, down = rest.partition("+")
    try:
        failure = NodeFailure(node, float(at_s), float(down) if down else 1.0)
    except ValueError:
        failure = None
    if not node or not at or failure is None or not failure.at_s >= 0 or not failure.down_s >= 0:
        raise ReplayInputError(f"--fail-node is NODE@SECONDS[+DOWN] (e.g. cpu0@120+2), got {text!r}")
    return failure


def workload_for(args: argparse.Namespace, max_total: dict[str, int], mix: dict[str, float],
                 length_scale: float = 1.0) -> tuple[Workload, float | None]:
    """The workload the trace flags ask for, and the queue timeout (None: 'slo'); both modes
    (simulated, --live) build theirs here. `max_total`: each base model's window; lengths
    are drawn from trace rows that fit it after division by `--length-scale` (default
    `length_scale`)."""
    scale = args.length_scale if args.length_scale is not None else length_scale
    trace_path, lengths_path = _inputs(args)
    _check_file(trace_path, "--trace")
    _check_file(lengths_path, "--lengths")
    for flag, value in (("--functions", args.functions), ("--minutes", args.minutes)):
        if value < 1:
            raise ReplayInputError(f"{flag} must be at least 1, got {value}")
    rate: float | str = args.rate_scale
    if rate != "auto":
        try:
            rate = float(rate)
        except ValueError:
            raise ReplayInputError(
                f"--rate-scale must be 'auto' or a positive number, got {args.rate_scale!r}") from None
    workload = build_workload(
        load_function_trace(trace_path), load_lengths(lengths_path), functions=args.functions, minutes=args.minutes,
        start_minute=args.start_minute, models=mix, seed=args.seed, rate_scale=rate, target_rps=args.target_rps,
        arrivals=args.arrivals, max_total={b: int(m * scale) for b, m in max_total.items()},
    )
    if scale != 1.0:
        workload = scale_lengths(workload, scale, min(max_total.values()))
    timeout = None
    if args.queue_timeout != "slo":
        try:
            timeout = float(args.queue_timeout)
        except ValueError:
            timeout = -1.0
        if not timeout >= 0:
            raise ReplayInputError(f"--queue-timeout must be 'slo' or a number of seconds >= 0, got "
                                   f"{args.queue_timeout!r}")
    return workload, timeout


def describe(args: argparse.Namespace, setup: dict[str, Any]) -> dict[str, Any]:
    w = setup["workload"]
    d = w.description
    c: ClusterConfig = setup["config"].cluster
    return {
        "command": "mesh replay " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["replay"] else None,
        "trace": d["function_trace"],
        "lengths": d["length_trace"],
        "functions": d["functions"],
        "minutes": d["window"]["minutes"],
        "start_minute": d["window"]["start_minute"],
        "models": setup["mix"],
        "seed": d["seed"],
        "requests": d["requests"],
        "mean_rps": d["mean_rps"],
        "rate_scale": d["rate_scale"],
        "arrivals": d["arrivals"],
        "cluster": {
            "cpu_nodes": c.cpu_nodes, "gpu_nodes": c.gpu_nodes,
            "cpu_memory_gib": c.cpu_memory_bytes / GIB, "gpu_memory_gib": c.gpu_memory_bytes / GIB,
            "cpu_device": args.cpu_device, "gpu_device": args.gpu_device,
            "pcie_gbps": c.cold_start.pcie_bytes_per_s / 1e9, "cpu_load_gbps": c.cold_start.cpu_load_bytes_per_s / 1e9,
            "weights": args.weights,
            "keep_alive_s": c.keep_alive_s, "margin": c.margin, "watermark": c.watermark, "noise": c.noise,
            "slo": {"ttft": "max(2, L/512) s", "tpot_s": c.slo.tpot_s},
            "deadlines": c.deadlines.value,
        },
        "deadlines": c.deadlines.value,
        "admission": c.admission,
        "queue_capacity": setup["config"].queue_capacity,
        "queue_timeout": "slo" if setup["config"].queue_timeout_s is None else setup["config"].queue_timeout_s,
        "retry_interval_s": setup["config"].retry_interval_s,
        "mean_output_prior": setup["prior"],
    }


def run(args: argparse.Namespace) -> int:
    if args.live:
        from mesh.commands import replay_live

        return replay_live.run(args, workload_for)
    try:
        setup = configure(args)
    except (ValueError, OSError) as exc:  # TraceFormatError, ProfileError, ClusterError, UnknownScheduler, ...
        print(f"mesh replay: error: {exc}", file=sys.stderr)
        return 2
    w = setup["workload"]
    d = w.description
    print(
        f"workload: {d['functions']} functions x {d['window']['minutes']} min, models "
        f"{', '.join(f'{m}:{int(c)}' for m, c in d['model_counts'].items() if c)}, {d['requests']} requests "
        f"({d['mean_rps']:.2f} rps; rate scale {d['rate_scale']['value']:.3g}, {d['rate_scale']['mode']}), seed "
        f"{d['seed']}",
        file=sys.stderr,
    )
    meta = describe(args, setup)
    if args.capacity:
        return run_capacity(args, setup, meta)
    runs: dict[str, PolicyRun] = {}
    results: dict[str, dict[str, Any]] = {}
    for name in setup["policies"]:
        run_ = run_policy(w, name, setup["config"], setup["catalog"], setup["prior"])
        runs[name] = run_
        results[name] = summarize(run_)
    shown = {k: v for k, v in results.items()}
    print(f"deadline rule: {DEADLINE_TEXT[setup['config'].cluster.deadlines.value]}")
    print(table(shown))
    if len(results) > 1 and "mesh" in results:
        for other in results:
            if other == "mesh":
                continue
            parts = []
            for key, reading in (("slo_compliant", "Eq. 1"), ("slo_compliant_strict", "strict")):
                if results[other][key]:
                    parts.append(f"{results['mesh'][key] / results[other][key]:.2f}x ({reading})")
            if parts:
                print(f"mesh / {other}: {', '.join(parts)} SLO-compliant requests")
    if args.json:
        out = {name: {**json_ready(m), "deadlines": meta["deadlines"], "replay": meta} for name, m in results.items()}
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        from mesh.replay.plots import node_usage, ttft_cdf

        folder = Path(args.plot)
        folder.mkdir(parents=True, exist_ok=True)
        label = f"{d['functions']} functions, " + "/".join(setup["mix"]) + (f" ({args.mix})" if args.mix else "")
        for p in (ttft_cdf(runs, folder / "ttft_cdf.png", label), node_usage(runs, folder / "node_usage.png", label)):
            print(f"wrote {p}", file=sys.stderr)
    return 0


READINGS = {"eq1": ("slo_rate", "capacity_rps"), "strict": ("slo_rate_strict", "capacity_rps_strict")}


def capacity(setup: dict[str, Any], policy: str, readings: list[str], target: float, rel_tol: float,
             progress: bool = False, growth: float = 2.0) -> dict[str, Any]:
    """Capacity search (mesh.replay.capacity) of one policy: every run rebuilds the workload at
    the replay's rate scale times a factor and replays it; runs are shared between readings."""
    from dataclasses import replace

    from tqdm import tqdm

    base_scale = setup["workload"].description["rate_scale"]["value"]
    config = replace(setup["config"], progress=False)
    runs: dict[float, dict[str, Any]] = {}
    bar = tqdm(desc=f"{policy:>14} capacity", unit="run", disable=not progress, leave=False)

    def evaluate(factor: float) -> dict[str, float]:
        workload = setup["build"](base_scale * factor)
        m = summarize(run_policy(workload, policy, config, setup["catalog"], setup["prior"]))
        runs[factor] = {"factor": factor, "mean_rps": workload.description["mean_rps"],
                        "requests": m["requests"], "slo_rate": m["slo_rate"],
                        "slo_rate_strict": m["slo_rate_strict"], "rejected": m["rejected"], "wall_s": m["wall_s"]}
        bar.update(1)
        bar.set_postfix(factor=f"{factor:.3g}", slo=f"{m['slo_rate']:.1%}", strict=f"{m['slo_rate_strict']:.1%}")
        return {"eq1": m["slo_rate"], "strict": m["slo_rate_strict"]}

    cache = RunCache(evaluate)
    out: dict[str, Any] = {"capacity_target": target, "capacity_tol": rel_tol}
    for reading in readings:
        rate_key, key = READINGS[reading]
        res = search_capacity(cache, reading, target=target, rel_tol=rel_tol, growth=growth)
        rps = runs[res.factor]["mean_rps"] if res.factor > 0 else 0.0
        out[key] = rps
        out[key.replace("rps", "factor")] = res.factor
        out[key.replace("rps", "bounded")] = res.bounded
    bar.close()
    out["capacity_runs"] = [runs[f] for f in sorted(runs)]
    out["capacity_wall_s"] = sum(r["wall_s"] for r in runs.values())
    return out


def capacity_table(results: dict[str, dict[str, Any]]) -> str:
    head = ["policy", "capacity rps (Eq. 1)", "x trace rate", "capacity rps (strict)", "x trace rate", "runs", "wall s"]
    rows = [head]
    for name, r in results.items():
        def cell(key: str, fmt: str) -> str:
            v = r.get(key)
            if v is None:
                return "-"
            bounded = r.get(key.replace("rps", "bounded").replace("factor", "bounded"), True)
            return fmt.format(v) + ("" if bounded else "*")
        rows.append([name, cell("capacity_rps", "{:.2f}"), cell("capacity_factor", "{:.3g}"),
                     cell("capacity_rps_strict", "{:.2f}"), cell("capacity_factor_strict", "{:.3g}"),
                     str(len(r["capacity_runs"])), f"{r['capacity_wall_s']:.0f}"])
    return aligned(rows)


def run_capacity(args: argparse.Namespace, setup: dict[str, Any], meta: dict[str, Any]) -> int:
    readings = ["eq1", "strict"] if args.capacity_reading == "both" else [args.capacity_reading]
    results: dict[str, dict[str, Any]] = {}
    for name in setup["policies"]:
        results[name] = capacity(setup, name, readings, args.capacity_target, args.capacity_tol,
                                 progress=not args.no_progress, growth=args.capacity_growth)
    qt = setup["config"].queue_timeout_s
    print(f"capacity: highest rate with >= {args.capacity_target:.0%} SLO attainment, bracket to "
          f"{args.capacity_tol:.0%}; queue timeout {'slo' if qt is None else f'{qt:g} s'}; deadline rule "
          f"{setup['config'].cluster.deadlines.value} (* = search hit its limit)")
    print(capacity_table(results))
    if len(results) > 1 and "mesh" in results:
        for other in results:
            if other == "mesh":
                continue
            parts = []
            for reading in readings:
                key = READINGS[reading][1]
                a, b = results["mesh"].get(key), results[other].get(key)
                if a is not None and b:
                    parts.append(f"{a / b:.2f}x ({'Eq. 1' if reading == 'eq1' else 'strict'})")
            if parts:
                print(f"mesh / {other}: {', '.join(parts)} capacity")
    if args.json:
        out = {name: {**r, "deadlines": meta["deadlines"], "replay": meta} for name, r in results.items()}
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0
