"""`mesh bench serve`: load on a running `mesh serve` from a second process, over loopback.

`--clients` concurrent clients send `--requests` streaming chat completions in all (each
client sends its next request when its previous one ends) with small `max_tokens`, and the
benchmark prints throughput, TTFT p50/p99 (to the first content chunk, as the client sees
it) and counts: completed, rejected with 429 (answered: the scheduler could not place the
request within its SLO), errors (any other status, an error event, a broken stream), and
lost (a stream that ended without [DONE] and without an error: the target is zero).

Without `--url` it starts its own server (`mesh serve --demo --port 0`, temporary data
folder; mesh.bench.serve_process: it dies with the bench) and stops it afterwards. TTFT percentiles are given over
served requests (`ttft_p99_served_s`) and over all requests (`ttft_p99_all_s`, a 429 or error counted as never served).
Exit status 1 when any request errored or was lost, or fewer than `--min-completed` (default 0.9) of them completed.
`--ttft-slo S` registers a copy of the demo model with a
TTFT SLO of S seconds and loads that one instead, to see the service queue rather than
reject. `--cpu-nodes N` starts the server with N CPU node agents and reports the instances
per node and the weights transfers (scale-outs) the load caused.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.bench.report import emit
from mesh.bench.serve_process import start_service, stop_service
from mesh.service.limits import CLIENT_KEEPALIVE_S


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load benchmark of mesh serve: concurrent streaming clients on loopback")
    p.add_argument("--url", help="a running server (default: start one with --demo)")
    p.add_argument("--api-key", help="tenant key for --url")
    p.add_argument("--model", default="demo/smollm2")
    p.add_argument("--clients", type=int, default=200, help="concurrent clients (default 200)")
    p.add_argument("--requests", type=int, default=200, help="requests in all (default 200)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ttft-slo", type=float, default=None,
                   help="register the demo model again with this TTFT SLO (seconds) and use it (own server only)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("--cpu-nodes", type=int, default=1,
                   help="CPU node agents of the server it starts (default 1); reports the scale-outs")
    p.add_argument("--min-completed", type=float, default=0.9,
                   help="exit status 1 when completed/requests is below this (default %(default)s)")
    p.add_argument("--json", help="write the figures as JSON here")
    p.set_defaults(func=run)


def exit_status(figures: dict[str, Any], min_completed: float) -> int:
    """1 when a request errored or was lost, or fewer than `min_completed` of them completed
    (a 429 is not an error but is not served either); else 0."""
    if figures["errors"] or figures["lost"]:
        return 1
    return 0 if figures["completed_fraction"] >= min_completed else 1


@dataclass
class Result:
    status: str  # ok, rejected, error, lost
    ttft_s: float | None = None
    total_s: float = 0.0
    tokens: int = 0
    detail: str = ""


async def one_request(session: Any, url: str, key: str, model: str, i: int, max_tokens: int, timeout: float) -> Result:
    import aiohttp

    loop = asyncio.get_running_loop()
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0.7, "seed": i,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Write one short sentence about the number {i}."}]}
    start = loop.time()
    ttft = None
    tokens = 0
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status == 429:
                message = (await resp.json()).get("error", {}).get("message", "")
                return Result("rejected", total_s=loop.time() - start, detail=_reason_kind(message))
            if resp.status != 200:
                return Result("error", total_s=loop.time() - start,
                              detail=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            done = False
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Result("error", ttft, loop.time() - start, tokens,
                                  f"stream error: {chunk['error']['message'][:200]}")
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and ttft is None:
                    ttft = loop.time() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            if not done:
                return Result("lost", ttft, loop.time() - start, tokens, "stream ended without [DONE] or an error")
            return Result("ok", ttft, loop.time() - start, tokens)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Result("error", ttft, loop.time() - start, tokens, f"{type(exc).__name__}: {exc}")


async def load(url: str, key: str, model: str, clients: int, requests: int, max_tokens: int,
               timeout: float) -> tuple[list[Result], float]:
    import aiohttp

    loop = asyncio.get_running_loop()
    counter = iter(range(requests))
    results: list[Result] = []

    async def client(session: aiohttp.ClientSession) -> None:
        for i in counter:
            results.append(await one_request(session, url, key, model, i, max_tokens, timeout))

    connector = aiohttp.TCPConnector(limit=clients + 8, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = loop.time()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        wall = loop.time() - start
    return results, wall


def _reason_kind(message: str) -> str:
    """The kind of a 429's reason: the shadow-validation case, batch or memory limits."""
    m = re.search(r"SLO \((.*)\)\. Retry", message)
    text = m.group(1) if m else message
    for kind in ("own_prefill_late", "existing_request_late", "decode_round_over_tpot", "maximum batch", "memory",
                 "queued"):
        if kind in text:
            return kind.replace(" ", "_")
    return text[:60]


