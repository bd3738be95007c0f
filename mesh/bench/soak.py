"""`mesh bench soak`: a real service run for a set time under churn, watched for growth and loss.

It starts `mesh serve --demo --cpu-nodes 2` (real node agents, the OpenVINO engine, the demo
model), then for `--minutes` (default 30):

- well-behaved tenants stream: `--clients` clients of the demo tenant send streaming chat
  completions back to back (`--max-tokens` each);
- a churn tenant registers a model (the demo GGUF by path, in its folder) and deletes it in
  a loop; every `--serve-every`-th model gets one request before its deletion (an instance
  starts, serves and is stopped with it);
- a client hangs up mid-stream every `--hangup-every` seconds (after its first chunk);
- a node agent is killed (SIGKILL) every `--kill-every` seconds, nodes in turn; its
  supervisor restarts it.

Every `--sample-every` seconds it records the resident memory (RSS) and open files of every
process of the service (the server, its agents, their engine and tokenizer workers) with
psutil. At the end the load stops, and it checks that nothing is left behind: no model of
the churn tenant in the admin API, the cluster's books or any agent's state (its stats'
`models`), no request waiting or in flight.

Outcomes: `ok` (streamed to [DONE]), `turned_away` (a 4xx or 429 answer), `failed` (a 5xx, or
an error event in the stream: a killed agent's requests end so), `hung_up` (ours), and `lost`
(no answer: a stream cut without [DONE] or an error event, a connection error or a timeout).
The target is no request lost. RSS growth is measured from the end of each process's
warm-up (`--warmup-minutes` after its start, default 5, at most a third of the run: a
restarted agent warms up again) to the end, for the service and each node's agent. A table, JSON (`--json`) and a
plot of RSS and open files over time (`--plot`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mesh.bench.report import emit, write_json
from mesh.bench.serve_load import start_server, stop_server

CHURN = "churn"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="soak test: a real service under churn for a set time; RSS, open files, "
                                    "outcomes, anything lost or left behind")
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default 30)")
    p.add_argument("--warmup-minutes", type=float, default=5.0,
                   help="RSS growth is measured after this (default 5; at most a third of --minutes)")
    p.add_argument("--clients", type=int, default=2, help="streaming clients of the demo tenant (default 2)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--serve-every", type=int, default=10,
                   help="every N-th churn model serves one request before its deletion (default 10; 0: none)")
    p.add_argument("--hangup-every", type=float, default=5.0, help="a client hangs up mid-stream this often, s")
    p.add_argument("--kill-every", type=float, default=300.0, help="a node agent is killed this often, s (0: never)")
    p.add_argument("--sample-every", type=float, default=10.0, help="RSS and open files are sampled this often, s")
    p.add_argument("--json", help="write the figures (and the samples) as JSON here")
    p.add_argument("--plot", help="write a PNG of RSS and open files over time here")
    p.set_defaults(func=run)


@dataclass
class Tally:
    outcomes: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cycles: int = 0  # churn models registered and deleted
    churn_served: int = 0
    churn_refused: dict[str, int] = field(default_factory=dict)  # status -> count (a 429 past the rate, ...)
    kills: list[str] = field(default_factory=list)

    def add(self, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome == "lost":
            self.lost.append(detail)
        elif outcome == "failed" and len(self.failed) < 20:
            self.failed.append(detail)


async def stream_once(session: Any, url: str, key: str, model: str, max_tokens: int, i: int,
                      hang_up: bool = False, timeout_s: float = 300.0) -> tuple[str, str]:
    """One streaming chat completion: (outcome, detail) as the module docstring defines them."""
    import aiohttp

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
    """RSS and open files of the server and every process under it."""
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
                out.append(asdict(ProcessSample(round(t, 1), proc.pid, _role(proc.cmdline(), proc.pid == root_pid),
                                                proc.memory_info().rss, proc.num_fds())))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
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


def growth(samples: list[dict[str, Any]], role: str, warmup_s: float) -> dict[str, Any] | None:
    """RSS and open files of the processes of `role`, each from `warmup_s` after its own
    start (a restarted agent warms up again) to the end: the largest growth, in percent, of
    those that lived until the end past their warm-up; None if none did."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        if s["role"] == role:
            by_pid.setdefault(s["pid"], []).append(s)
    end = max((s["t"] for s in samples), default=0.0)
    step = min((b["t"] - a["t"] for rows in by_pid.values() for a, b in zip(rows, rows[1:])), default=0.0)
    best = None
    for pid, rows in by_pid.items():
        warm = rows[0]["t"] + warmup_s if rows[0]["t"] > step else warmup_s  # (the first sample is at 0)
        rows = [r for r in rows if r["t"] >= warm]
        if len(rows) < 2 or rows[-1]["t"] < end - 2 * step:
            continue  # killed before the end, or too young to measure
        g = {"pid": pid, "from_s": rows[0]["t"], "rss_start_mib": rows[0]["rss"] / 2**20,
             "rss_end_mib": rows[-1]["rss"] / 2**20, "rss_max_mib": max(r["rss"] for r in rows) / 2**20,
             "growth_pct": 100.0 * (rows[-1]["rss"] / rows[0]["rss"] - 1),
             "fds_start": rows[0]["fds"], "fds_end": rows[-1]["fds"]}
        if best is None or g["growth_pct"] > best["growth_pct"]:
            best = g
    return best


