"""`mesh bench soak`: a real service run for a set time under churn, watched for growth and loss.

It starts `mesh serve --demo --cpu-nodes 2` (real node agents, the OpenVINO engine, the demo
model; it dies with the bench, mesh.bench.serve_process), then for `--minutes` (default 30):

- well-behaved tenants stream: `--clients` clients of the demo tenant send streaming chat
  completions back to back (`--max-tokens` each);
- `--churn-tenants` churn tenants (default 6), one loop each, register a model (the demo GGUF
  by path, in their folder) and delete it, cycle after cycle. Each tenant keeps to the
  default registration rate (30 a minute, burst 10: no quota is lifted; a 429 is waited out
  as its Retry-After says, and counted). A cycle: register (201) -> for every
  `--churn-ready-every`-th model, ready (the service described it: its first host copy is on
  a node, that node's agent described it and holds its state; it starts the model's
  tokenizer and its build ahead) -> for every `--serve-every`-th, one request (an instance
  starts, serves and is stopped with it) -> delete (200; the others are deleted at once, their
  registration's copy and description cancelled under way) -> nothing of it is left (the
  admin API lists it no more; the cluster's books, and every agent's stats read at least two
  stats calls after the service forgot it, hold nothing of it; no instance of it). A cycle
  not clean within `--clean-timeout` counts as left behind;
- a client hangs up mid-stream every `--hangup-every` seconds (after its first chunk);
- a node agent is killed (SIGKILL) every `--kill-every` seconds, the nodes other than
  `--spare` in turn; its supervisor restarts it. The spare node's agent is never killed, so
  its RSS growth after the warm-up is measured over the whole run.

Every `--sample-every` seconds it records the resident memory (RSS) and open files of every
process of the service (the server, its agents, their engine and tokenizer workers) with
psutil, and the machine's load average. At the end the load stops, and it checks that
nothing is left behind: no model of a churn tenant in the admin API, the cluster's books or
any agent's state (its stats' `models`), no request waiting or in flight.

Outcomes: `ok` (streamed to [DONE]), `turned_away` (a 4xx or 429 answer), `failed` (a 5xx, or
an error event in the stream: a killed agent's requests end so), `hung_up` (ours), and `lost`
(no answer: a stream cut without [DONE] or an error event, a connection error or a timeout).
The target is no request lost. RSS growth is measured from the end of the warm-up
(`--warmup-minutes`, default 5, at most a third of the run) to the end, for the service and
the spare node's agent; every other agent incarnation (a killed agent's, a restarted one's)
and every worker is listed with its RSS at its start, after its own warm-up, at its end and
at most. A table, JSON (`--json`), a markdown report (`--markdown`: the figures
docs/service.md quotes) and a plot of RSS and open files over time (`--plot`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from mesh.bench.report import emit, write_json
from mesh.bench.serve_load import server_args
from mesh.bench.serve_process import start_service, stop_service

CHURN = "churn"  # the churn tenants are churn-0, churn-1, ...
THIRTY_MINUTES = """\
The 30-minute soak behind docs/service.md's figures (about 35 minutes with the
start and the final checks; run it on a machine no other benchmark shares, and say so if
one does):

  PYTHONPATH=$PWD python3 -m mesh bench soak --json docs/eval/soak_30min.json \\
      --markdown docs/eval/soak_30min.md --plot docs/figures/soak_30min.png

Exit status 1 if a request was lost or a churn model was left behind (in a cycle or at the
end). The markdown holds the table docs/service.md quotes; the JSON every figure, every
cycle's phases and every sample."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="soak test: a real service under churn for a set time; RSS, open files, "
                                    "outcomes, anything lost or left behind",
                       description=__doc__.split("\n\n", 1)[0], epilog=THIRTY_MINUTES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default 30)")
    p.add_argument("--warmup-minutes", type=float, default=5.0,
                   help="RSS growth is measured after this (default 5; at most a third of --minutes)")
    p.add_argument("--clients", type=int, default=2, help="streaming clients of the demo tenant (default 2)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--churn-tenants", type=int, default=6,
                   help="churn tenants, one register/delete loop each, each within the default registration "
                        "rate (default 4)")
    p.add_argument("--churn-ready-every", type=int, default=5,
                   help="every N-th churn model is deleted once the service described it (its first host copy "
                        "placed, its agent holding its state), the others at once (their registration's work "
                        "cancelled under way) (default 5; 1: all)")
    p.add_argument("--serve-every", type=int, default=10,
                   help="every N-th churn model serves one request before its deletion (default 10; 0: none)")
    p.add_argument("--ready-timeout", type=float, default=90.0,
                   help="a registered model not described within this is deleted anyway, counted not ready (s)")
    p.add_argument("--clean-timeout", type=float, default=60.0,
                   help="a deleted model with state left after this counts as left behind (s)")
    p.add_argument("--hangup-every", type=float, default=5.0, help="a client hangs up mid-stream this often, s")
    p.add_argument("--kill-every", type=float, default=300.0, help="a node agent is killed this often, s (0: never)")
    p.add_argument("--spare", default="cpu-0", help="the node whose agent is never killed (default cpu-0)")
    p.add_argument("--sample-every", type=float, default=10.0, help="RSS and open files are sampled this often, s")
    p.add_argument("--json", help="write the figures (and the cycles and samples) as JSON here")
    p.add_argument("--markdown", help="write the report as markdown here (the figures docs/service.md quotes)")
    p.add_argument("--plot", help="write a PNG of RSS and open files over time here")
    p.set_defaults(func=run)


