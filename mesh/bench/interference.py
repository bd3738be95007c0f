"""`mesh bench interference`: what background work on the same machine costs a serving node
(the bound: at most +5% of its TPOT).

A serving node: a real OpenVINO instance of the demo model (mesh.engines.openvino_process, its
own worker, as a node agent runs it) on the node's core set (`--node-cores`, default all
the cores this process may use; OpenVINO with as many inference threads), decoding a batch
of `--batch` requests of `--tokens` tokens each. Its TPOT is the time of each decode
iteration (every running request gets one token per iteration), timed from outside the
engine; the window's p50 is compared between phases:
- `alone`: nothing else started by the benchmark;
- `background`: a background job running in a loop on the node's cores, as Mesh runs it
  (idle priority: SCHED_IDLE and nice 19, one compute thread; mesh.background.
  run_as_background);
- `normal` (with --normal): the same job at normal priority with its default threads, as
  background work would run without it: what the priority buys.
Jobs (`--job`): `prepare`, the node's IR preparation of the model (mesh.engines.background_prepare,
into a fresh folder each time: it converts and compiles every time); `convert`, the
GGUF-to-Hugging-Face conversion for vLLM nodes (mesh.modelfiles.convert in .venv-vllm, 57 s
of CPU for the demo model), what the service runs at registration.

Each repeat runs every phase once, in a rotated order (drift on a shared machine falls on
each phase alike), and gives the rise of each phase's p50 over `alone`'s in the same repeat;
the figures are the minimum, median and maximum over repeats. Other jobs on the machine
(other sessions') are in every phase alike: they make the figures noisy, not biased.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mesh.bench.report import write_json

PHASES = ("alone", "background", "normal")
JOBS = ("prepare", "convert")
SKIP_STEPS = 2  # the first decode iterations of a window (the batch's KV growing) are not timed


@dataclass
class Window:
    phase: str
    repeat: int
    steps: int
    tpot_p50_ms: float
    tpot_p90_ms: float
    jobs_started: int  # background job runs started during the window (0 for alone)


@dataclass
class Figures:
    job: str
    model: str
    node_cores: list[int]
    batch: int
    tokens: int
    repeats: int
    windows: list[Window] = field(default_factory=list)
    rise_pct: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> min, median, max over repeats

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class JobLoop:
    """A background job run again and again until stopped, each run in a process group of
    its own (killed as a whole at the end)."""

    def __init__(self, argv: list[str], env: dict[str, str], work: Path) -> None:
        self.argv, self.env, self.work = argv, env, work
        self.started = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            out = self.work / f"run-{self.started}"
            argv = [a.replace("{out}", str(out)) for a in self.argv]
            self.started += 1
            self._proc = await asyncio.create_subprocess_exec(*argv, env=self.env, stdout=subprocess.DEVNULL,
                                                              stderr=subprocess.DEVNULL, start_new_session=True)
            await self._proc.wait()
            shutil.rmtree(out, ignore_errors=True)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        proc = self._proc
        if proc is not None and proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()


def _job_argv(job: str, model: Path, background: bool) -> tuple[list[str], dict[str, str]] | str:
    """The job's command ({out}: a fresh folder per run) and environment, or why it cannot run."""
    from mesh.engines.worker_process import background_env, worker_env

    env = background_env() if background else worker_env()
    if job == "prepare":
        argv = [sys.executable, "-m", "mesh.engines.background_prepare", str(model), "--root", "{out}", "--no-probe"]
        return argv + ([] if background else ["--normal-priority"]), env
    from mesh.engines.vllm_engine import find_vllm_python

    python = find_vllm_python()
    if python is None:
        return "the convert job needs vLLM's environment (.venv-vllm, scripts/setup.sh)"
    argv = [python, "-m", "mesh.modelfiles.convert", "gguf-to-hf", str(model), "{out}"]
    return argv + (["--background"] if background else []), env