async def soak(url: str, key: str, token: str, server_pid: int, args: argparse.Namespace,
               tally: Tally, samples: list[dict[str, Any]]) -> dict[str, Any]:
    import aiohttp

    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + args.minutes * 60.0
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    try:
        status, _ = await _call(session, url, token, "POST", "/admin/tenants", {"name": CHURN})
        assert status == 201, status
        status, body = await _call(session, url, token, "POST", f"/admin/tenants/{CHURN}/keys")
        churn_key = body["key"]
        # the churn tenant registers faster than a tenant may by default: the operator lifts its rate
        await _call(session, url, token, "PUT", f"/admin/tenants/{CHURN}/quota", {"registrations_per_min": None})
        counter = iter(range(10**9))

        async def client() -> None:
            while loop.time() < end:
                outcome, detail = await stream_once(session, url, key, "demo/smollm2", args.max_tokens, next(counter))
                tally.add(outcome, detail)
                if outcome != "ok":
                    await asyncio.sleep(0.5)

        async def hang_ups() -> None:
            while loop.time() + args.hangup_every < end:
                await asyncio.sleep(args.hangup_every)
                outcome, detail = await stream_once(session, url, key, "demo/smollm2", 64, next(counter), hang_up=True)
                tally.add(outcome, detail)

        async def churn() -> None:
            while loop.time() < end:
                name = f"c{tally.cycles}"
                status, body = await _call(session, url, churn_key, "POST", "/v1/models",
                                           {"name": name, "path": "m.gguf"})
                if status != 201:
                    tally.churn_refused[str(status)] = tally.churn_refused.get(str(status), 0) + 1
                    await asyncio.sleep(1.0)
                    continue
                if args.serve_every and tally.cycles % args.serve_every == 0:
                    outcome, detail = await stream_once(session, url, churn_key, name, 4, tally.cycles)
                    tally.add(outcome, detail)
                    tally.churn_served += outcome == "ok"
                status, _ = await _call(session, url, churn_key, "DELETE", f"/v1/models/{name}")
                assert status == 200, (name, status)
                tally.cycles += 1

        async def kills() -> None:
            turn = 0
            while args.kill_every and loop.time() + args.kill_every < end:
                await asyncio.sleep(args.kill_every)
                _, view = await _call(session, url, token, "GET", "/admin/cluster")
                nodes = [n for n in view["nodes"] if n.get("pid")]
                if not nodes:
                    continue
                node = nodes[turn % len(nodes)]
                turn += 1
                try:
                    os.kill(node["pid"], signal.SIGKILL)
                    tally.kills.append(f"{node['node_id']} pid {node['pid']} at {loop.time() - start:.0f} s")
                except ProcessLookupError:
                    pass

        async def sampler() -> None:
            while True:
                samples.extend(await asyncio.to_thread(sample_processes, server_pid, loop.time() - start))
                await asyncio.sleep(args.sample_every)

        watch = asyncio.ensure_future(sampler())
        await asyncio.gather(*(client() for _ in range(args.clients)), hang_ups(), churn(), kills())
        samples.extend(await asyncio.to_thread(sample_processes, server_pid, loop.time() - start))
        left = await left_behind(session, url, token)
        watch.cancel()
        return left
    finally:
        await session.close()


