"""`mesh bench live-scaling`: a scale-out under load on two real CPU node agents, live
scaling on and off (BlitzScale 5.2).

Two `python -m mesh.agent` processes with layer hosts (`--layers-listen`): the source holds
the model (a layer-ordered file of the demo model's Hugging Face folder, blocks cut at layer
boundaries), the target gets it by multicast over the source's paced uplink (`--link-mbps`,
set so the model takes `--arrive-s` seconds). A closed loop of `--streams` greedy streams
runs on the source; at `--warm-s` the multicast begins and new streams go to the pair
(mesh.control.live_pair): with live scaling the target runs the layers it holds and the
source pulls the activations (ZigZag); without, the target waits for its last block
(stop-the-world). Reported per run: tokens/s while the weights arrive, by the fraction of
layers the target held, and after; first-token times of the streams begun while loading;
pulls and activation bytes; whether every stream's tokens equal the source's whole-model
greedy output for the same prompt (`--check`).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.control.agent_client import AgentClient
from mesh.control.live_pair import LivePair, Stream
from mesh.engines.engine_api import NextTokens, TokenBatch
from mesh.modelfiles.layer_order import LayerLayout, write_layer_ordered
from mesh.node.layer_host import LAYERS_PREFIX
from mesh.policy.multicast import make_plan
from mesh.tasks import close_pipes
from mesh.weights.blocks import Manifest, pack
from mesh.weights.coordinator import multicast
from mesh.weights.launch import AgentProcess, spawn_agent
from mesh.wire.agent_protocol import READY_PREFIX
from mesh.wire.layers import Counters, LayerConnection, LayerCounters, Open, Peer, Release, Run, RunResult

AGENT_START_S = 120.0


@dataclass
class LayerAgent:
    """A real node agent with a weights port and a layer port."""

    node: str
    process: asyncio.subprocess.Process
    control: AgentClient  # its control connection (hello: where it receives weights)
    weights: tuple[str, int]
    layers: Peer
    weights_dir: Path

    async def stop(self) -> None:
        await self.control.close()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except asyncio.TimeoutError:
                self.process.kill()
                await self.process.wait()
        await close_pipes(self.process)


async def spawn_layer_agent(node: str, root: Path, models_root: Path, token: str, weights_token: str,
                            link_mbps: float | None = None, cpus: str | None = None) -> LayerAgent:
    """`python -m mesh.agent` with weights and layer ports on loopback; it exits with us."""
    from mesh.engines.worker_process import worker_env

    weights_dir = root / node
    cmd = [sys.executable, "-m", "mesh.agent", "--listen", "127.0.0.1:0", "--node-id", node, "--memory-bytes",
           str(4 << 30), "--exit-with-parent", "--weights-listen", "127.0.0.1:0", "--weights-dir", str(weights_dir),
           "--models-root", str(models_root), "--layers-listen", "127.0.0.1:0"]
    if link_mbps:
        cmd += ["--link-mbps", repr(link_mbps)]
    if cpus:
        cmd += ["--cpus", cpus]
    env = worker_env(MESH_AGENT_TOKEN=token, MESH_WEIGHTS_TOKEN=weights_token, OMP_NUM_THREADS="1")
    proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                env=env)
    layers = agent = None

    async def ready() -> None:
        nonlocal layers, agent
        assert proc.stdout is not None
        while agent is None:
            line = (await proc.stdout.readline()).decode(errors="replace").strip()
            if not line and proc.stdout.at_eof():
                raise RuntimeError(f"agent {node} exited before listening (status {await proc.wait()})")
            if line.startswith(LAYERS_PREFIX):
                layers = line[len(LAYERS_PREFIX):]
            elif line.startswith(READY_PREFIX):
                agent = line[len(READY_PREFIX):]

    try:
        await asyncio.wait_for(ready(), AGENT_START_S)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    assert layers is not None
    control = AgentClient(node, lambda _m: None, lambda _why: None)
    hello = await control.connect(agent, token)
    assert hello.weights is not None, "the agent was started with --weights-listen"
    host, _, port = str(hello.weights["address"]).rpartition(":")
    return LayerAgent(node, proc, control, (host, int(port)), Peer(layers, token), weights_dir)


@dataclass(frozen=True)
class Prepared:
    """The model as the multicast sends it: a layer-ordered file cut at layer boundaries."""

    path: Path
    manifest: Manifest
    layout: LayerLayout

    @property
    def layers(self) -> int:
        return self.layout.spans.num_layers


def prepare(hf_folder: Path, out_dir: Path, blocks: int = 8) -> Prepared:
    """Write the layer-ordered file and cut it into about `blocks` blocks on layer boundaries."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.layers.safetensors"
    layout = write_layer_ordered(hf_folder, path)
    block_bytes = max(1, path.stat().st_size // blocks)
    manifest = pack(path, block_bytes, model=hf_folder.name, boundaries=layout.boundaries())
    return Prepared(path, manifest, layout)


@dataclass
class RunConfig:
    streams: int = 4
    prompt_tokens: int = 48
    max_tokens: int = 24
    warm_s: float = 3.0  # before the scale-out
    arrive_s: float = 10.0  # the multicast's duration over the paced link
    after_s: float = 4.0  # after the target holds the model
    seed: int = 0
    check: bool = True  # streams' tokens against the source's whole-model greedy output
    check_max: int = 12  # of the streams begun while the weights arrived


@dataclass
class ScaleOutRun:
    live: bool
    seed: int
    scale_out_s: float  # when the multicast began (run time, s)
    full_s: float  # when the target held the whole model
    tokens: list[tuple[float, str]]  # (time, stream) of every token
    ready: list[tuple[float, int]]  # (time, layers the target held)
    ttft_loading: list[float]  # first-token times of the streams begun while the weights arrived
    pulls: int
    failed: int  # streams ended with an error
    target_runs: int
    recomputed: int
    activation_bytes: int  # sent by the target, taken by the source
    streams_split: int = 0  # streams some step of which ran on both agents
    layers: int = 0
    after_window: float = 0.0  # seconds of the run after the switch counted as "after"
    streams_checked: int = 0
    streams_equal: int = 0

    def rate(self, start: float, end: float) -> float:
        n = sum(1 for t, _ in self.tokens if start <= t < end)
        return n / (end - start) if end > start else 0.0

    def rate_by_fraction(self, layers: int, cuts: tuple[float, ...] = (0.0, 1 / 3, 2 / 3, 1.0)) -> list[float]:
        """Tokens/s while the target held each band [cuts[i], cuts[i+1]) of the model's layers,
        from the scale-out to the last block (nan: no time in that band)."""
        marks = [(self.scale_out_s, 0), *((t, n) for t, n in self.ready if self.scale_out_s <= t < self.full_s),
                 (self.full_s, layers)]
        out = []
        for lo, hi in zip(cuts, cuts[1:]):
            spans = [(a, b) for (a, n), (b, _) in zip(marks, marks[1:]) if lo <= n / layers < hi and b > a]
            dur = sum(b - a for a, b in spans)
            n = sum(1 for t, _ in self.tokens for a, b in spans if a <= t < b)
            out.append(n / dur if dur > 0 else float("nan"))
        return out


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(2, vocab) for _ in range(length + rng.randrange(-length // 4, length // 4 + 1)))
            for _ in range(count)]


async def reference(conn: LayerConnection, model: str, layers: int, prompt: tuple[int, ...], n: int,
                    rid: str) -> list[int]:
    """The source's whole-model greedy tokens for `prompt` (the check of a run's streams)."""
    out: list[int] = []
    position, ids = 0, prompt
    for _ in range(n):
        reply, payload = await conn.call(*Run(model, 0, layers, TokenBatch((rid,), (position,), (ids,))).to_header(0))
        result = RunResult.from_fields(reply, payload).output
        assert isinstance(result, NextTokens)
        out.append(result.token_ids[0])
        position, ids = position + len(ids), (out[-1],)
    await conn.call(Release(model, (rid,)).to_header(0))
    return out


async def run_once(prepared: Prepared, source: LayerAgent, target: LayerAgent, pool: AgentProcess, live: bool,
                   cfg: RunConfig) -> ScaleOutRun:
    """One scale-out under load (module docstring). The multicast's source is `pool`, the
    parameter pool's host copy (BlitzScale 5.3), a weights agent of its own on a paced link."""
    loop = asyncio.get_running_loop()
    model = f"m-{secrets.token_hex(3)}"
    layers = prepared.layers
    out_path = target.weights_dir / f"{model}.safetensors"
    src = await LayerConnection.open(source.layers)
    await src.call(Open(model, str(prepared.path)).to_header(0))
    tgt = await LayerConnection.open(target.layers)
    await tgt.call(Open(model, str(out_path)).to_header(0))
    pair = LivePair(model, layers, source.layers, target.layers, live=live)
    vocab = int(prepared.layout.config["vocab_size"])
    prompts = _prompts(10_000, cfg.prompt_tokens, vocab, cfg.seed)
    t0 = loop.time()
    tokens: list[tuple[float, str]] = []
    pair.on_token = lambda s, _tok: tokens.append((loop.time() - t0, s.request_id))
    await pair.start()
    begun: dict[str, float] = {}
    all_streams: list[Stream] = []
    stop = asyncio.Event()

    async def client(k: int) -> None:
        n = 0
        while not stop.is_set():
            rid = f"s{k}-{n}"
            prompt = prompts[(k * 997 + n) % len(prompts)]
            wanted = cfg.max_tokens - (k * 7 + n * 3) % max(1, cfg.max_tokens // 2)  # streams fall out of step
            s = Stream(rid, prompt, wanted, loop.time() - t0)
            begun[rid] = loop.time() - t0
            all_streams.append(s)
            pair.submit(s)
            while not s.done:
                await asyncio.sleep(0.005)
            n += 1

    clients = [asyncio.create_task(client(k)) for k in range(cfg.streams)]
    try:
        await asyncio.sleep(cfg.warm_s)
        scale_out = loop.time() - t0
        plan = make_plan("chain", [pool.node], [target.node], prepared.manifest.count)
        pair.begin_scale_out()
        sending = asyncio.create_task(multicast({pool.node: pool.address, target.node: target.weights},
                                                prepared.manifest, plan, {pool.node: str(prepared.path)},
                                                {target.node: str(out_path)}, token=pool.token,
                                                timeout_s=cfg.arrive_s * 10 + 60))
        ready: list[tuple[float, int]] = []
        last = -1
        while not pair.target_full:
            if pair.target_ready != last:
                last = pair.target_ready
                ready.append((loop.time() - t0, last))
            await asyncio.sleep(0.01)
        full = (pair.counters.switched_s or loop.time()) - t0
        await sending
        await asyncio.sleep(cfg.after_s)
    finally:
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
        counters = LayerCounters.from_fields((await tgt.call(Counters().to_header(0)))[0])
        await pair.close()
    firsts = {s.request_id: s.token_times[0] - t0 for s in all_streams if s.token_times}
    loading = [firsts[r] - begun[r] for r in firsts if scale_out <= begun[r] < full]
    result = ScaleOutRun(live, cfg.seed, scale_out, full, tokens, ready, loading, pair.counters.pulls,
                        sum(s.error is not None for s in all_streams), pair.counters.target_runs,
                        pair.counters.recomputed, counters.bytes_out)
    result.streams_split = sum(s.was_split for s in all_streams)
    result.layers, result.after_window = layers, max(0.0, cfg.after_s - 1.0)
    if cfg.check:  # the streams live scaling split first, then those begun while the weights arrived
        during = [s for s in all_streams if s.done and s.error is None and scale_out <= begun[s.request_id] < full]
        for s in sorted(during, key=lambda s: not s.was_split)[:cfg.check_max]:
            want = await reference(src, model, layers, s.prompt, s.max_tokens, f"check-{s.request_id}")
            result.streams_checked += 1
            result.streams_equal += want == s.tokens
    await src.call(Release(model, ("none",)).to_header(0))
    await src.close()
    await tgt.close()
    return result


def demo_hf_folder() -> Path:
    """The demo model as a Hugging Face folder, converted once into Mesh's data folder (the
    converter runs with the vLLM environment's Python, which has transformers and gguf)."""
    from mesh.engines.vllm_engine import find_vllm_python
    from mesh.modelfiles.demo import demo_gguf_path
    from mesh.paths import data_dir

    out = data_dir() / "live-scaling" / "smollm2-hf"
    if (out / "config.json").is_file():
        return out
    python = find_vllm_python()
    if python is None:
        raise SystemExit("mesh bench live-scaling: the demo's Hugging Face folder is made by the converter, which "
                         "needs the vLLM environment (scripts/setup.sh); or give a folder with --hf")
    done = subprocess.run([python, "-m", "mesh.modelfiles.convert", "gguf-to-hf", str(demo_gguf_path(fetch=True)),
                           str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"mesh bench live-scaling: converting the demo model failed:\n{done.stderr[-2000:]}")
    return out


async def _one(hf: Path, live: bool, cfg: RunConfig, blocks: int) -> ScaleOutRun:
    """A run on fresh agents in a fresh folder (cold starts included)."""
    with tempfile.TemporaryDirectory(prefix="mesh-live-scaling-") as tmp:
        root = Path(tmp)
        prepared = prepare(hf, root / "prepared", blocks)
        token, weights_token = secrets.token_hex(16), secrets.token_hex(16)
        mbps = prepared.path.stat().st_size * 8 / 1e6 / cfg.arrive_s
        pool = await spawn_agent("pool", mbps, token=weights_token)
        agents: list[LayerAgent] = []
        try:
            cores = sorted(os.sched_getaffinity(0))
            for i, node in enumerate(("source", "target")):  # a core each, where there are two
                cpus = str(cores[i]) if len(cores) >= 2 else None
                agents.append(await spawn_layer_agent(node, root, root / "prepared", token, weights_token, cpus=cpus))
            result = await run_once(prepared, agents[0], agents[1], pool, live, cfg)
            result.layers = prepared.layers
            return result
        finally:
            for agent in agents:
                await agent.stop()
            pool.kill()
            await pool.process.wait()


def summary(run: ScaleOutRun) -> dict[str, float]:
    """One run's figures (tokens/s count output tokens; TTFT covers the streams begun while
    the weights arrived, every one of which was served)."""
    bands = run.rate_by_fraction(run.layers)
    ttft = sorted(run.ttft_loading)

    def q(p: float) -> float:
        return ttft[min(len(ttft) - 1, int(p * len(ttft)))] if ttft else float("nan")
    return {"weights_s": run.full_s - run.scale_out_s, "tok_s_before": run.rate(1.0, run.scale_out_s),
            "tok_s_loading": run.rate(run.scale_out_s, run.full_s), "tok_s_0_33": bands[0], "tok_s_33_67": bands[1],
            "tok_s_67_100": bands[2], "tok_s_after": run.rate(run.full_s + 1.0, run.full_s + 1.0 + run.after_window),
            "ttft_p50_s": q(0.5), "ttft_p99_s": q(0.99), "pulls": run.pulls,
            "activation_mb": run.activation_bytes / 1e6,
            "streams_split": run.streams_split, "failed": run.failed,
            "checked_equal": f"{run.streams_equal}/{run.streams_checked}"}


def _table(rows: dict[str, list[dict[str, Any]]]) -> None:
    from rich.console import Console
    from rich.table import Table

    keys = [k for k in next(iter(rows.values()))[0] if k != "checked_equal"]
    table = Table(title="live scaling on two real CPU agents: min / median / max over repeats")
    table.add_column("figure")
    for mode in rows:
        table.add_column(mode, justify="right")
    for key in keys:
        cells = []
        for runs in rows.values():
            vals = sorted(float(r[key]) for r in runs)
            cells.append(f"{vals[0]:.2f} / {statistics.median(vals):.2f} / {vals[-1]:.2f}")
        table.add_row(key, *cells)
    table.add_row("greedy tokens = whole model",
                  *(" ".join(r["checked_equal"] for r in runs) for runs in rows.values()))
    Console().print(table)


def _plot(runs: dict[str, ScaleOutRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.6 * len(runs)), sharex=True)
    for ax, (mode, run) in zip(axes, runs.items()):
        end = max(t for t, _ in run.tokens)
        bins = [i * 0.5 for i in range(int(end / 0.5) + 2)]
        ax.hist([t - run.scale_out_s for t, _ in run.tokens], bins=[b - run.scale_out_s for b in bins],
                weights=[2.0] * len(run.tokens), color="tab:blue", alpha=0.7)
        ax.set_ylabel("tokens/s")
        ax.set_title(mode, fontsize=10)
        twin = ax.twinx()
        steps = [(run.scale_out_s, 0), *run.ready, (run.full_s, run.layers), (end, run.layers)]
        twin.step([t - run.scale_out_s for t, _ in steps], [n for _, n in steps], where="post", color="tab:red")
        twin.set_ylabel("target's layers", color="tab:red")
        ax.axvline(0, color="grey", ls=":")
    axes[-1].set_xlabel("seconds from the scale-out (the multicast's start)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("live-scaling", help="a scale-out under load on two real CPU agents, live scaling on and off")
    p.add_argument("--hf", type=Path,
                   help="a Llama-family Hugging Face folder (default: the demo model, converted once)")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, seeds 0..R-1 (default 3)")
    p.add_argument("--streams", type=int, default=RunConfig.streams, help="concurrent greedy streams (closed loop)")
    p.add_argument("--prompt-tokens", type=int, default=RunConfig.prompt_tokens)
    p.add_argument("--max-tokens", type=int, default=RunConfig.max_tokens)
    p.add_argument("--arrive-s", type=float, default=RunConfig.arrive_s,
                   help="the multicast's duration on the paced link")
    p.add_argument("--warm-s", type=float, default=RunConfig.warm_s)
    p.add_argument("--after-s", type=float, default=RunConfig.after_s)
    p.add_argument("--blocks", type=int, default=8, help="blocks the model is cut into (on layer boundaries)")
    p.add_argument("--json", type=Path, help="write every run's figures and timelines as JSON")
    p.add_argument("--plot", type=Path, help="tokens/s over time and the target's layers, one repeat per mode (PNG)")

    def go(a: argparse.Namespace) -> int:
        from tqdm import tqdm

        hf = a.hf or demo_hf_folder()
        rows: dict[str, list[dict[str, Any]]] = {"live": [], "stop-the-world": []}
        last: dict[str, ScaleOutRun] = {}
        raw = []
        with tqdm(total=2 * a.repeats, desc="runs", unit="run", file=sys.stderr) as bar:
            for seed in range(a.repeats):
                for live in ((True, False) if seed % 2 == 0 else (False, True)):
                    cfg = RunConfig(a.streams, a.prompt_tokens, a.max_tokens, a.warm_s, a.arrive_s, a.after_s, seed)
                    run = asyncio.run(_one(hf, live, cfg, a.blocks))
                    mode = "live" if live else "stop-the-world"
                    rows[mode].append(summary(run))
                    last[mode] = run
                    raw.append({"mode": mode, "seed": seed, **summary(run), "tokens": run.tokens, "ready": run.ready,
                                "scale_out_s": run.scale_out_s, "full_s": run.full_s})
                    bar.update()
        _table(rows)
        if a.json:
            a.json.write_text(json.dumps({"config": {k: v for k, v in vars(a).items() if k != "func"}, "runs": raw},
                                         default=str, indent=1) + "\n")
        if a.plot:
            _plot(last, a.plot)
        return 0

    p.set_defaults(func=go)
