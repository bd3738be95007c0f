"""`mesh bench closed-loop`: N closed-loop streaming clients over several models.

The single-node check's workload: `--clients` clients (default 8), each sending
its next request as soon as its previous one ended (closed loop), `--requests` streamed chat
completions in all (default 48) of `--max-tokens` tokens (default 48, greedy: temperature 0,
with vLLM's `ignore_eos` so every served request generates exactly that many on both
engines; `--stop-at-eos` lets a model stop early), spread round-robin over the models
(request i goes to model i mod M). Requests go through the real `openai` client with
`max_retries=0`: the client never retries, so every request is counted once, as

- **turned away**: HTTP 429 or 503 (the service refused it: could not meet its SLO, no node,
  too many connections, shutting down);
- **failed**: any other HTTP status, a connection error or timeout, an error event inside
  the stream, or a stream that ended without a finish reason;
- **served**: the stream ended with a finish reason.

Figures per round: turned away, failed, served; TTFT p50/p99 over served requests (time to
the first chunk with content, as the client sees it) and over all requests (an unserved
request counted as never served: inf); tokens a second (completion tokens of served
requests over the round's wall time); wall time; load average before and after.

Where the requests go:
- `--url URL` (repeatable) with `--model NAME` (repeatable): one URL for every model (a Mesh
  service), or one URL per model, in order (vLLM servers, one per model). `--api-key` for all.
- `--mesh` (default when no `--url`): start `mesh serve --demo --allowed-dir DIR` on a fresh
  data folder (temporary), copy the demo GGUF into DIR `--copies` times (default 3),
  register the copies by path as `bench/copy-0..2` right before the first round, then run
  round `mesh-cold` at once (right after registration) and round `mesh-warm` after it
  (the same workload again at once), then stop the service.
- `--vllm`: then start vLLM's CPU build as one OpenAI server per model (the same names,
  the demo model as a Hugging Face folder: `--vllm-model DIR`, else the demo GGUF converted
  once by `mesh.modelfiles.convert gguf-to-hf` into `<data>/bench/smollm2-hf`), wait until all
  answer, send one 2-token request to each, and run round `vllm`. Mesh is stopped before
  vLLM starts, so the two never share the cores. `--vllm-python` (default
  `$MESH_VLLM_PYTHON`, else `<repo>/.venv-vllm/bin/python`) is the environment's Python.

Checks printed at the end (the single-node criteria, each where its rounds ran):
`mesh-cold` turned away <= 10%; `mesh-warm` none turned away and TTFT p99 (served) <= 2 s;
`mesh-warm` tokens/s >= 2x `vllm`'s. Exit status 1 when a check fails or a request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mesh.bench.report import write_json
from mesh.bench.serve_process import ServiceProcess, start_service, stop_service
from mesh.service.demo_mode import DEMO_TENANT

TURNED_AWAY_STATUSES = (429, 503)
SERVED, TURNED_AWAY, FAILED = "served", "turned_away", "failed"
PROMPTS = ("Tell me a long story about a lighthouse keeper and a storm.",
           "Explain step by step how bread is baked, in detail.",
           "Describe a walk through a busy city market in the morning.",
           "Write about the history of sailing ships and their crews.")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("closed-loop", help="N closed-loop streaming clients over several models: Mesh cold and warm, "
                                           "optionally vLLM's CPU build as one server per model")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients (default 8)")
    p.add_argument("--requests", type=int, default=48, help="requests per round, over all models (default 48)")
    p.add_argument("--max-tokens", type=int, default=48, help="completion tokens per request (default 48)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="let a model stop before --max-tokens (default: ignore_eos, exactly --max-tokens)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds (default 600)")
    p.add_argument("--url", action="append", default=[],
                   help="OpenAI base URL of a running server (without /v1); repeat for one URL per model")
    p.add_argument("--model", action="append", default=[], help="model name; repeat (with --url)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"), help="key for --url")
    p.add_argument("--mesh", action="store_true",
                   help="start mesh serve on a fresh data folder, register --copies copies of the demo GGUF by "
                        "path, run mesh-cold then mesh-warm (the default without --url)")
    p.add_argument("--no-mesh", action="store_true", help="do not start Mesh (with --vllm: vLLM's round only)")
    p.add_argument("--copies", type=int, default=3, help="copies of the demo GGUF registered (default 3)")
    p.add_argument("--vllm", action="store_true", help="then run the same workload on vLLM, one server per model")
    add_server_options(p)
    p.add_argument("--logs", default=None, help="keep the servers' logs in this folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", help="write every round's figures as JSON here")
    p.set_defaults(func=run)


# -- one request, one round ------------------------------------------------------------------
@dataclass
class RequestResult:
    """One request of a round as the client saw it: served, turned away or failed, and when."""

    index: int
    model: str
    url: str
    status: str  # SERVED, TURNED_AWAY, FAILED
    http_status: int | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    tokens: int = 0
    detail: str = ""
    sent_s: float = 0.0  # when it was sent, from the round's start


@dataclass(frozen=True)
class Target:
    """A model and the base URL (without /v1) that serves it."""

    model: str
    url: str
    api_key: str = "none"


def targets_for(urls: Sequence[str], models: Sequence[str], api_key: str = "none") -> list[Target]:
    """One URL for every model, or one URL per model (in order)."""
    if not models:
        raise ValueError("no models: give at least one --model")
    if len(urls) == 1:
        urls = list(urls) * len(models)
    if len(urls) != len(models):
        raise ValueError(f"{len(urls)} URLs for {len(models)} models: give one URL, or one per model")
    return [Target(m, u.rstrip("/"), api_key) for u, m in zip(urls, models)]


def _detail(exc: BaseException) -> str:
    text = str(getattr(exc, "message", "") or exc)
    return f"{type(exc).__name__}: {text[:300]}"


async def one_request(client: Any, target: Target, index: int, max_tokens: int, ignore_eos: bool,
                      round_start: float = 0.0) -> RequestResult:
    """One streamed chat completion through the openai client (no retries), classified."""
    import openai

    loop = asyncio.get_running_loop()
    start = loop.time()
    out = RequestResult(index, target.model, target.url, FAILED, sent_s=start - round_start if round_start else 0.0)
    content_chunks = 0
    usage_tokens: int | None = None
    finish: str | None = None
    try:
        stream = await client.chat.completions.create(
            model=target.model, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
            extra_body={"ignore_eos": True} if ignore_eos else None)
        out.http_status = 200  # the stream opened: what goes wrong now is a failure inside it
        async for chunk in stream:
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices or ():
                if choice.delta is not None and choice.delta.content:
                    content_chunks += 1
                    if out.ttft_s is None:
                        out.ttft_s = loop.time() - start
                if choice.finish_reason:
                    finish = choice.finish_reason
        out.tokens = usage_tokens if usage_tokens is not None else content_chunks
        if finish is None:
            out.detail = "stream ended without a finish reason"
        else:
            out.status = SERVED
    except openai.APIStatusError as exc:
        out.http_status = exc.status_code
        out.status = TURNED_AWAY if exc.status_code in TURNED_AWAY_STATUSES else FAILED
        out.detail = _detail(exc)
    except (openai.APIError, OSError, asyncio.TimeoutError, ValueError) as exc:  # error event, connection, timeout
        out.detail = _detail(exc)
    out.latency_s = loop.time() - start
    return out


async def closed_loop(targets: Sequence[Target], clients: int, requests: int, max_tokens: int,
                      ignore_eos: bool = True, timeout: float = 600.0,
                      progress: bool = False, desc: str = "") -> tuple[list[RequestResult], float]:
    """`clients` closed-loop clients send `requests` requests in all (request i to target i mod
    len(targets)); each client sends its next request when its previous one ended. Returns
    every request's outcome (in index order) and the wall time from the first send to the
    last answer."""
    import openai
    from tqdm import tqdm

    loop = asyncio.get_running_loop()
    by_key = {}
    for t in targets:  # one openai client per (URL, key); its pool holds far more than `clients` connections
        if (t.url, t.api_key) not in by_key:
            by_key[(t.url, t.api_key)] = openai.AsyncOpenAI(base_url=f"{t.url}/v1", api_key=t.api_key,
                                                            max_retries=0, timeout=timeout)
    counter = iter(range(requests))
    outcomes: list[RequestResult] = []
    bar = tqdm(total=requests, desc=desc or "requests", unit="req", disable=not progress, file=sys.stderr,
               leave=True)

    async def client() -> None:
        for i in counter:
            t = targets[i % len(targets)]
            outcome = await one_request(by_key[(t.url, t.api_key)], t, i, max_tokens, ignore_eos, start)
            outcomes.append(outcome)
            bar.update(1)
            bar.set_postfix(served=sum(o.status == SERVED for o in outcomes),
                            away=sum(o.status == TURNED_AWAY for o in outcomes),
                            failed=sum(o.status == FAILED for o in outcomes), refresh=False)

    start = loop.time()
    try:
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = loop.time() - start
    finally:
        bar.close()
        for c in by_key.values():
            await c.close()
    return sorted(outcomes, key=lambda o: o.index), wall


# -- figures -----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank q-quantile: the smallest value with at least a fraction q of `values` at or
    below it (math.inf stands for a request never served); nan without values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(outcomes: Sequence[RequestResult], wall_s: float, sent: int | None = None) -> dict[str, Any]:
    """A round's figures. `sent` (default len(outcomes)): requests sent; one without an outcome
    counts as failed. TTFT percentiles over served requests (`ttft_p50_s`, `ttft_p99_s`) and
    over all requests sent (`ttft_p99_all_s`: an unserved one counts as inf)."""
    sent = len(outcomes) if sent is None else sent
    served = [o for o in outcomes if o.status == SERVED]
    ttfts = [o.ttft_s for o in served if o.ttft_s is not None]
    everyone = ttfts + [math.inf] * (sent - len(ttfts))
    tokens = sum(o.tokens for o in served)
    away = sum(o.status == TURNED_AWAY for o in outcomes)
    figures: dict[str, Any] = {
        "requests": sent,
        "served": len(served),
        "turned_away": away,
        "turned_away_fraction": away / sent if sent else 0.0,
        "failed": sum(o.status == FAILED for o in outcomes) + (sent - len(outcomes)),
        "ttft_p50_s": percentile(ttfts, 0.50),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_max_s": max(ttfts) if ttfts else float("nan"),
        "ttft_p99_all_s": percentile(everyone, 0.99),
        "latency_p50_s": statistics.median(o.latency_s for o in served) if served else float("nan"),
        "tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
    }
    statuses: dict[str, int] = {}
    for o in outcomes:
        if o.status != SERVED:
            key = f"{o.status}_http_{o.http_status}" if o.http_status else f"{o.status}_no_http"
            statuses[key] = statuses.get(key, 0) + 1
    figures["by_status"] = dict(sorted(statuses.items()))
    models: dict[str, dict[str, int]] = {}
    for o in outcomes:
        m = models.setdefault(o.model, {SERVED: 0, TURNED_AWAY: 0, FAILED: 0})
        m[o.status] += 1
    figures["by_model"] = models
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.status != SERVED:
            reasons[_reason(o.detail)] = reasons.get(_reason(o.detail), 0) + 1
    figures["reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
    # every request as the client saw it, in the order sent (a timeline of the round)
    figures["requests_detail"] = [
        {"index": o.index, "model": o.model, "sent_s": round(o.sent_s, 3), "status": o.status,
         "ttft_s": None if o.ttft_s is None else round(o.ttft_s, 3), "latency_s": round(o.latency_s, 3),
         "tokens": o.tokens, **({"reason": _reason(o.detail)} if o.status != SERVED else {})}
        for o in sorted(outcomes, key=lambda o: o.sent_s)]
    return figures


def _reason(detail: str) -> str:
    """A refusal's or failure's reason, without what differs between requests: Mesh's 429 says
    "... (cannot meet its SLO: <why>). Retry later."; others keep their first 120 characters."""
    m = re.search(r"\(([^()]*)\)\. Retry", detail)
    return m.group(1) if m else re.sub(r"\d+(\.\d+)?", "N", detail)[:120]


def checks(rounds: dict[str, dict[str, Any]], max_cold_away: float = 0.10, max_warm_p99_s: float = 2.0,
           min_speedup: float = 2.0) -> dict[str, dict[str, Any]]:
    """The single-node criteria, each where its rounds ran: {name: {ok, value, bound}}."""
    out: dict[str, dict[str, Any]] = {}
    cold, warm, vllm = rounds.get("mesh-cold"), rounds.get("mesh-warm"), rounds.get("vllm")
    if cold:
        out["cold_turned_away_fraction"] = {"value": cold["turned_away_fraction"], "bound": f"<= {max_cold_away:g}",
                                            "ok": cold["turned_away_fraction"] <= max_cold_away}
    if warm:
        out["warm_turned_away"] = {"value": warm["turned_away"], "bound": "== 0", "ok": warm["turned_away"] == 0}
        p99 = warm["ttft_p99_s"]
        out["warm_ttft_p99_s"] = {"value": p99, "bound": f"<= {max_warm_p99_s:g}",
                                  "ok": math.isfinite(p99) and p99 <= max_warm_p99_s}
    if warm and vllm:
        ratio = warm["tokens_per_s"] / vllm["tokens_per_s"] if vllm["tokens_per_s"] > 0 else math.inf
        out["warm_vs_vllm_tokens_per_s"] = {"value": ratio, "bound": f">= {min_speedup:g}", "ok": ratio >= min_speedup}
    return out


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return "inf" if math.isinf(value) else f"{value:.{digits}f}"
    return str(value)


def table(rounds: dict[str, dict[str, Any]]) -> str:
    """The rounds side by side, one row each."""
    cols = [("round", None), ("requests", "requests"), ("served", "served"), ("turned away", "turned_away"),
            ("failed", "failed"), ("TTFT p50 s", "ttft_p50_s"), ("TTFT p99 s", "ttft_p99_s"),
            ("tokens/s", "tokens_per_s"), ("wall s", "wall_s"), ("load 1m", "load_before")]
    rows = [[name] + [_fmt(f[key][0] if key == "load_before" else f[key]) for _, key in cols[1:]]
            for name, f in rounds.items()]
    header = [c for c, _ in cols]
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(cols))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


# -- processes ---------------------------------------------------------------------------------
def free_port() -> int:
    """A loopback port free right now (for a server the bench starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: Any, key: str, timeout: float = 120.0) -> Any:
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def stop_group(proc: subprocess.Popen | None, grace_s: float = 60.0) -> None:
    """SIGTERM to the process group we started (its own session), SIGKILL after `grace_s`."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


def start_mesh(workdir: Path, allowed: Path, cpu_nodes: int, extra: Sequence[str]) -> ServiceProcess:
    """`mesh serve --demo --allowed-dir ALLOWED` on a fresh data folder, its log in the
    work folder; waits for its ready line (mesh.bench.serve_process: it dies with the bench)."""
    data = workdir / "mesh-data"
    data.mkdir()
    return start_service(data, ["--demo", "--allowed-dir", str(allowed), "--cpu-nodes", str(cpu_nodes), *extra],
                         log=workdir / "mesh-serve.log")


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a server's log, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def register_copies(service: ServiceProcess, allowed: Path, demo: Path, copies: int) -> list[str]:
    """Copy the demo GGUF `copies` times into the demo tenant's folder of `allowed` (a
    tenant registers paths under <allowed-dir>/<tenant>/) and register each by path.
    Returns the names."""
    names = []
    for k in range(copies):
        name = f"bench/copy-{k}"
        path = allowed / DEMO_TENANT / f"copy-{k}.gguf"
        if not path.exists():
            shutil.copyfile(demo, path)
        _post(f"{service.url}/v1/models", {"name": name, "path": path.name}, service.key)
        names.append(name)
    return names


def default_vllm_python() -> str | None:
    python = os.environ.get("MESH_VLLM_PYTHON")
    if python:
        return python
    venv = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else None


def hf_folder(python: str, demo: Path, cache: Path) -> Path:
    """The demo model as a Hugging Face folder, converted once (mesh.modelfiles.convert)."""
    out = cache / "smollm2-hf"
    if (out / "config.json").is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([python, "-m", "mesh.modelfiles.convert", "gguf-to-hf", str(demo), str(out)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"converting {demo} to a Hugging Face folder failed: {done.stderr[-2000:]}")
    return out


@dataclass
class VllmServers:
    procs: list[subprocess.Popen] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    start_s: float = 0.0


def add_server_options(p: argparse.ArgumentParser) -> None:
    """The options of the systems a live bench starts: Mesh's service and vLLM's servers."""
    p.add_argument("--cpu-nodes", type=int, default=1, help="CPU node agents of the Mesh service (default 1)")
    p.add_argument("--mesh-arg", action="append", default=[], help="one more argument for mesh serve (repeat)")
    p.add_argument("--vllm-python", default=None, help="Python of vLLM's environment "
                                                        "(default $MESH_VLLM_PYTHON, else <repo>/.venv-vllm)")
    p.add_argument("--vllm-model", default=None, help="Hugging Face folder of the demo model "
                                                       "(default: converted once from the demo GGUF)")
    p.add_argument("--vllm-kv-gib", type=int, default=1,
                   help="KV cache per vLLM server, whole GiB: vLLM's CPU build takes no fraction (default 1)")
    p.add_argument("--vllm-start-timeout", type=float, default=1200.0, help="seconds for the vLLM servers to answer")
    p.add_argument("--vllm-arg", action="append", default=[], help="one more argument for each vLLM server (repeat)")


def start_vllm(python: str, model_dir: Path, names: Sequence[str], workdir: Path, kv_gib: int,
               extra: Sequence[str], servers: VllmServers) -> None:
    """One vLLM OpenAI server per name (its CPU build), all started at once; fills `servers`
    as it goes (so the caller can stop what was started)."""
    cache = workdir / "vllm-cache"
    for sub in ("vllm", "inductor", "tmp"):
        (cache / sub).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
               TMPDIR=str(cache / "tmp"), VLLM_USE_AOT_COMPILE="0", HF_HUB_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE=f"{kv_gib:g}", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("PYTHONPATH", None)  # vLLM's environment needs nothing of Mesh
    for name in names:
        port = free_port()
        log = workdir / f"vllm-{name.replace('/', '_')}.log"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "2048", "--dtype", "bfloat16",
               "--kv-cache-memory-bytes", str(int(kv_gib * 2**30)), *extra]
        with open(log, "w") as out:
            servers.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                  start_new_session=True))
        servers.urls.append(f"http://127.0.0.1:{port}")
        servers.logs.append(log)


def wait_vllm(servers: VllmServers, timeout_s: float, what: str = "vLLM") -> float:
    """Until every server lists its model (any OpenAI server: `what` names them in errors);
    returns the seconds it took."""
    start = time.monotonic()
    pending = set(range(len(servers.urls)))
    while pending:
        for i in sorted(pending):
            if servers.procs[i].poll() is not None:
                raise RuntimeError(f"{what} server {i} exited ({servers.procs[i].returncode}): "
                                   f"{log_tail(servers.logs[i])}")
            try:
                with urllib.request.urlopen(f"{servers.urls[i]}/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        pending.discard(i)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() - start > timeout_s:
            raise RuntimeError(f"{what} servers {sorted(pending)} did not answer in {timeout_s:g} s: "
                               f"{log_tail(servers.logs[min(pending)])}")
        if pending:
            time.sleep(2)
    return time.monotonic() - start


def warm_request(target: Target) -> None:
    """One 2-token request to `target`, so what follows measures serving, not its first call."""
    _post(f"{target.url}/v1/chat/completions", {"model": target.model, "max_tokens": 2, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Hi"}]}, target.api_key)


# -- the command -------------------------------------------------------------------------------
def _round(rounds: dict[str, dict[str, Any]], name: str, targets: Sequence[Target], args: argparse.Namespace) -> None:
    before = os.getloadavg()
    outcomes, wall = asyncio.run(closed_loop(targets, args.clients, args.requests, args.max_tokens,
                                             not args.stop_at_eos, args.timeout, not args.no_progress, name))
    figures = summarize(outcomes, wall, args.requests)
    figures["load_before"] = [round(x, 2) for x in before]
    figures["load_after"] = [round(x, 2) for x in os.getloadavg()]
    figures["targets"] = sorted({f"{t.model}@{t.url}" for t in targets})
    rounds[name] = figures
    print(f"{name}: {figures['served']} served, {figures['turned_away']} turned away, {figures['failed']} failed, "
          f"TTFT p99 {_fmt(figures['ttft_p99_s'])} s, {_fmt(figures['tokens_per_s'], 1)} tokens/s, "
          f"wall {_fmt(figures['wall_s'], 1)} s, load {figures['load_before']}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from mesh.modelfiles.demo import demo_gguf_path
    from mesh.paths import data_dir

    try:
        import openai  # noqa: F401 - only checked for: the clients import it later
    except ImportError:
        print("mesh bench closed-loop: needs the openai package (pip install openai; in the test extra)",
              file=sys.stderr)
        return 2
    use_mesh = (args.mesh or not args.url) and not args.no_mesh
    rounds: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {"command": "mesh bench closed-loop " + " ".join(sys.argv[3:]) if len(sys.argv) > 2 else "",
                            "clients": args.clients, "requests": args.requests, "max_tokens": args.max_tokens,
                            "ignore_eos": not args.stop_at_eos, "cpus": os.cpu_count(),
                            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    names: list[str] = list(args.model)
    tmp = tempfile.TemporaryDirectory(prefix="mesh-bench-closed-loop-")
    workdir = Path(tmp.name)
    service: ServiceProcess | None = None
    vllm = VllmServers()
    try:
        if args.url:
            try:
                targets = targets_for(args.url, names, args.api_key)
            except ValueError as exc:
                print(f"mesh bench closed-loop: {exc}", file=sys.stderr)
                return 2
            _round(rounds, "given", targets, args)
        if use_mesh:
            demo = demo_gguf_path()
            allowed = workdir / "allowed"
            (allowed / DEMO_TENANT).mkdir(parents=True)
            for k in range(args.copies):  # the copies exist before the service starts; registering is the cold start
                shutil.copyfile(demo, allowed / DEMO_TENANT / f"copy-{k}.gguf")
            service = start_mesh(workdir, allowed, args.cpu_nodes, args.mesh_arg)
            t0 = time.monotonic()
            names = register_copies(service, allowed, demo, args.copies)
            meta["mesh_registration_s"] = time.monotonic() - t0
            targets = targets_for([service.url], names, service.key)
            _round(rounds, "mesh-cold", targets, args)
            _round(rounds, "mesh-warm", targets, args)
            stop_service(service)
            service = None
        if args.vllm:
            python = args.vllm_python or default_vllm_python()
            if not python:
                print("mesh bench closed-loop: --vllm needs vLLM's environment: --vllm-python, $MESH_VLLM_PYTHON or "
                      ".venv-vllm (scripts/setup.sh)", file=sys.stderr)
                return 2
            if not names:
                names = [f"bench/copy-{k}" for k in range(args.copies)]
            model_dir = Path(args.vllm_model) if args.vllm_model else hf_folder(python, demo_gguf_path(),
                                                                                  data_dir() / "bench")
            meta["vllm_python"], meta["vllm_model"] = python, str(model_dir)
            start_vllm(python, model_dir, names, workdir, args.vllm_kv_gib, args.vllm_arg, vllm)
            meta["vllm_start_s"] = wait_vllm(vllm, args.vllm_start_timeout)
            targets = [Target(n, u) for n, u in zip(names, vllm.urls)]
            for t in targets:
                warm_request(t)
            _round(rounds, "vllm", targets, args)
    except (RuntimeError, OSError, urllib.error.URLError) as exc:
        print(f"mesh bench closed-loop: {exc}", file=sys.stderr)
        if service is not None:
            print(f"mesh serve's log ends: {log_tail(service.log)}", file=sys.stderr)
        return 1
    finally:
        if service is not None:
            stop_service(service)
        for proc in vllm.procs:
            stop_group(proc)
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for log in workdir.glob("*.log"):
                shutil.copyfile(log, Path(args.logs) / log.name)
        tmp.cleanup()
    verdicts = checks(rounds)
    print(f"mesh bench closed-loop: {args.clients} closed-loop streaming clients, {args.requests} requests of "
          f"{args.max_tokens} tokens per round (greedy{', ignore_eos' if not args.stop_at_eos else ''}, no client "
          f"retries), over {len(names)} models; TTFT over served requests; {os.cpu_count()} CPUs")
    print(table(rounds))
    for k in ("mesh_registration_s", "vllm_start_s"):
        if k in meta:
            print(f"  {k}: {meta[k]:.1f}")
    for name, c in verdicts.items():
        print(f"  check {name}: {_fmt(c['value'])} (want {c['bound']}) {'ok' if c['ok'] else 'FAIL'}")
    if args.json:
        write_json(args.json, {"meta": meta, "rounds": rounds, "checks": verdicts})
    failed = any(f["failed"] for f in rounds.values()) or not all(c["ok"] for c in verdicts.values())
    return 1 if failed else 0