@dataclass
class Cycle:
    """One churn model's register/delete cycle: its phases' seconds and what it found."""
    tenant: str
    name: str
    kind: str = "at once"  # deleted "at once", "described" (once described) or "served" (after one request)
    uid: str | None = None  # as the service described it (None: never described)
    register_s: float = 0.0
    ready_s: float | None = None  # None: not waited for, or not described within --ready-timeout
    serve_s: float | None = None  # None: not served (only every --serve-every-th is)
    served: str | None = None  # the outcome of its request
    delete_s: float = 0.0
    clean_s: float | None = None  # None: something of it was left after --clean-timeout
    left: dict[str, Any] = field(default_factory=dict)  # what was left then


@dataclass
class Tally:
    outcomes: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cycles: list[Cycle] = field(default_factory=list)  # churn models registered and deleted
    churn_refused: dict[str, int] = field(default_factory=dict)  # status -> count (a 429 past the rate, ...)
    kills: list[str] = field(default_factory=list)
    kill_times: list[float] = field(default_factory=list)  # when each kill was sent (loop time)
    # the demo tenant's streams that ended ok: (start, end, TTFT, TPOT, longest gap between two
    # tokens) in loop time and seconds
    timings: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    started: int = 0  # cycles begun
    # the service's lost/resumed/lost_failed by cause (numbers the models, picks those that serve)
    resumed: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome == "lost":
            self.lost.append(detail)
        elif outcome == "failed" and len(self.failed) < 20:
            self.failed.append(detail)


async def stream_once(session: Any, url: str, key: str, model: str, max_tokens: int, i: int,
                      hang_up: bool = False, timeout_s: float = 300.0,
                      timing: list[float] | None = None) -> tuple[str, str]:
    """One streaming chat completion: (outcome, detail) as the module docstring defines them.
    `timing` gets the loop times of its start and of each chunk of text."""
    import aiohttp

    loop = asyncio.get_running_loop()
    if timing is not None:
        timing.append(loop.time())
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "seed": i,
            "messages": [{"role": "user", "content": f"Say something about the number {i}."}]}
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if 400 <= resp.status < 500:
                return "turned_away", f"{resp.status}"
            if resp.status != 200:
                return "failed", f"HTTP {resp.status}: {(await resp.text())[:200]}"
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return "ok", ""
                chunk = json.loads(data)
                if "error" in chunk:
                    return "failed", f"stream error: {chunk['error'].get('message', '')[:200]}"
                if timing is not None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", ())):
                    timing.append(loop.time())
                if hang_up:
                    resp.close()  # the client goes away mid-stream
                    return "hung_up", ""
            return "lost", "the stream ended without [DONE] or an error event"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return "lost", f"{type(exc).__name__}: {exc}"