async def left_behind(session: Any, url: str, token: str, wait_s: float = 120.0) -> dict[str, Any]:
    """Once the load stopped: the churn tenant's models anywhere (admin API, cluster, agents),
    requests waiting or in flight. Waits up to `wait_s` for in-flight clean-up to end."""
    deadline = time.monotonic() + wait_s
    while True:
        _, models = await _call(session, url, token, "GET", "/admin/models")
        _, view = await _call(session, url, token, "GET", "/admin/cluster")
        kept = {uid for uid, m in view["described"].items() if m["tenant"] != CHURN}
        left = {
            "registered": [m["id"] for m in models["data"] if m["owned_by"] == CHURN],
            "described": sorted(uid for uid, m in view["described"].items() if m["tenant"] == CHURN),
            "cluster": [uid for uid in view["cluster_models"] if uid not in kept],
            "agents": {n["node_id"]: [u for u in n.get("models", []) if u not in kept] for n in view["nodes"]},
            "instances": [i["instance_id"] for n in view["nodes"] for i in n["instances"] if i["tenant"] == CHURN],
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


def run(args: argparse.Namespace) -> int:
    from mesh.modelfiles.demo import demo_gguf_path

    warmup_s = min(args.warmup_minutes, args.minutes / 3) * 60.0
    with tempfile.TemporaryDirectory(prefix="mesh-bench-soak-") as tmp:
        allowed = Path(tmp) / "allowed"
        (allowed / CHURN).mkdir(parents=True)
        try:
            os.link(demo_gguf_path(), allowed / CHURN / "m.gguf")
        except OSError:
            import shutil

            shutil.copy(demo_gguf_path(), allowed / CHURN / "m.gguf")
        proc, url, key, token = start_server(Path(tmp) / "data", allowed, cpu_nodes=2)
        tally, samples = Tally(), []
        t0 = time.monotonic()
        try:
            left = asyncio.run(soak(url, key, token, proc.pid, args, tally, samples))
        finally:
            stop_server(proc)
        wall = time.monotonic() - t0
    sent = sum(tally.outcomes.values())
    figures: dict[str, Any] = {
        "minutes": args.minutes, "wall_s": wall, "requests": sent, **{f"outcome_{k}": v for k, v in
                                                                       sorted(tally.outcomes.items())},
        "lost": tally.outcomes.get("lost", 0), "register_delete_cycles": tally.cycles,
        "churn_models_served": tally.churn_served, "churn_refused": dict(tally.churn_refused),
        "agent_kills": len(tally.kills), "left_behind_clean": left["clean"],
    }
    for role in ("service", "agent cpu-0", "agent cpu-1"):
        g = growth(samples, role, warmup_s)
        if g is not None:
            figures[f"{role} rss MiB (after warm-up -> end)"] = (f"{g['rss_start_mib']:.0f} -> {g['rss_end_mib']:.0f} "
                                                                 f"(from {g['from_s'] / 60:.1f} min)")
            figures[f"{role} rss growth %"] = round(g["growth_pct"], 2)
            figures[f"{role} open files"] = f"{g['fds_start']} -> {g['fds_end']}"
        else:
            figures[f"{role} rss growth %"] = "none measured (no process lived past its warm-up to the end)"
    last_t = max((s["t"] for s in samples), default=0.0)
    figures["processes at end"] = sum(1 for s in samples if s["t"] == last_t)
    emit(f"mesh bench soak: {args.minutes:g} min, {args.clients} streaming clients, churn every cycle, a hang-up every "
         f"{args.hangup_every:g} s, an agent killed every {args.kill_every:g} s (growth after {warmup_s / 60:.1f} min)",
         figures, None, {"wall_s": "s"})
    print(f"  left behind: {json.dumps({k: v for k, v in left.items() if k != 'clean'})}")
    if tally.kills:
        print(f"  agents killed: {'; '.join(tally.kills)}")
    if tally.failed:
        print(f"  failed (first): {tally.failed[0]}")
    if tally.lost:
        print(f"  LOST: {tally.lost[:5]}")
    if args.json:
        write_json(args.json, {"figures": figures, "left_behind": left, "kills": tally.kills,
                               "failed": tally.failed, "lost": tally.lost, "samples": samples})
    if args.plot:
        plot(samples, args.plot, f"mesh bench soak, {args.minutes:g} min")
    return 0 if not tally.lost and left["clean"] else 1