async def _window(engine: Any, batch: int, tokens: int, prompt: list[int], tag: str) -> list[float]:
    """Decode `batch` requests of `tokens` tokens; the decode iterations' times in seconds."""
    from mesh.engines.engine_api import EngineRequest, Sampling
    from mesh.policy.batching import IterationKind

    loop = asyncio.get_running_loop()
    for i in range(batch):
        engine.add_request(EngineRequest(f"{tag}-{i}", len(prompt), Sampling(max_tokens=tokens, temperature=0.0),
                                         prompt_token_ids=prompt))
    times: list[float] = []
    decode_steps = 0
    while engine.has_work():
        t0 = loop.time()
        result = await engine.step()
        if result.kind == IterationKind.DECODE and len(result.request_ids) == batch:
            decode_steps += 1
            if decode_steps > SKIP_STEPS:
                times.append(loop.time() - t0)
    return times


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(model: Path, job: str, cores: list[int], batch: int, tokens: int, repeats: int, normal: bool,
              work: Path, settle_s: float) -> Figures:
    from mesh.engines.openvino_process import OpenVINOProcessEngine

    os.sched_setaffinity(0, set(cores))  # the node's cores: its worker, and the job, inherit them
    phases = [p for p in PHASES if p != "normal" or normal]
    loops: dict[str, JobLoop] = {}
    for phase in phases[1:]:
        made = _job_argv(job, model, background=phase == "background")
        if isinstance(made, str):
            raise SystemExit(f"mesh bench interference: {made}")
        loops[phase] = JobLoop(made[0], made[1], work / phase)
        (work / phase).mkdir(parents=True, exist_ok=True)
    properties = {"INFERENCE_NUM_THREADS": len(cores)} if len(cores) < (os.cpu_count() or 1) else {}
    engine = OpenVINOProcessEngine(model, context_window=2048, max_num_seqs=max(batch, 1), properties=properties,
                                   ignore_eos=True, log_dir=work / "logs")
    await engine.load()
    fig = Figures(job, str(model), sorted(cores), batch, tokens, repeats)
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me about the history of the city of Paris."}])
    try:
        await _window(engine, batch, 8, prompt, "warm")
        for r in range(repeats):
            order = phases[r % len(phases):] + phases[:r % len(phases)]
            for phase in order:
                job_loop = loops.get(phase)
                if job_loop is not None:
                    job_loop.start()
                    await asyncio.sleep(settle_s)  # the job past its start-up, into its heavy part
                times = await _window(engine, batch, tokens, prompt, f"{phase}-{r}")
                started = 0
                if job_loop is not None:
                    started = job_loop.started
                    await job_loop.stop()
                    job_loop.started = 0
                fig.windows.append(Window(phase, r, len(times), round(_p(times, 0.5) * 1000, 3),
                                          round(_p(times, 0.9) * 1000, 3), started))
                print(f"  repeat {r} {phase:<10} TPOT p50 {fig.windows[-1].tpot_p50_ms:7.2f} ms  "
                      f"p90 {fig.windows[-1].tpot_p90_ms:7.2f} ms  ({len(times)} iterations)", flush=True)
    finally:
        for job_loop in loops.values():
            await job_loop.stop()
        await engine.unload()
    for phase in phases[1:]:
        rises = []
        for r in range(repeats):
            base = next(w for w in fig.windows if w.repeat == r and w.phase == "alone").tpot_p50_ms
            with_job = next(w for w in fig.windows if w.repeat == r and w.phase == phase).tpot_p50_ms
            rises.append(100.0 * (with_job / base - 1.0))
        fig.rise_pct[phase] = {"min": round(min(rises), 2), "median": round(statistics.median(rises), 2),
                               "max": round(max(rises), 2)}
    return fig


def _print(fig: Figures) -> None:
    print(f"serving node: cores {','.join(map(str, fig.node_cores))}, batch {fig.batch} x {fig.tokens} tokens, "
          f"job {fig.job}, {fig.repeats} repeats")
    for phase, r in fig.rise_pct.items():
        how = "idle priority, 1 thread" if phase == "background" else "normal priority"
        print(f"TPOT p50 rise with the {fig.job} job at {how}: min {r['min']:+.1f}%  median {r['median']:+.1f}%  "
              f"max {r['max']:+.1f}%   (target: at most +5%)")


def _cores(text: str | None) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    if not text:
        return allowed
    from mesh.control.supervisor import parse_node_cores

    return list(parse_node_cores(text, ["node"], set(allowed))["node"])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("interference", help="a serving node's TPOT with and without background work beside it")
    p.add_argument("--model", help="a GGUF file (default: the demo model, which must be fetched already)")
    p.add_argument("--job", choices=JOBS, default="prepare",
                   help="the background job: 'prepare' (IR preparation, default) or 'convert' (GGUF to HF, .venv-vllm)")
    p.add_argument("--node-cores", default=None, help="the serving node's cores, e.g. 0 or 0-3 (default: all); "
                   "the job runs on them too, as a node's own preparation does")
    p.add_argument("--batch", type=int, default=4, help="requests decoding together (default 4)")
    p.add_argument("--tokens", type=int, default=96, help="tokens each request generates (default 96)")
    p.add_argument("--repeats", type=int, default=5, help="windows per phase (default 5)")
    p.add_argument("--normal", action="store_true", help="also run the job at normal priority (the comparison)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds a job runs before a window starts (default 2)")
    p.add_argument("--json", metavar="PATH", help="write every window as JSON")

    def go(a: argparse.Namespace) -> int:
        if a.model:
            model = Path(a.model)
        else:
            from mesh.modelfiles.demo import ModelFetchError, demo_gguf_path

            try:
                model = demo_gguf_path(fetch=False)
            except ModelFetchError as exc:
                print(exc)
                return 2
        if a.batch < 1 or a.tokens < SKIP_STEPS + 2 or a.repeats < 1:
            print(f"mesh bench interference: --batch >= 1, --tokens >= {SKIP_STEPS + 2} and --repeats >= 1")
            return 2
        try:
            cores = _cores(a.node_cores)
        except ValueError as exc:
            print(f"mesh bench interference: --node-cores: {exc}")
            return 2
        work = Path(tempfile.mkdtemp(prefix="mesh-interference-"))
        try:
            fig = asyncio.run(run(model, a.job, cores, a.batch, a.tokens, a.repeats, a.normal, work, a.settle))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        _print(fig)
        if a.json:
            write_json(a.json, fig.to_dict())
        return 0

    p.set_defaults(func=go)