async def _call(session: Any, url: str, token: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with session.request(method, f"{url}{path}", json=body,
                               headers={"Authorization": f"Bearer {token}"}) as resp:
        try:
            return resp.status, await resp.json(content_type=None)
        except ValueError:
            return resp.status, await resp.text()


@dataclass(frozen=True)
class ProcessSample:
    """One process at one time of a soak (a row of its samples file)."""

    t: float  # seconds since the soak started
    pid: int
    role: str
    rss: int  # bytes
    fds: int  # open files


def sample_processes(root_pid: int, t: float) -> list[dict[str, Any]]:
    """RSS and open files of the server and every process under it; the server's row also
    holds the machine's load average (1 min)."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in procs:
        try:
            with proc.oneshot():
                if not proc.memory_info().rss:
                    continue  # exiting
                out.append(asdict(ProcessSample(round(t, 1), proc.pid, _role(proc.cmdline(), proc.pid == root_pid),
                                                proc.memory_info().rss, proc.num_fds())))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    if out and out[0]["pid"] == root_pid:
        out[0]["load1"] = round(os.getloadavg()[0], 2)
    return out


def _role(cmdline: list[str], root: bool) -> str:
    """What a process is: the service, an agent (by node), or a worker (by module)."""
    if root:
        return "service"
    text = " ".join(cmdline)
    if "mesh.node.tokenizer_worker" in text:
        return "tokenizer worker"
    if "mesh.agent" in text and "--node-id" in cmdline:
        return f"agent {cmdline[cmdline.index('--node-id') + 1]}"
    for arg in cmdline:
        if arg.startswith("mesh.") and arg != "-m":
            return arg.rsplit(".", 1)[-1].replace("_", " ")
    return os.path.basename(cmdline[0]) if cmdline else "?"


def processes(samples: list[dict[str, Any]], warmup_s: float) -> list[dict[str, Any]]:
    """Every process sampled, by pid: its role, when it was first and last seen, and its RSS
    (MiB) at its first sample, after its own warm-up (`warmup_s` after its start, or a third
    of its life if shorter; the run's first processes start at 0), at its last sample and at
    most, with the growth (%) from its warm-up to its last sample and its open files."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        by_pid.setdefault(s["pid"], []).append(s)
    end = max((s["t"] for s in samples), default=0.0)
    out = []
    for pid, rows in by_pid.items():
        first, last = rows[0], rows[-1]
        born = 0.0 if first["t"] == samples[0]["t"] else first["t"]
        at = born + min(warmup_s, (last["t"] - born) / 3)
        warm = next(r for r in rows if r["t"] >= at)
        out.append({"pid": pid, "role": first["role"], "from_s": first["t"], "to_s": last["t"],
                    "to_end": last["t"] >= end, "warm_s": warm["t"], "rss_first_mib": first["rss"] / 2**20,
                    "rss_warm_mib": warm["rss"] / 2**20, "rss_end_mib": last["rss"] / 2**20,
                    "rss_max_mib": max(r["rss"] for r in rows) / 2**20,
                    "growth_pct": 100.0 * (last["rss"] / warm["rss"] - 1),
                    # the least RSS in the minute from its warm-up and in its last minute: what it keeps,
                    # without the transient peaks (a weights copy read, a request's buffers)
                    "floor_warm_mib": min(r["rss"] for r in rows if warm["t"] <= r["t"] <= warm["t"] + 60) / 2**20,
                    "floor_end_mib": min(r["rss"] for r in rows if r["t"] >= last["t"] - 60) / 2**20,
                    "fds_warm": warm["fds"], "fds_end": last["fds"], "fds_max": max(r["fds"] for r in rows)})
    return sorted(out, key=lambda p: (p["role"], p["from_s"]))


def growth(samples: list[dict[str, Any]], role: str, warmup_s: float) -> dict[str, Any] | None:
    """RSS and open files of the process of `role` that lived from the run's start to its end
    (the service, the spare node's agent): its growth after `warmup_s`; None if none did."""
    lived = [p for p in processes(samples, warmup_s) if p["role"] == role and p["to_end"]
             and p["from_s"] == samples[0]["t"] and p["to_s"] > p["warm_s"]]
    return lived[0] if lived else None


class Watch:
    """The service's books as the operator reads them, polled every `every_s` for all the
    churn loops at once: /admin/cluster (described models, the cluster's, every agent's
    `models` from its stats and its stats calls on this connection, instances, queue) and
    /admin/models."""

    def __init__(self, session: Any, url: str, token: str, every_s: float = 0.25) -> None:
        self.session, self.url, self.token, self.every_s = session, url, token, every_s
        self.view: dict[str, Any] = {}
        self.registered: set[tuple[str, str]] = set()  # (tenant, name) the admin API lists
        self.seen: dict[tuple[str, str], str] = {}  # (tenant, name) -> uid, of every model seen described
        self._polled = asyncio.Event()

    async def run(self) -> None:
        while True:
            status, view = await _call(self.session, self.url, self.token, "GET", "/admin/cluster")
            status2, models = await _call(self.session, self.url, self.token, "GET", "/admin/models")
            if status == 200 and status2 == 200:
                for uid, m in view["described"].items():
                    self.seen.setdefault((m["tenant"], m["name"]), uid)
                self.view = view
                self.registered = {(m["owned_by"], m["id"]) for m in models["data"]}
                self._polled.set()
                self._polled = asyncio.Event()
            await asyncio.sleep(self.every_s)

    async def until(self, found: Callable[[], Any], timeout_s: float) -> Any:
        """`found()` once it is true on a poll taken after this call, or None after `timeout_s`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                await asyncio.wait_for(self._polled.wait(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                return None
            result = found()
            if result:
                return result

    def described(self, tenant: str, name: str) -> str | None:
        """The model's uid once the service described it (its first host copy on a node, its
        agent holds its state)."""
        return next((uid for uid, m in self.view.get("described", {}).items()
                     if m["tenant"] == tenant and m["name"] == name), None)

    def stats_calls(self) -> dict[str, tuple[Any, int]]:
        """Each node's agent (pid) and the stats calls answered on its connection."""
        return {n["node_id"]: (n.get("pid"), n.get("calls", {}).get("stats", {}).get("count", 0))
                for n in self.view.get("nodes", [])}

    def traces(self, tenant: str, name: str, uid: str | None, since: dict[str, tuple[Any, int]] | None
               ) -> dict[str, Any]:
        """What is left of a deleted model: in the admin API, the cluster's books, its
        instances, and each agent's state as its stats read it at least two stats calls
        after `since` (a restarted agent holds nothing; until then an agent is `unread`)."""
        view = self.view
        uid = uid or self.described(tenant, name) or self.seen.get((tenant, name))  # (described after its wait)
        left: dict[str, Any] = {}
        if (tenant, name) in self.registered:
            left["registered"] = True
        if uid is not None and uid in view.get("described", {}):
            left["described"] = True
        if uid is not None and uid in view.get("cluster_models", []):
            left["cluster"] = True
        insts = [i["instance_id"] for n in view.get("nodes", []) for i in n["instances"]
                 if i["model"] == uid or (i["tenant"] == tenant and i["model"] == name)]
        if insts:
            left["instances"] = insts
        for n in view.get("nodes", []):
            pid, calls = n.get("pid"), n.get("calls", {}).get("stats", {}).get("count", 0)
            before = (since or {}).get(n["node_id"])
            if before is None or pid != before[0] or n.get("state") != "up":
                continue  # a restarted (or dead) agent holds nothing of it
            if calls < before[1] + 2:
                left.setdefault("unread", []).append(n["node_id"])  # its stats were not read since
            elif uid is not None and uid in n.get("models", []):
                left.setdefault("agents", []).append(n["node_id"])
        return left


async def soak(url: str, key: str, token: str, server_pid: int, args: argparse.Namespace,
               tally: Tally, samples: list[dict[str, Any]]) -> dict[str, Any]:
    import aiohttp

    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + args.minutes * 60.0
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    try:
        churn_keys = {}
        for i in range(args.churn_tenants):
            tenant = f"{CHURN}-{i}"
            status, _ = await _call(session, url, token, "POST", "/admin/tenants", {"name": tenant})
            assert status == 201, status
            status, body = await _call(session, url, token, "POST", f"/admin/tenants/{tenant}/keys")
            churn_keys[tenant] = body["key"]
        watch = Watch(session, url, token)
        counter = iter(range(10**9))

        async def client() -> None:
            while loop.time() < end:
                times: list[float] = []
                outcome, detail = await stream_once(session, url, key, "demo/smollm2", args.max_tokens, next(counter),
                                                    timing=times)
                tally.add(outcome, detail)
                if outcome == "ok" and len(times) >= 3:
                    tally.timings.append((times[0], times[-1], times[1] - times[0],
                                          (times[-1] - times[1]) / (len(times) - 2),
                                          max(b - a for a, b in zip(times[1:], times[2:]))))
                if outcome != "ok":
                    await asyncio.sleep(0.5)

        async def hang_ups() -> None:
            while loop.time() + args.hangup_every < end:
                await asyncio.sleep(args.hangup_every)
                outcome, detail = await stream_once(session, url, key, "demo/smollm2", 64, next(counter), hang_up=True)
                tally.add(outcome, detail)

        async def churn(tenant: str, churn_key: str) -> None:
            auth = {"Authorization": f"Bearer {churn_key}"}
            while loop.time() < end:
                n = tally.started
                tally.started += 1
                cycle = Cycle(tenant, f"c{n}")
                t0 = loop.time()
                async with session.post(f"{url}/v1/models", json={"name": cycle.name, "path": "m.gguf"},
                                        headers=auth) as resp:
                    status, retry = resp.status, resp.headers.get("Retry-After")
                    await resp.read()
                if status != 201:
                    tally.churn_refused[str(status)] = tally.churn_refused.get(str(status), 0) + 1
                    await asyncio.sleep(float(retry) if status == 429 and retry else 1.0)
                    continue
                t1 = loop.time()
                cycle.register_s = t1 - t0
                serve = bool(args.serve_every) and n % args.serve_every == 0
                uid = None
                if serve or (args.churn_ready_every and n % args.churn_ready_every == 0):
                    cycle.kind = "served" if serve else "described"
                    uid = await watch.until(lambda: watch.described(tenant, cycle.name), args.ready_timeout)
                    cycle.ready_s = loop.time() - t1 if uid else None
                t2 = loop.time()
                if serve:
                    cycle.served, detail = await stream_once(session, url, churn_key, cycle.name, 4, n)
                    tally.add(cycle.served, detail)
                    cycle.serve_s = loop.time() - t2
                t3 = loop.time()
                status, _ = await _call(session, url, churn_key, "DELETE", f"/v1/models/{cycle.name}")
                assert status == 200, (tenant, cycle.name, status)
                t4 = loop.time()
                cycle.delete_s = t4 - t3
                # the service forgot it (its books); then every agent's stats, read after that
                since = await watch.until(lambda: not watch.traces(tenant, cycle.name, uid, None) and
                                          watch.stats_calls(), args.clean_timeout)
                uid = uid or watch.described(tenant, cycle.name)  # (one deleted at once may have been described)
                if since and await watch.until(lambda: not watch.traces(tenant, cycle.name, uid, since),
                                               args.clean_timeout) is not None:
                    cycle.clean_s = loop.time() - t4
                else:
                    cycle.left = watch.traces(tenant, cycle.name, uid, since or watch.stats_calls())
                cycle.uid = uid or watch.seen.get((tenant, cycle.name))
                tally.cycles.append(cycle)

        async def kills() -> None:
            turn = 0
            while args.kill_every and loop.time() + args.kill_every < end:
                await asyncio.sleep(args.kill_every)
                _, view = await _call(session, url, token, "GET", "/admin/cluster")
                nodes = [n for n in view["nodes"] if n.get("pid") and n["node_id"] != args.spare]
                if not nodes:
                    continue
                node = nodes[turn % len(nodes)]
                turn += 1
                try:
                    os.kill(node["pid"], signal.SIGKILL)
                    tally.kill_times.append(loop.time())
                    tally.kills.append(f"{node['node_id']} pid {node['pid']} at {loop.time() - start:.0f} s")
                except ProcessLookupError:
                    pass

        async def sampler() -> None:
            while True:
                samples.extend(await asyncio.to_thread(sample_processes, server_pid, loop.time() - start))
                await asyncio.sleep(args.sample_every)

        background = [asyncio.ensure_future(sampler()), asyncio.ensure_future(watch.run())]
        await asyncio.gather(*(client() for _ in range(args.clients)), hang_ups(), kills(),
                             *(churn(t, k) for t, k in churn_keys.items()))
        samples.extend(await asyncio.to_thread(sample_processes, server_pid, loop.time() - start))
        for task in background:
            task.cancel()
        _, view = await _call(session, url, token, "GET", "/admin/cluster")
        tally.resumed = {k: view["dispatcher"].get(k, {}) for k in ("lost", "resumed", "lost_failed")}
        return await left_behind(session, url, token)
    finally:
        await session.close()


async def left_behind(session: Any, url: str, token: str, wait_s: float = 120.0) -> dict[str, Any]:
    """Once the load stopped: the churn tenants' models anywhere (admin API, cluster, agents),
    requests waiting or in flight. Waits up to `wait_s` for in-flight clean-up to end."""
    deadline = time.monotonic() + wait_s
    while True:
        _, models = await _call(session, url, token, "GET", "/admin/models")
        _, view = await _call(session, url, token, "GET", "/admin/cluster")
        kept = {uid for uid, m in view["described"].items() if not m["tenant"].startswith(CHURN)}
        left = {
            "registered": [m["id"] for m in models["data"] if m["owned_by"].startswith(CHURN)],
            "described": sorted(uid for uid, m in view["described"].items() if m["tenant"].startswith(CHURN)),
            "cluster": [uid for uid in view["cluster_models"] if uid not in kept],
            "agents": {n["node_id"]: [u for u in n.get("models", []) if u not in kept] for n in view["nodes"]},
            "instances": [i["instance_id"] for n in view["nodes"] for i in n["instances"]
                          if (i["tenant"] or CHURN).startswith(CHURN)],
            "waiting": view["dispatcher"]["waiting"], "in_flight": view["dispatcher"]["in_flight"],
        }
        clean = not any(v for k, v in left.items() if k != "agents") and not any(left["agents"].values())
        if clean or time.monotonic() > deadline:
            left["clean"] = clean
            return left
        await asyncio.sleep(2.0)


def plot(samples: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_fds) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    roles = sorted({s["role"] for s in samples})
    for role in roles:
        for pid in sorted({s["pid"] for s in samples if s["role"] == role}):
            rows = [s for s in samples if s["pid"] == pid]
            label = role if pid == min(s["pid"] for s in samples if s["role"] == role) else None
            color = f"C{roles.index(role) % 10}"
            ax_rss.plot([r["t"] / 60 for r in rows], [r["rss"] / 2**20 for r in rows], color=color, label=label)
            ax_fds.plot([r["t"] / 60 for r in rows], [r["fds"] for r in rows], color=color)
    ax_rss.set_ylabel("RSS, MiB")
    ax_fds.set_ylabel("open files")
    ax_fds.set_xlabel("minutes")
    ax_rss.legend(fontsize=7, ncol=2)
    ax_rss.set_title(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def _seconds(values: list[float]) -> dict[str, float]:
    """Mean, median and 95th percentile of a phase's seconds (0s for none)."""
    if not values:
        return {"n": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0}
    ordered = sorted(values)
    return {"n": len(values), "mean": round(statistics.fmean(values), 3),
            "p50": round(ordered[len(ordered) // 2], 3), "p95": round(ordered[min(len(ordered) - 1,
                                                                                 int(0.95 * len(ordered)))], 3)}


def _timing(streams: list[tuple[float, float, float, float, float]]) -> dict[str, Any]:
    """Count, TTFT, TPOT and the longest gap between two tokens (mean, p50, p95) of streams
    given as (start, end, TTFT, TPOT, longest gap). A stream resumed after a kill after its
    first token has the resume's stall in that gap, and its TPOT (the mean gap) with it."""
    return {"n": len(streams), "ttft_s": _seconds([t[2] for t in streams]), "tpot_s": _seconds([t[3] for t in streams]),
            "longest_gap_s": _seconds([t[4] for t in streams])}


def _cycle_s(c: Cycle) -> float:
    return c.register_s + (c.ready_s or 0) + (c.serve_s or 0) + c.delete_s + (c.clean_s or 0)


def summarize(args: argparse.Namespace, tally: Tally, samples: list[dict[str, Any]], left: dict[str, Any],
              wall_s: float, loads: list[float]) -> dict[str, Any]:
    """Every figure of the run (docs/service.md quotes them)."""
    warmup_s = min(args.warmup_minutes, args.minutes / 3) * 60.0
    cycles = tally.cycles
    sent = sum(tally.outcomes.values())
    f: dict[str, Any] = {
        "minutes": args.minutes, "wall_s": round(wall_s, 1), "requests": sent,
        **{f"outcome_{k}": v for k, v in sorted(tally.outcomes.items())}, "lost": tally.outcomes.get("lost", 0),
        "churn_tenants": args.churn_tenants, "register_delete_cycles": len(cycles),
        "cycles_per_30_min": round(len(cycles) * 30.0 / args.minutes, 1),
        "cycles_by_kind": {k: sum(c.kind == k for c in cycles) for k in ("at once", "described", "served")},
        "cycles_not_ready": sum(c.kind != "at once" and c.ready_s is None for c in cycles),
        "cycles_left_behind": sum(c.clean_s is None and set(c.left) != {"unread"} for c in cycles),
        # only an agent's stats not read twice in --clean-timeout (it had just been killed): not verified
        "cycles_unverified": sum(c.clean_s is None and set(c.left) == {"unread"} for c in cycles),
        "churn_models_served": sum(c.served == "ok" for c in cycles),
        "churn_serve_outcomes": {o: sum(c.served == o for c in cycles) for o in sorted({c.served for c in cycles
                                                                                        if c.served})},
        "churn_refused": dict(tally.churn_refused),
        "cycle_s": _seconds([_cycle_s(c) for c in cycles]),
        "cycle_s_by_kind": {k: _seconds([_cycle_s(c) for c in cycles if c.kind == k])
                            for k in ("at once", "described", "served")},
        "phase_register_s": _seconds([c.register_s for c in cycles]),
        "phase_ready_s": _seconds([c.ready_s for c in cycles if c.ready_s is not None]),
        "phase_serve_s": _seconds([c.serve_s for c in cycles if c.serve_s is not None]),
        "phase_delete_s": _seconds([c.delete_s for c in cycles]),
        "phase_clean_s": _seconds([c.clean_s for c in cycles if c.clean_s is not None]),
        "agent_kills": len(tally.kills), "spare_agent": args.spare,
        # requests of the killed agents, as the service counts them (by cause), and the demo
        # tenant's streams in flight across a kill (they include the resumed ones) beside all
        "service_lost": tally.resumed.get("lost", {}), "service_resumed": tally.resumed.get("resumed", {}),
        "service_lost_failed": tally.resumed.get("lost_failed", {}),
        "streams_ok": _timing([t for t in tally.timings]),
        "streams_ok_across_a_kill": _timing([t for t in tally.timings
                                             if any(t[0] < k < t[1] for k in tally.kill_times)]),
                                             "left_behind_clean": left["clean"],
        "load_average_1min": {"min": min(loads, default=0.0), "mean": round(statistics.fmean(loads), 2) if loads
                              else 0.0, "max": max(loads, default=0.0)},
        "warmup_min": warmup_s / 60,
    }
    for role in ("service", f"agent {args.spare}"):
        g = growth(samples, role, warmup_s)
        if g is None:
            f[f"{role} rss growth %"] = "none measured (no process lived from the warm-up to the end)"
            continue
        f[f"{role} rss MiB"] = (f"{g['rss_warm_mib']:.0f} at {g['warm_s'] / 60:.1f} min -> {g['rss_end_mib']:.0f} "
                                f"at the end (at most {g['rss_max_mib']:.0f})")
        f[f"{role} rss growth %"] = round(g["growth_pct"], 2)
        f[f"{role} rss floor MiB"] = f"{g['floor_warm_mib']:.0f} -> {g['floor_end_mib']:.0f}"
        f[f"{role} rss floor growth %"] = round(100.0 * (g["floor_end_mib"] / g["floor_warm_mib"] - 1), 2)
        f[f"{role} open files"] = f"{g['fds_warm']} -> {g['fds_end']} (at most {g['fds_max']})"
    last_t = max((s["t"] for s in samples), default=0.0)
    f["processes at end"] = sum(1 for s in samples if s["t"] == last_t)
    return f


def markdown(args: argparse.Namespace, f: dict[str, Any], procs: list[dict[str, Any]], tally: Tally,
             left: dict[str, Any]) -> str:
    """The report docs/service.md quotes: the figures, then every process's RSS."""
    out = [f"`mesh bench soak --minutes {args.minutes:g}`: {args.clients} streaming clients of the demo tenant "
           f"({args.max_tokens} tokens each), {args.churn_tenants} churn tenants (one loop each, default registration "
           f"rate), every {args.churn_ready_every}th churn model deleted once described, every {args.serve_every}th "
           f"served once, the others deleted at once, a hang-up every {args.hangup_every:g} s, an "
           f"agent other than {args.spare} killed every {args.kill_every:g} s; load average (1 min) "
           f"{f['load_average_1min']['min']:.1f}-{f['load_average_1min']['max']:.1f}, mean "
           f"{f['load_average_1min']['mean']:.1f}, on {os.cpu_count()} cores.", "",
           "| figure | value |", "|---|---|"]
    outcomes = ", ".join(f"{f.get('outcome_' + k, 0):,} {k}" for k in ("ok", "hung_up", "turned_away", "failed"))
    out.append(f"| requests | {f['requests']:,}: {outcomes}, **{f['lost']} lost** |")
    resumed, lost = sum(f["service_resumed"].values()), sum(f["service_lost"].values())
    across, every = f["streams_ok_across_a_kill"], f["streams_ok"]
    out.append(f"| killed agents' requests | {lost} handed back, **{resumed} resumed**, "
               f"{sum(f['service_lost_failed'].values())} failed (the service's counts) |")
    out.append(f"| streams across a kill (ok) | {across['n']}: TTFT mean {across['ttft_s']['mean']:.2f} s "
               f"(p95 {across['ttft_s']['p95']:.2f}), TPOT mean {across['tpot_s']['mean']:.3f} s (p95 "
               f"{across['tpot_s']['p95']:.3f}), longest gap between tokens mean "
               f"{across['longest_gap_s']['mean']:.2f} s (p95 {across['longest_gap_s']['p95']:.2f}); all ok streams: "
               f"{every['n']}, TTFT mean {every['ttft_s']['mean']:.2f} s, TPOT mean {every['tpot_s']['mean']:.3f} s, "
               f"longest gap mean {every['longest_gap_s']['mean']:.2f} s |")
    cs, ph = f["cycle_s"], {k: f[f"phase_{k}_s"] for k in ("register", "ready", "serve", "delete", "clean")}
    kinds = ", ".join(f"{n} {k}" for k, n in f["cycles_by_kind"].items())
    out.append(f"| register/delete cycles | {f['register_delete_cycles']:,} in {args.minutes:g} min "
               f"({f['cycles_per_30_min']:,} per 30 min); deleted: {kinds}; "
               f"{f['churn_models_served']} served their request; "
               f"{f['cycles_not_ready']} not ready within {args.ready_timeout:g} s; refused: "
               f"{f['churn_refused'] or 'none'}; **{f['cycles_left_behind']} left state behind**; "
               f"{f['cycles_unverified']} not verified on an agent (its stats not read twice in "
               f"{args.clean_timeout:g} s: it had been killed) |")
    out.append(f"| a cycle's seconds (mean / p95) | {cs['mean']:.2f} / {cs['p95']:.2f}: " + ", ".join(
        f"{k} {v['mean']:.2f} / {v['p95']:.2f}" for k, v in ph.items()) + "; by kind: " + ", ".join(
        f"{k} {v['mean']:.2f} / {v['p95']:.2f}" for k, v in f["cycle_s_by_kind"].items()) + " |")
    where = "nothing" if left["clean"] else json.dumps({k: v for k, v in left.items() if k != "clean"})
    out.append(f"| left behind after the run | {where} |")
    for role in ("service", f"agent {args.spare}"):
        if f"{role} rss MiB" in f:
            out.append(f"| {role} RSS (never restarted) | {f[role + ' rss MiB']}: "
                       f"**{f[role + ' rss growth %']:+.1f}%** after the first {f['warmup_min']:.1f} min; its floor "
                       f"(least RSS in the minute after the warm-up -> in the last minute) "
                       f"{f[role + ' rss floor MiB']} MiB, {f[role + ' rss floor growth %']:+.1f}%; open files "
                       f"{f[role + ' open files']} |")
    out.append(f"| agents killed | {'; '.join(tally.kills) or 'none'} |")
    out += ["", "Every process (RSS in MiB; `warm`: after its own warm-up, the run's first "
                f"{f['warmup_min']:.1f} min or a third of a shorter life):", "",
            "| process | pid | lived (min) | RSS first | warm | end | max | growth after warm | open files "
            "(warm/end/max) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for p in procs:
        out.append(f"| {p['role']} | {p['pid']} | {p['from_s'] / 60:.1f}-{p['to_s'] / 60:.1f} | "
                   f"{p['rss_first_mib']:.0f} | {p['rss_warm_mib']:.0f} | {p['rss_end_mib']:.0f} | "
                   f"{p['rss_max_mib']:.0f} | {p['growth_pct']:+.1f}% | "
                   f"{p['fds_warm']}/{p['fds_end']}/{p['fds_max']} |")
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> int:
    from mesh.modelfiles.demo import demo_gguf_path

    warmup_s = min(args.warmup_minutes, args.minutes / 3) * 60.0
    with tempfile.TemporaryDirectory(prefix="mesh-bench-soak-") as tmp:
        allowed = Path(tmp) / "allowed"
        for i in range(args.churn_tenants):
            (allowed / f"{CHURN}-{i}").mkdir(parents=True)
            try:
                os.link(demo_gguf_path(), allowed / f"{CHURN}-{i}" / "m.gguf")
            except OSError:
                import shutil

                shutil.copy(demo_gguf_path(), allowed / f"{CHURN}-{i}" / "m.gguf")
        service = start_service(Path(tmp) / "data", server_args(allowed, cpu_nodes=2))
        tally, samples = Tally(), []
        t0 = time.monotonic()
        try:
            left = asyncio.run(soak(service.url, service.key, service.admin_token, service.pid, args, tally, samples))
        finally:
            stop_service(service)
        wall = time.monotonic() - t0
    loads = [s["load1"] for s in samples if "load1" in s]
    figures = summarize(args, tally, samples, left, wall, loads)
    procs = processes(samples, warmup_s)
    emit(f"mesh bench soak: {args.minutes:g} min, {args.clients} streaming clients, {args.churn_tenants} churn "
         f"tenants, a hang-up every {args.hangup_every:g} s, an agent other than {args.spare} killed every "
         f"{args.kill_every:g} s (growth after {warmup_s / 60:.1f} min)", figures, None, {"wall_s": "s"})
    print(f"  left behind: {json.dumps({k: v for k, v in left.items() if k != 'clean'})}")
    for c in tally.cycles:
        if c.clean_s is None:
            print(f"  {'LEFT BEHIND' if set(c.left) != {'unread'} else 'not verified'} by cycle {c.tenant}/{c.name} "
                  f"({c.kind}, {c.uid}): {c.left}")
    if tally.kills:
        print(f"  agents killed: {'; '.join(tally.kills)}")
    if tally.failed:
        print(f"  failed (first): {tally.failed[0]}")
    if tally.lost:
        print(f"  LOST: {tally.lost[:5]}")
    report = markdown(args, figures, procs, tally, left)
    print(report)
    if args.json:
        write_json(args.json, {"figures": figures, "left_behind": left, "kills": tally.kills,
                               "failed": tally.failed, "lost": tally.lost, "processes": procs,
                               "cycles": [c.__dict__ for c in tally.cycles], "samples": samples})
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(report)
        print(f"wrote {args.markdown}")
    if args.plot:
        plot(samples, args.plot, f"mesh bench soak, {args.minutes:g} min")
    ok = not tally.lost and left["clean"] and not figures["cycles_left_behind"]
    return 0 if ok else 1
