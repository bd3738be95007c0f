"""`mesh bench control-plane`: what one service process's control plane costs per streamed token.

It starts `mesh serve --emulate DEVICES --policy POLICY` alone on this machine (emulated
nodes: real agent processes speaking the real protocol whose engines sleep the profile's
iteration times, so tokens cost the service what real ones would and the nodes no compute;
by default 8 A100s and `sllm`, which gives each model whole nodes: Mesh's own policy packs
instances onto few nodes, which caps tokens/s at one node's iterations, not at the control
plane), registers `--models` emulated models of `--model` (default llama-3.2-3b, the
cheapest tokens: 9.5 ms per batch-64 iteration) for a tenant of its own, and runs a load generator in a
separate process (`--load-processes`, so the client's CPU is its own and is reported):
closed-loop streaming clients, each sending `/v1/completions` with `--prompt-tokens` token
ids and `--max-tokens` (stream, usage), the next when the last ends (after a 429, when its
Retry-After is up, at most 1 s). The number of streams ramps (`--streams`, doubling by
default) until the service's event-loop lag p99 passes `--lag-limit-ms` (50 ms): each step
settles for `--settle-s`, then is measured for `--step-s`. Per step:

- streamed tokens/s the clients received (every token counted as it arrives, reconciled with
  each response's usage), requests completed / rejected (429) / errors;
- the service process's CPU (psutil): per 1,000 streamed tokens and as a share of one core;
  the agents' CPU (the service's child processes) and the load generator's, the same way;
- the service's event-loop lag p50/p99 (mesh.control.latency.LoopLagProbe: a 20 ms sleep's
  lateness, read from /admin/cluster as log-bucket histograms and subtracted between the
  step's two reads), with the p99 of its bound of what the service's own work caused (the
  rest is the process waiting for a core), and placement decisions' durations p50/p99;
- agent-to-service frames per second (every frame the service read from every agent) and
  tokens per frame; the service's RSS; this machine's load average.

The table says, for the last step under the lag limit, the tokens/s one service process
streamed there (the target: 20,000). `--json PATH` writes every step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from mesh.bench.report import write_json
from mesh.bench.serve_process import ServiceProcess, start_service, stop_service
from mesh.control.latency import between
from mesh.service.limits import CLIENT_KEEPALIVE_S
from mesh.tasks import cancel_all

# doubling, then steps of 1.5x past 128 streams, where the knee of a 2-core machine lies (a
# doubling ramp stepped from 14.9k tokens/s at lag p99 10 ms to 25-27k at 28-55 ms there)
DEFAULT_STREAMS = (32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
LAG_LIMIT_MS = 50.0
TARGET_TOKENS_PER_S = 20_000


# ---- the ramp: pure functions (tests/test_bench_control_plane.py) ------------------------------

def parse_streams(text: str) -> list[int]:
    """`--streams 32,64,128` -> [32, 64, 128]: increasing, each at least 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--streams {text!r}: want increasing integers, e.g. 32,64,128") from None
    if not values or any(v < 1 for v in values) or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"--streams {text!r}: want increasing integers >= 1, e.g. 32,64,128")
    return values


def over_limit(step: dict[str, Any], lag_limit_s: float) -> bool:
    """The ramp stops after a step whose event-loop lag p99 passed the limit (a step without
    a lag figure, where the probe never ran, counts as past it: nothing was measured)."""
    p99 = step.get("loop_lag_p99_s")
    return p99 is None or p99 > lag_limit_s


def best_under(steps: Sequence[dict[str, Any]], lag_limit_s: float) -> dict[str, Any] | None:
    """The step with the most streamed tokens/s among those with lag p99 within the limit."""
    ok = [s for s in steps if not over_limit(s, lag_limit_s)]
    return max(ok, key=lambda s: s["tokens_per_s"]) if ok else None


def per_thousand(cpu_s: float, tokens: int) -> float | None:
    """CPU seconds per 1,000 tokens; None without tokens."""
    return 1000.0 * cpu_s / tokens if tokens > 0 else None