def ttft_percentile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (sorted; math.inf stands for a request never served): the
    smallest value with at least q of them at or below it; inf when it falls among the
    unserved, nan when there are none."""
    if not values:
        return float("nan")
    return values[max(0, math.ceil(q * len(values)) - 1)]


def summarize(results: list[Result], wall: float, sent: int) -> dict[str, Any]:
    """The figures of a run. TTFT percentiles twice: over served requests (`_served_s`, kept as
    `ttft_p50_s` / `ttft_p99_s` too) and over ALL requests sent (`_all_s`), where a request
    rejected with 429, errored, lost or never answered counts as never served (infinite TTFT),
    so a run that turns most requests away cannot show a good TTFT."""
    ok = [r for r in results if r.status == "ok"]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    everyone = ttfts + [math.inf] * (sent - len(ttfts))
    tokens = sum(r.tokens for r in ok)

    figures = {
        "requests": sent,
        "answered": len(results),
        "completed": len(ok),
        "completed_fraction": len(ok) / sent if sent else 0.0,
        "rejected_429": sum(r.status == "rejected" for r in results),
        "errors": sum(r.status == "error" for r in results),
        "lost": sum(r.status == "lost" for r in results) + (sent - len(results)),
        "wall_s": wall,
        "throughput_req_per_s": len(ok) / wall if wall else 0.0,
        "throughput_tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_p50_s": ttft_percentile(ttfts, 0.50),
        "ttft_p99_s": ttft_percentile(ttfts, 0.99),
        "ttft_p50_served_s": ttft_percentile(ttfts, 0.50),
        "ttft_p99_served_s": ttft_percentile(ttfts, 0.99),
        "ttft_p50_all_s": ttft_percentile(everyone, 0.50),
        "ttft_p99_all_s": ttft_percentile(everyone, 0.99),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
        "latency_p50_s": statistics.median(r.total_s for r in ok) if ok else float("nan"),
    }
    reasons: dict[str, int] = {}
    for r in results:
        if r.status == "rejected":
            reasons[r.detail] = reasons.get(r.detail, 0) + 1
    for kind, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        figures[f"rejected_because_{kind}"] = n
    errors = [r.detail for r in results if r.status in ("error", "lost")]
    if errors:
        figures["first_error"] = errors[0]
    return figures


def _admin(url: str, token: str, method: str, path: str, body: Any = None, key: str | None = None) -> Any:
    import urllib.request

    req = urllib.request.Request(f"{url}{path}", method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Bearer {key or token}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def server_args(allowed: Path | None, cpu_nodes: int = 1) -> list[str]:
    """`mesh serve`'s arguments for the load benchmarks (this one and `mesh bench soak`): the
    demo model, `cpu_nodes` CPU node agents, `allowed` as --allowed-dir."""
    return ["--demo", "--cpu-nodes", str(cpu_nodes), *(["--allowed-dir", str(allowed)] if allowed is not None else [])]


def _scale_outs(cluster: dict[str, Any]) -> dict[str, Any]:
    """Instances per node and the weights transfers the run caused (the server's own view)."""
    out: dict[str, Any] = {}
    for node in cluster["nodes"]:
        out[f"instances_{node['node_id']}"] = len(node["instances"])
    transfers = [t for m in (cluster.get("weights") or {}).get("models", {}).values() for t in m["transfers"]]
    out["weights_transfers"] = len(transfers)
    out["weights_transfer_s"] = [t["seconds"] for t in transfers]
    out["weights_transfer_sources"] = [",".join(t["sources"]) + "->" + ",".join(t["targets"]) for t in transfers]
    return out


def _wait_warm(url: str, key: str, model: str) -> None:
    """One request first, so the figures measure serving, not the cold start."""
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    _admin(url, "", "POST", "/v1/chat/completions", body, key=key)


def run(args: argparse.Namespace) -> int:
    from mesh.modelfiles.demo import demo_gguf_path

    service = None
    tmp = None
    model = args.model
    try:
        if args.url:
            if not args.api_key:
                print("mesh bench serve: --url needs --api-key", file=sys.stderr)
                return 2
            url, key = args.url.rstrip("/"), args.api_key
        else:
            tmp = tempfile.TemporaryDirectory(prefix="mesh-bench-serve-")
            demo = demo_gguf_path()
            service = start_service(Path(tmp.name), server_args(demo.parent if args.ttft_slo else None,
                                                                 args.cpu_nodes))
            url, key, token = service.url, service.key, service.admin_token
            if args.ttft_slo:
                model = "bench/smollm2-relaxed"
                _admin(url, token, "POST", "/v1/models", {"name": model, "path": demo.name,
                                                           "slo": {"ttft_s": args.ttft_slo}}, key=key)
        _wait_warm(url, key, model)
        results, wall = asyncio.run(load(url, key, model, args.clients, args.requests, args.max_tokens, args.timeout))
        figures = summarize(results, wall, args.requests)
        figures["clients"] = args.clients
        figures["max_tokens"] = args.max_tokens
        figures["model"] = model
        if service is not None:
            figures.update(_scale_outs(_admin(url, token, "GET", "/admin/cluster")))
        emit(f"mesh bench serve: {args.clients} concurrent streaming clients, {args.requests} requests, "
             f"max_tokens {args.max_tokens}, model {model}", figures, args.json,
             {"wall_s": "s", "ttft_p50_s": "s", "ttft_p99_s": "s", "ttft_mean_s": "s", "latency_p50_s": "s",
              "ttft_p50_served_s": "s", "ttft_p99_served_s": "s", "ttft_p50_all_s": "s", "ttft_p99_all_s": "s",
              "throughput_req_per_s": "req/s", "throughput_tokens_per_s": "tokens/s"})
        status = exit_status(figures, args.min_completed)
        if status:
            print(f"mesh bench serve: FAIL: {figures['completed']}/{figures['requests']} completed "
                  f"(--min-completed {args.min_completed:g}), {figures['rejected_429']} rejected with 429, "
                  f"{figures['errors']} errors, {figures['lost']} lost", file=sys.stderr)
        return status
    finally:
        if service is not None:
            stop_service(service)
        if tmp is not None:
            tmp.cleanup()
