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
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mesh.control.agent_client import AgentClient
from mesh.control.live_pair import SOURCE, LivePair, Stream
from mesh.engines.engine_api import NextTokens, TokenBatch
from mesh.modelfiles.layer_order import LayerLayout, write_layer_ordered
from mesh.node.layer_host import LAYERS_PREFIX
from mesh.policy.multicast import make_plan
from mesh.weights.blocks import Manifest, pack
from mesh.weights.coordinator import multicast
from mesh.weights.launch import AgentProcess
from mesh.wire.agent_protocol import READY_PREFIX
from mesh.wire.layers import LayerConnection, LayerCounters, Open, Peer, Release, Run, RunResult

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
class RunResult_:
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
                   cfg: RunConfig) -> RunResult_:
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
            s = Stream(rid, prompt, cfg.max_tokens, loop.time() - t0)
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
        counters = LayerCounters.from_fields((await tgt.call({"t": "counters"}))[0])
        await pair.close()
    firsts = {s.request_id: s.token_times[0] - t0 for s in all_streams if s.token_times}
    loading = [firsts[r] - begun[r] for r in firsts if scale_out <= begun[r] < full]
    result = RunResult_(live, cfg.seed, scale_out, full, tokens, ready, loading, pair.counters.pulls,
                        sum(s.error is not None for s in all_streams), pair.counters.target_runs, pair.counters.recomputed, counters.bytes_out)
    result.streams_split = sum(s.was_split for s in all_streams)
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