def step_figures(streams: int, wall_s: float, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One step's figures from the two marks that bound it (see `_mark`)."""
    tokens = b["client"]["tokens"] - a["client"]["tokens"]
    frames = b["frames_in"] - a["frames_in"]
    service_cpu = b["service_cpu_s"] - a["service_cpu_s"]
    agents_cpu = b["agents_cpu_s"] - a["agents_cpu_s"]
    client_cpu = b["client"]["cpu_s"] - a["client"]["cpu_s"]
    lag = between(a["loop_lag"], b["loop_lag"])
    own = between(a["loop_lag"].get("own"), b["loop_lag"].get("own") or {})
    decisions = between(a["decisions"], b["decisions"])

    def diff(key: str) -> int:
        return b["client"][key] - a["client"][key]

    return {
        "streams": streams, "wall_s": wall_s, "tokens": tokens, "tokens_per_s": tokens / wall_s,
        "requests_completed": diff("completed"), "rejected_429": diff("rejected"), "errors": diff("errors"),
        "lost": diff("lost"),
        "service_cpu_per_1k_tokens_s": per_thousand(service_cpu, tokens), "service_cpu_cores": service_cpu / wall_s,
        "agents_cpu_per_1k_tokens_s": per_thousand(agents_cpu, tokens), "agents_cpu_cores": agents_cpu / wall_s,
        "client_cpu_per_1k_tokens_s": per_thousand(client_cpu, tokens), "client_cpu_cores": client_cpu / wall_s,
        "loop_lag_p50_s": lag["p50_s"], "loop_lag_p99_s": lag["p99_s"], "loop_lag_samples": lag["count"],
        "own_lag_p99_s": own["p99_s"],  # at most this much of the lag was the service's own work
        "decision_p50_s": decisions["p50_s"], "decision_p99_s": decisions["p99_s"], "decisions": decisions["count"],
        "frames_per_s": frames / wall_s, "tokens_per_frame": tokens / frames if frames else None,
        "service_rss_mb": b["service_rss_bytes"] / 2**20, "load_avg_1m": b["load_avg"][0],
    }


# ---- the load generator (its own process) -----------------------------------------------------

_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')


class Load:
    """Closed-loop streaming clients in one process; `streams` sets how many run."""

    def __init__(self, url: str, key: str, models: list[str], max_tokens: int, prompt_tokens: int,
                 timeout_s: float) -> None:
        self.url, self.models, self.max_tokens, self.timeout_s = url.rstrip("/"), models, max_tokens, timeout_s
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.prompt = list(range(1000, 1000 + prompt_tokens))
        self.counts = {"tokens": 0, "completed": 0, "rejected": 0, "errors": 0, "lost": 0, "started": 0}
        self.first_error = ""
        self.first_rejection = ""
        self.target = 0
        self._tasks: list[asyncio.Task] = []
        self._session: Any = None

    async def open(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0,
                                                                             keepalive_timeout=CLIENT_KEEPALIVE_S),
                                              timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def close(self) -> None:
        self.target = 0
        await cancel_all(self._tasks)
        if self._session is not None:
            await self._session.close()

    def set_streams(self, n: int, first_index: int = 0) -> None:
        """Run `n` streams (stream i sends to model (first_index + i) mod models)."""
        self.target = n
        loop = asyncio.get_running_loop()
        while len(self._tasks) < n:
            i = len(self._tasks)
            self._tasks.append(loop.create_task(self._stream(i, self.models[(first_index + i) % len(self.models)])))

    async def _stream(self, index: int, model: str) -> None:
        body = json.dumps({"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        while index < self.target:
            wait = await self._one(body)
            if wait:
                await asyncio.sleep(wait)

    async def _one(self, body: bytes) -> float:
        """One request; the seconds to wait before the next (after a 429)."""
        import aiohttp

        c = self.counts
        c["started"] += 1
        counted = 0
        tail = b""
        try:
            async with self._session.post(f"{self.url}/v1/completions", data=body, headers=self.headers) as resp:
                if resp.status == 429:
                    c["rejected"] += 1
                    why = await resp.read()
                    if not self.first_rejection:
                        self.first_rejection = why[:400].decode(errors="replace")
                    try:
                        return min(1.0, max(0.05, float(resp.headers.get("Retry-After", "0.2"))))
                    except ValueError:
                        return 0.2
                if resp.status != 200:
                    c["errors"] += 1
                    self.first_error = self.first_error or f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return 0.2
                async for chunk in resp.content.iter_any():
                    n = chunk.count(b"data: ")  # every event counts as a token as it arrives ...
                    counted += n
                    c["tokens"] += n
                    tail = (tail + chunk)[-4096:]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            c["errors"] += 1
            self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"
            c["tokens"] -= counted
            return 0.2
        m = _COMPLETION.search(tail)
        if b'data: {"error"' in tail or m is None:
            c["tokens"] -= counted
            c["errors" if b'"error"' in tail else "lost"] += 1
            if not self.first_error:
                self.first_error = tail[-300:].decode(errors="replace")
            return 0.2
        c["tokens"] += int(m.group(1)) - counted  # ... and the response's usage settles the count
        c["completed" if b"data: [DONE]" in tail else "lost"] += 1
        return 0.0

    def mark(self) -> dict[str, Any]:
        t = os.times()
        return {**self.counts, "cpu_s": t.user + t.system, "time": time.monotonic(), "first_error": self.first_error,
                "first_rejection": self.first_rejection}


async def _worker(args: dict[str, Any]) -> None:
    """Commands on stdin, one JSON object a line: {"streams": N} | {"mark": 1} | {"quit": 1};
    each answered on stdout by one JSON line."""
    load = Load(args["url"], args["key"], args["models"], args["max_tokens"], args["prompt_tokens"],
                args["timeout_s"])
    await load.open()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            cmd = json.loads(line)
            if "streams" in cmd:
                load.set_streams(int(cmd["streams"]), int(args.get("first_index", 0)))
                reply: dict[str, Any] = {"ok": True}
            elif "mark" in cmd:
                reply = load.mark()
            else:
                break
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        await load.close()


class _Worker:
    """The parent's handle on one load-generator process."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "mesh.bench.control_plane", json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator exited ({self.proc.wait()})")
        return json.loads(line)

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(15)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# ---- the service -------------------------------------------------------------------------------

def _call(url: str, token: str, method: str, path: str, body: Any = None) -> Any:
    req = urllib.request.Request(f"{url}{path}", method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{method} {path} answered {exc.code}: {exc.read()[:300]!r}") from None
    return json.loads(raw) if raw else None


def start_emulated(data_dir: Path, emulate: str, extra: Sequence[str] = ()) -> ServiceProcess:
    """`mesh serve --emulate EMULATE` on a free port (mesh.bench.serve_process: it dies with the bench)."""
    config = data_dir / "bench.json"  # every stream comes from this one address: lift the per-client bound
    config.write_text(json.dumps({"max_connections": 65536, "max_connections_per_client": 65536}))
    return start_service(data_dir / "data", ["--config", str(config), "--emulate", emulate, *extra])


def set_up(url: str, token: str, model: str, count: int, tpot_slo_s: float | None) -> tuple[str, list[str]]:
    """A tenant without quotas and `count` emulated models of `model` (TPOT SLO `tpot_slo_s`,
    else the default): (its key, model names)."""
    tenant = "cpbench"
    _call(url, token, "POST", "/admin/tenants", {"name": tenant})
    key = _call(url, token, "POST", f"/admin/tenants/{tenant}/keys", {"label": "mesh bench control-plane"})["key"]
    _call(url, token, "PUT", f"/admin/tenants/{tenant}/quota", {
        "models": None, "model_bytes": None, "concurrent_requests": None, "requests_per_s": None, "burst": None})
    names = [f"m{i:03d}" for i in range(count)]
    for name in names:
        body: dict[str, Any] = {"name": name, "emulate": model}
        if tpot_slo_s:
            body["slo"] = {"tpot_s": tpot_slo_s}
        _call(url, token, "POST", f"/admin/tenants/{tenant}/models", body)
    return key, names


def _cpu_s(proc: Any) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _mark(url: str, token: str, service: Any, workers: list[_Worker]) -> dict[str, Any]:
    """Everything a step is measured by, read at one moment (the two reads bound a step)."""
    import psutil

    clients = [w.ask({"mark": 1}) for w in workers]
    client = {k: sum(c[k] for c in clients) for k in ("tokens", "completed", "rejected", "errors", "lost", "cpu_s")}
    for why in ("first_error", "first_rejection"):
        client[why] = next((c[why] for c in clients if c[why]), "")
    view = _call(url, token, "GET", "/admin/cluster")
    agents = 0.0
    for child in service.children(recursive=True):
        try:
            agents += _cpu_s(child)
        except psutil.Error:
            pass
    return {"client": client, "service_cpu_s": _cpu_s(service), "agents_cpu_s": agents,
            "service_rss_bytes": service.memory_info().rss,
            "frames_in": sum(n.get("frames_in", 0) for n in view["nodes"]),
            "loop_lag": view["control_plane"]["loop_lag"], "decisions": view["dispatcher"]["decision_times"],
            "load_avg": os.getloadavg(), "time": time.monotonic()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import psutil

    streams = parse_streams(args.streams)
    lag_limit_s = args.lag_limit_ms / 1000.0
    tmp = tempfile.TemporaryDirectory(prefix="mesh-bench-cp-")
    mesh = None
    workers: list[_Worker] = []
    steps: list[dict[str, Any]] = []
    try:
        serve_args = ["--policy", args.policy, *(args.serve_arg or ())]
        mesh = start_emulated(Path(tmp.name), args.emulate, serve_args)
        url, token = mesh.url, mesh.admin_token
        service = psutil.Process(mesh.pid)
        print(f"mesh bench control-plane: service pid {mesh.pid} at {url}", file=sys.stderr, flush=True)
        key, models = set_up(url, token, args.model, args.models, args.tpot_slo_s)
        per = max(1, math.ceil(len(models) / args.load_processes))
        for w in range(args.load_processes):
            workers.append(_Worker({"url": url, "key": key, "models": models, "max_tokens": args.max_tokens,
                                    "prompt_tokens": args.prompt_tokens, "timeout_s": args.timeout,
                                    "first_index": w * per}))
        for n in streams:
            share = [n // len(workers) + (i < n % len(workers)) for i in range(len(workers))]
            for w, k in zip(workers, share):
                w.ask({"streams": k})
            time.sleep(args.settle_s)
            a = _mark(url, token, service, workers)
            time.sleep(args.step_s)
            b = _mark(url, token, service, workers)
            step = step_figures(n, b["time"] - a["time"], a, b)
            for why in ("first_error", "first_rejection"):
                if b["client"][why]:
                    step[why] = b["client"][why]
            steps.append(step)
            _progress(step)
            if over_limit(step, lag_limit_s) or mesh.proc.poll() is not None:
                break
    finally:
        for w in workers:
            w.stop()
        if mesh is not None:
            stop_service(mesh)  # (its load stopped above: nothing to drain)
        tmp.cleanup()
    best = best_under(steps, lag_limit_s)
    return {"emulate": args.emulate, "policy": args.policy, "model": args.model, "models": args.models,
            "tpot_slo_s": args.tpot_slo_s, "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens, "load_processes": args.load_processes, "step_s": args.step_s,
            "settle_s": args.settle_s, "lag_limit_s": lag_limit_s, "cpu_count": os.cpu_count(),
            "steps": steps, "best": best, "target_tokens_per_s": TARGET_TOKENS_PER_S,
            "met_target": bool(best and best["tokens_per_s"] >= TARGET_TOKENS_PER_S)}


def _progress(step: dict[str, Any]) -> None:
    print(f"  {step['streams']} streams: {step['tokens_per_s']:,.0f} tokens/s, lag p99 "
          f"{_ms(step['loop_lag_p99_s'])} ms (own work <= {_ms(step['own_lag_p99_s'])} ms), service "
          f"{step['service_cpu_cores']:.2f} cores, agents {step['agents_cpu_cores']:.2f}, client "
          f"{step['client_cpu_cores']:.2f}, "
          f"load {step['load_avg_1m']:.2f}", file=sys.stderr, flush=True)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


COLUMNS = [  # header, key, format
    ("streams", "streams", "d"), ("tokens/s", "tokens_per_s", ",.0f"), ("429", "rejected_429", "d"),
    ("errors", "errors", "d"), ("svc CPU s/1k tok", "service_cpu_per_1k_tokens_s", ".3f"),
    ("svc cores", "service_cpu_cores", ".2f"), ("agents cores", "agents_cpu_cores", ".2f"),
    ("client cores", "client_cpu_cores", ".2f"), ("lag p50 ms", "loop_lag_p50_s", "ms"),
    ("lag p99 ms", "loop_lag_p99_s", "ms"), ("own p99 ms", "own_lag_p99_s", "ms"),
    ("decision p50 ms", "decision_p50_s", "ms"),
    ("decision p99 ms", "decision_p99_s", "ms"), ("frames/s", "frames_per_s", ",.0f"),
    ("tok/frame", "tokens_per_frame", ".1f"), ("RSS MB", "service_rss_mb", ".0f"), ("load 1m", "load_avg_1m", ".2f"),
]


def print_table(fig: dict[str, Any]) -> None:
    title = (f"mesh bench control-plane: --emulate {fig['emulate']} --policy {fig['policy']}, {fig['models']} x "
             f"{fig['model']}, "
             f"{fig['prompt_tokens']}-token prompts, max_tokens {fig['max_tokens']}, {fig['cpu_count']} cores, "
             f"{fig['step_s']:g} s a step")
    rows = [[_ms(s.get(key)) if fmt == "ms" else _num(s.get(key), fmt) for _h, key, fmt in COLUMNS]
            for s in fig["steps"]]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(h for h, _k, _f in COLUMNS))
        for row in rows:
            print("  ".join(row))
    else:
        table = Table(title=title)
        for header, _key, _fmt in COLUMNS:
            table.add_column(header, justify="right")
        for row in rows:
            table.add_row(*row)
        Console(width=240).print(table)
    best = fig["best"]
    limit = fig["lag_limit_s"] * 1000
    if best is None:
        print(f"no step kept the event-loop lag p99 under {limit:g} ms")
    else:
        print(f"one service process streamed {best['tokens_per_s']:,.0f} tokens/s at {best['streams']} streams with "
              f"event-loop lag p99 {_ms(best['loop_lag_p99_s'])} ms (limit {limit:g} ms; target "
              f"{fig['target_tokens_per_s']:,}: {'met' if fig['met_target'] else 'not met'})")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("control-plane", help="the service's own cost per streamed token, ramping streams until "
                                             "its event-loop lag p99 passes 50 ms (emulated nodes)")
    p.add_argument("--emulate", default="a100-80gb:8", help="emulated nodes (default %(default)s)")
    p.add_argument("--model", default="llama-3.2-3b", help="the catalog model each registered model emulates "
                                                            "(default %(default)s: the cheapest tokens)")
    p.add_argument("--models", type=int, default=8, help="emulated models registered (default %(default)s)")
    p.add_argument("--policy", default="sllm",
                   help="the service's --policy (default %(default)s: whole nodes per instance, so tokens/s is bound "
                        "by the control plane, not by how many instances share a node's iterations)")
    p.add_argument("--tpot-slo-s", type=float, default=None, help="the models' TPOT SLO (default: the service's)")
    p.add_argument("--streams", default=",".join(map(str, DEFAULT_STREAMS)),
                   help="concurrent streams of each step, increasing (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt token ids per request (default %(default)s)")
    p.add_argument("--step-s", type=float, default=10.0, help="seconds measured per step (default %(default)s)")
    p.add_argument("--settle-s", type=float, default=4.0,
                   help="seconds each step runs before it is measured (default %(default)s)")
    p.add_argument("--lag-limit-ms", type=float, default=LAG_LIMIT_MS,
                   help="stop after the step whose event-loop lag p99 passes this (default %(default)s)")
    p.add_argument("--load-processes", type=int, default=1, help="load-generator processes (default %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    p.add_argument("--serve-arg", action="append", metavar="ARG",
                   help="an extra argument for mesh serve (repeat: --serve-arg=--policy --serve-arg=sllm)")
    p.add_argument("--json", metavar="PATH", help="write every step's figures as JSON")

    def go(a: argparse.Namespace) -> int:
        if a.load_processes < 1 or a.models < 1 or a.max_tokens < 1 or a.prompt_tokens < 1:
            print("mesh bench control-plane: --load-processes, --models, --max-tokens and --prompt-tokens must be "
                  ">= 1", file=sys.stderr)
            return 2
        try:
            fig = run(a)
        except ValueError as exc:
            print(f"mesh bench control-plane: {exc}", file=sys.stderr)
            return 2
        print_table(fig)
        if a.json:
            write_json(a.json, fig)
        return 0

    p.set_defaults(func=go)


def main(argv: list[str] | None = None) -> int:
    """The load generator's side: `python -m mesh.bench.control_plane '<json args>'`."""
    from mesh.lifetime import die_with_parent

    die_with_parent()  # never outlive the bench
    asyncio.run(_worker(json.loads((argv or sys.argv[1:])[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
