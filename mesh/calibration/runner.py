"""Calibration runs: measure an engine's iteration times on 2^k grids (LLM-Mesh 5.2).

The measuring loop drives any engine through the engine protocol (mesh.engines.engine_api): it
adds requests, awaits `step()` and times each call with `time.perf_counter()`, so what it
measures is what the node runtime sees of an iteration, the engine's own Python work
(collecting tokens, streaming text) included. An engine takes part through a
`CalibrationTarget` (mesh.calibration.targets builds them): the engine, real prompts of a given
length, and what to record about the engine and the device.

Points
- Prefill point L: one request with a prompt of L tokens and max_tokens=1; one step,
  timed right after a decode step of a companion request (see `_Measurer.prefill`: the
  engine pays to switch input shapes, and in service a prefill always follows another
  shape).
- Decode point (B, C): B requests with prompts of p tokens, prefilled first (not timed),
  then `warmup` decode steps and `reps` timed decode steps; the batch is then aborted. The
  prompt length is chosen so that the median timed step runs at mean context C, in the
  compute subsystem's terms (prompt + tokens produced, before the step):
  p = C - 1 - warmup - (reps - 1) // 2. Engines must produce exactly max_tokens (the
  OpenVINO target ignores end-of-sequence); a step whose batch is not B is discarded and,
  if too few steps remain, the point is measured again.
Every point is `warmup` untimed repetitions then `reps` timed ones. With `passes` > 1 the
whole list of points is measured that many times, every other pass in reverse order, and
the timed samples of all passes are pooled: on a shared machine iteration times drift by
10% or more over seconds, and spreading a point's samples over the run averages the drift
out. The profile holds the median. Grid points are powers of two from 16 up to the limits; held-out points at 1.5x
grid values (between grid points) are measured the same way and compared with what the
PerformanceModel fitted on the grid predicts: mean absolute percentage error (MAPE).

Resuming: after each point the results so far are written to a state file next to the
output (`<out>.state.json`, atomically). Run the same command again after an interruption
and the points already measured are skipped. The state also records what the numbers
depend on (model file, engine settings, reps, warm-up, CPU); a state from different
settings is refused with a message (pass restart=True / `--restart` to discard it). The
state file is removed once the profile is written.
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from mesh.engines.engine_api import Engine, EngineRequest, Sampling
from mesh.perf.model import PerformanceModel
from mesh.perf.profile import Profile, save_profile
from mesh.policy.batching import IterationKind

STATE_FORMAT = "mesh-calibration-state/1"
MIN_LENGTH = 16  # first grid point of prompt lengths and contexts
MAX_ATTEMPTS = 3  # decode measurements retried when steps had to be discarded
BUSY_LIMIT = 0.2  # other processes' share of the machine's CPUs above which a point is re-measured
BUSY_ATTEMPTS = 3  # measurements of a point at most, keeping the least disturbed


class CalibrationError(RuntimeError):
    """A calibration cannot run as asked; the message says why and what to do."""


class CalibrationTarget(Protocol):
    """An engine to calibrate, with what the runner needs around it."""

    engine_name: str  # "openvino", "vllm", ...
    model_name: str  # profile "model" field
    device: str  # profile "device" field (a slug, e.g. "amd-epyc-2c")
    device_kind: str  # "cpu" or "gpu"
    engine: Engine

    def prompt_ids(self, length: int, variant: int) -> list[int]:
        """Real token ids of a prompt of exactly `length` tokens; `variant` varies the text."""

    def identity(self) -> dict[str, Any]:
        """What the measured times depend on (model file, engine settings, device); a resumed
        run must match it."""

    def provenance(self) -> dict[str, Any]:
        """Profile provenance: {"hardware": {...}, "engine": {...}, "model": {...}, ...}."""


@dataclass(frozen=True)
class Settings:
    max_prompt: int
    max_batch: int
    max_context: int
    reps: int = 5
    warmup: int = 2
    passes: int = 1  # times the whole grid is measured (alternating order); samples pooled

    def __post_init__(self) -> None:
        if self.passes < 1:
            raise CalibrationError(f"need at least one pass over the grid, got passes={self.passes}")
        if self.reps < 1 or self.warmup < 0:
            raise CalibrationError(f"need reps >= 1 and warmup >= 0, got reps={self.reps}, warmup={self.warmup}")
        if self.max_batch < 2:
            raise CalibrationError(f"max batch must be at least 2 (a grid needs two batch sizes), got {self.max_batch}")
        for name in ("max_prompt", "max_context"):
            if getattr(self, name) < 2 * MIN_LENGTH:
                raise CalibrationError(f"{name.replace('_', ' ')} must be at least {2 * MIN_LENGTH} "
                                       f"(grids start at {MIN_LENGTH} and need two points), got {getattr(self, name)}")
        if self.prompt_for_context(MIN_LENGTH) < 1:
            raise CalibrationError(f"warmup {self.warmup} and reps {self.reps} are too many decode steps for "
                                   f"the smallest context of {MIN_LENGTH} tokens; lower them")

    def prompt_for_context(self, context: int) -> int:
        """Prompt length that puts the median timed decode step at mean context `context`."""
        return context - 1 - self.warmup - (self.reps - 1) // 2

    def centre_context(self, context: int) -> float:
        return self.prompt_for_context(context) + 1 + self.warmup + (self.reps - 1) / 2

    def as_dict(self) -> dict[str, int]:
        return {"max_prompt": self.max_prompt, "max_batch": self.max_batch, "max_context": self.max_context,
                "reps": self.reps, "warmup": self.warmup, "passes": self.passes}


QUICK = Settings(max_prompt=512, max_batch=8, max_context=512, reps=3, warmup=1)
FULL = Settings(max_prompt=2048, max_batch=16, max_context=2048, reps=5, warmup=2, passes=2)


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... up to hi (inclusive)."""
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


@dataclass(frozen=True)
class Point:
    kind: str  # "prefill" or "decode"
    length: int  # prompt length (prefill) or mean context (decode)
    batch: int = 1
    heldout: bool = False

    @property
    def key(self) -> str:
        return f"{'heldout-' if self.heldout else ''}{self.kind}:b{self.batch}:l{self.length}"

    @property
    def prefill_tokens(self) -> int:
        return self.length * self.batch


@dataclass(frozen=True)
class Grid:
    prefill_lengths: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    heldout: tuple[Point, ...]

    @classmethod
    def for_settings(cls, s: Settings) -> "Grid":
        lengths = powers_of_two(MIN_LENGTH, s.max_prompt)
        batches = powers_of_two(1, s.max_batch)
        contexts = powers_of_two(MIN_LENGTH, s.max_context)
        held = [Point("prefill", 3 * n // 2, heldout=True) for n in lengths[:-1]]
        held_batches = [1] + [3 * b // 2 for b in batches[1:-1]]  # 1.5x grid batches, and batch 1
        held_contexts = [3 * c // 2 for c in contexts[:-1]]
        held += [Point("decode", c, b, heldout=True) for b in held_batches for c in held_contexts]
        return cls(tuple(lengths), tuple(batches), tuple(contexts), tuple(held))

    def grid_points(self) -> list[Point]:
        pts = [Point("prefill", n) for n in self.prefill_lengths]
        pts += [Point("decode", c, b) for b in self.decode_batches for c in self.decode_contexts]
        return pts

    def points(self) -> list[Point]:
        return self.grid_points() + list(self.heldout)

    def as_dict(self) -> dict[str, Any]:
        return {"prefill_lengths": list(self.prefill_lengths), "decode_batches": list(self.decode_batches),
                "decode_contexts": list(self.decode_contexts),
                "heldout_prefill_lengths": [p.length for p in self.heldout if p.kind == "prefill"],
                "heldout_decode_points": [[p.batch, p.length] for p in self.heldout if p.kind == "decode"]}


# ---- the state file --------------------------------------------------------------------------

def state_path_for(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".state.json")


class State:
    """Measured points so far, saved after each one (atomic rename)."""

    def __init__(self, path: Path, identity: dict[str, Any], data: dict[str, Any] | None = None) -> None:
        self.path = path
        self.identity = identity
        self.data = data or {"format": STATE_FORMAT, "identity": identity, "points": {}, "sessions": [],
                             "facts": {}}

    @classmethod
    def open(cls, path: Path, identity: dict[str, Any], restart: bool) -> "State":
        identity = json.loads(json.dumps(identity))  # as it will read back from JSON
        if restart or not path.exists():
            return cls(path, identity)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"cannot read the calibration state {path} ({exc}); delete it or pass "
                                   "--restart to measure from scratch") from exc
        if data.get("format") != STATE_FORMAT:
            raise CalibrationError(f"{path} is not a calibration state ({STATE_FORMAT}); "
                                   "move it away or pass --restart")
        old = data.get("identity", {})
        if old != identity:
            diff = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
            raise CalibrationError(
                f"{path} holds points measured with different settings ({', '.join(diff)}); rerun with the "
                "same model, engine settings, --reps and --warmup to resume, or pass --restart to discard them")
        return cls(path, identity, data)

    @property
    def points(self) -> dict[str, dict[str, Any]]:
        return self.data["points"]

    def record(self, key: str, result: dict[str, Any]) -> None:
        self.points[key] = result
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)

    def date(self) -> str:
        """When the state was last written, from the file system (ISO 8601, UTC)."""
        return datetime.fromtimestamp(self.path.stat().st_mtime, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- interference ----------------------------------------------------------------------------

class CpuMeter:
    """How much of the machine other processes (and the hypervisor: steal time) used while
    a point was measured, from /proc/stat and /proc/self/stat (Linux; elsewhere unknown).

    Other jobs on a small shared machine stretch iteration times for seconds at a time, and
    a median of a few repetitions does not hide that; a point measured while others used
    more than BUSY_LIMIT of the CPUs is measured again (up to BUSY_ATTEMPTS times, keeping
    the least disturbed measurement)."""

    def __init__(self, own_pids: Callable[[], Sequence[int]] | None = None) -> None:
        # own_pids: helper processes whose CPU time counts as the calibration's own (a
        # target's `own_pids()`, e.g. the vLLM engine's worker process)
        self.own_pids = own_pids
        self.available = Path("/proc/stat").exists() and Path("/proc/self/stat").exists()
        self.hz = os.sysconf("SC_CLK_TCK") if self.available else 100
        self.cpus = os.cpu_count() or 1

    def snapshot(self) -> tuple[float, int, int] | None:
        if not self.available:
            return None
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
            mine = 0
            for pid in ["self", *(self.own_pids() if self.own_pids else ())]:
                own = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                mine += int(own[11]) + int(own[12])  # utime, stime (all threads)
        except (OSError, ValueError, IndexError):
            return None
        return time.perf_counter(), user + nice + system + irq + softirq + steal, mine

    def foreign_share(self, a: tuple[float, int, int] | None, b: tuple[float, int, int] | None) -> float | None:
        """Share of all CPUs used by others between two snapshots (0..1), None if unknown."""
        if a is None or b is None or b[0] <= a[0]:
            return None
        others = max(0, (b[1] - a[1]) - (b[2] - a[2]))
        return round(min(1.0, others / self.hz / ((b[0] - a[0]) * self.cpus)), 3)


def wait_for_quiet(max_wait_s: float = 120.0, limit: float = 0.1, window_s: float = 2.0,
                   own_pids: Callable[[], Sequence[int]] | None = None) -> float | None:
    """Wait (up to `max_wait_s`) until other processes use at most `limit` of the CPUs over
    `window_s`; return the last share seen (None where it cannot be measured)."""
    meter = CpuMeter(own_pids)
    if not meter.available:
        return None
    deadline = time.perf_counter() + max_wait_s
    while True:
        before = meter.snapshot()
        time.sleep(window_s)
        share = meter.foreign_share(before, meter.snapshot())
        if share is None or share <= limit or time.perf_counter() >= deadline:
            return share


# ---- measuring -------------------------------------------------------------------------------

class _Measurer:
    def __init__(self, target: CalibrationTarget, settings: Settings) -> None:
        self.target = target
        self.engine = target.engine
        self.s = settings
        self._ids = 0
        self._variant = 0
        self.meter = CpuMeter(getattr(target, "own_pids", None))
        self.wait_budget_s = 0.0  # seconds this session may still wait for a quiet machine
        self.waited_s = 0.0
        self.shapes: set[int] = set()  # prompt-token totals this engine has prefilled (new shapes cost more)

    def _request(self, prompt_len: int, max_tokens: int) -> str:
        self._ids += 1
        self._variant += 1
        rid = f"cal-{self._ids}"
        ids = self.target.prompt_ids(prompt_len, self._variant)
        if len(ids) != prompt_len:
            raise CalibrationError(f"the target gave {len(ids)} prompt tokens where {prompt_len} were asked")
        self.engine.add_request(EngineRequest(rid, prompt_len, Sampling(max_tokens=max_tokens), ids,
                                              output_len=max_tokens))
        return rid

    async def _timed_step(self) -> tuple[float, Any]:
        t0 = time.perf_counter()
        result = await self.engine.step()
        return time.perf_counter() - t0, result

    async def _drain(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)
        while self.engine.has_work():  # an engine that keeps work after aborts: finish it
            await self.engine.step()

    async def prefill(self, point: Point) -> dict[str, Any]:
        """Time prefills of `point.length` tokens, each one after a decode step.

        In service a prefill follows an iteration of another shape (a decode step, or a
        prefill of another length), and OpenVINO's CPU plugin pays 5-10 ms to reconfigure
        for the new input shape: a 32-token prefill right after another one of 32 tokens
        took 24.5 ms, after a decode step 34.5 ms. So a companion request keeps decoding,
        and every timed prefill comes right after one (untimed) decode step of it."""
        s = self.s
        companion = self._request(MIN_LENGTH, s.warmup + s.reps + 3)
        await self.engine.step()  # its prefill
        self.shapes.add(MIN_LENGTH)
        new_shape = point.length not in self.shapes  # the first rep then pays for a new input shape
        first = None
        samples = []
        for rep in range(s.warmup + s.reps):
            if companion_running := self.engine.has_work():
                await self.engine.step()  # a decode step of the companion, not timed
            rid = self._request(point.length, 1)
            dt, result = await self._timed_step()
            ok = result.kind is IterationKind.PREFILL and list(result.request_ids) == [rid]
            if not ok:
                await self._drain([rid, companion])
                raise CalibrationError(f"a prefill of {point.length} tokens did not take exactly one step "
                                       f"(got a {result.kind.value} step for {list(result.request_ids)})")
            self.shapes.add(point.length)
            if rep == 0:
                first = dt
            if rep >= s.warmup:
                samples.append(dt)
        await self._drain([companion])
        median = statistics.median(samples)
        return {"median_s": median, "samples_s": samples, "x": point.length,
                "after": "a decode step" if companion_running else "a prefill",
                "new_shape_extra_s": first - median if new_shape and s.warmup > 0 and first is not None else None}

    async def decode(self, point: Point) -> dict[str, Any]:
        s = self.s
        prompt = s.prompt_for_context(point.length)
        discarded = 0
        for _ in range(MAX_ATTEMPTS):
            rids = [self._request(prompt, 1 + s.warmup + s.reps + 1) for _ in range(point.batch)]
            waiting = set(rids)
            while waiting:  # prefill, not timed (several steps if the prompts exceed the budget)
                result = await self.engine.step()
                if result.kind is not IterationKind.PREFILL:
                    await self._drain(rids)
                    raise CalibrationError("the engine decoded before all prompts were prefilled; it does "
                                           "not follow the protocol's batching rule")
                waiting -= set(result.request_ids)
                self.shapes.add(sum(prompt for _ in result.request_ids))
            samples = []
            first = shrunk = None
            for k in range(s.warmup + s.reps):
                dt, result = await self._timed_step()
                full = result.kind is IterationKind.DECODE and len(result.request_ids) == point.batch
                if not full:
                    discarded += 1
                else:
                    if k == 0:
                        first = dt  # right after the prefill: the decode shape is new (an overhead)
                    if k >= s.warmup:
                        samples.append(dt)
            if point.batch > 1 and len(samples) == s.reps:  # one request leaves: a changed batch (an overhead)
                self.engine.abort(rids[0])
                dt, result = await self._timed_step()
                if result.kind is IterationKind.DECODE and len(result.request_ids) == point.batch - 1:
                    shrunk = dt
            await self._drain(rids)
            if len(samples) == s.reps:
                break
        if not samples:
            raise CalibrationError(f"no decode step at batch {point.batch} could be timed: requests ended "
                                   "early; the engine must generate exactly max_tokens (ignore EOS)")
        median = statistics.median(samples)
        return {"median_s": median, "samples_s": samples, "x": point.length,
                "batch": point.batch, "context": s.centre_context(point.length), "prompt_len": prompt,
                "discarded_steps": discarded,
                "after_prefill_extra_s": None if first is None or s.warmup == 0 else first - median,
                "batch_change_extra_s": None if shrunk is None else shrunk - median}

    async def measure(self, point: Point) -> dict[str, Any]:
        """Measure a point; again (up to BUSY_ATTEMPTS) while other processes were busy."""
        best: dict[str, Any] | None = None
        for attempt in range(1, BUSY_ATTEMPTS + 1):
            before = self.meter.snapshot()
            result = await (self.prefill(point) if point.kind == "prefill" else self.decode(point))
            busy = self.meter.foreign_share(before, self.meter.snapshot())
            result["others_cpu_share"] = busy
            result["attempts"] = attempt
            if best is None or (busy is not None and busy < (best["others_cpu_share"] or 0.0)):
                best = result
            if busy is None or busy <= BUSY_LIMIT:
                break
            if attempt < BUSY_ATTEMPTS and self.wait_budget_s > 0:  # let the other jobs pass first
                t0 = time.perf_counter()
                wait_for_quiet(min(30.0, self.wait_budget_s), own_pids=self.meter.own_pids)
                waited = time.perf_counter() - t0
                self.wait_budget_s -= waited
                self.waited_s += waited
        best["attempts"] = attempt
        return best


# ---- the profile and held-out errors ----------------------------------------------------------

def measured_overheads(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The profile's overheads (mesh-profile/2) from the measurements: the median over decode
    points of (first decode step after the prefill - the point's median step), and of (the
    step after one request left - the point's median); over prefill points of a length the
    engine had not prefilled before, (the first, untimed prefill - the median); never below 0. The instance switch
    and the step overhead outside step() are not measured here (one engine, no node): 0."""
    out = {}
    for name, key in (("decode_after_prefill_s", "after_prefill_extra_s"),
                      ("decode_batch_change_s", "batch_change_extra_s"),
                      ("prefill_new_shape_s", "new_shape_extra_s")):
        values = [r[key] for r in results if r.get(key) is not None]
        if values:
            out[name] = round(max(0.0, statistics.median(values)), 6)
    return out


def build_profile(target: CalibrationTarget, grid: Grid, results: dict[str, dict[str, Any]],
                  facts: dict[str, Any], provenance: dict[str, Any],
                  overheads: dict[str, float] | None = None) -> Profile:
    prefill = [results[Point("prefill", n).key]["median_s"] for n in grid.prefill_lengths]
    decode = [[results[Point("decode", c, b).key]["median_s"] for c in grid.decode_contexts]
              for b in grid.decode_batches]
    return Profile(
        model=target.model_name, device=target.device, device_kind=target.device_kind,
        engine=target.engine_name, kv_bytes_per_token=int(facts["kv_bytes_per_token"]),
        weight_bytes=int(facts["weight_bytes"]), max_context=int(facts["context_window"]),
        prefill_lengths=grid.prefill_lengths, prefill_s=tuple(prefill),
        decode_batches=grid.decode_batches, decode_contexts=grid.decode_contexts,
        decode_s=tuple(tuple(r) for r in decode), provenance=provenance, overheads=dict(overheads or {}),
    )


def heldout_errors(profile: Profile, grid: Grid, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Measured vs predicted at the held-out points; MAPE overall and per kind."""
    model = PerformanceModel(profile)
    rows, errs = [], {"prefill": [], "decode": []}
    for p in grid.heldout:
        r = results[p.key]
        if p.kind == "prefill":
            predicted = model.prefill_s(p.length)
        else:
            predicted = model.decode_s(p.batch, r["context"])
        measured = r["median_s"]
        err = abs(predicted - measured) / measured
        errs[p.kind].append(err)
        rows.append({"kind": p.kind, "batch": p.batch, "length": p.length, "measured_s": round(measured, 6),
                     "predicted_s": round(predicted, 6), "abs_pct_error": round(100 * err, 2)})
    every = errs["prefill"] + errs["decode"]

    def mape(values: list[float]) -> float | None:
        return round(100 * statistics.fmean(values), 2) if values else None

    return {"mape_pct": mape(every), "prefill_mape_pct": mape(errs["prefill"]),
            "decode_mape_pct": mape(errs["decode"]), "max_abs_pct_error": round(100 * max(every), 2) if every else None,
            "points": rows}


# ---- the whole run -------------------------------------------------------------------------

@dataclass
class Report:
    profile: Profile
    out: Path
    measured_now: int  # points measured in this session
    resumed: int  # points taken from the state file
    seconds: float  # measuring time over all sessions (engine loads included)
    heldout: dict[str, Any] = field(default_factory=dict)


def calibrate(
    target: CalibrationTarget,
    settings: Settings,
    out: str | Path,
    *,
    restart: bool = False,
    progress: bool = True,
    on_point: Callable[[Point, dict[str, Any]], None] | None = None,
    command: str | None = None,
    max_wait_s: float = 0.0,
) -> Report:
    """Measure every point not measured yet, then write the profile to `out`.

    `on_point(point, result)` is called after each point is saved (tests interrupt here).
    KeyboardInterrupt (or any exception) leaves the state file for the next run.
    `max_wait_s`: how long this session may wait in all for other processes to leave the
    CPUs before re-measuring a disturbed point (0: re-measure at once).
    """
    return asyncio.run(_calibrate(target, settings, Path(out), restart, progress, on_point, command, max_wait_s))


async def _calibrate(target: CalibrationTarget, settings: Settings, out: Path, restart: bool, progress: bool,
                     on_point: Callable[[Point, dict[str, Any]], None] | None, command: str | None,
                     max_wait_s: float = 0.0) -> Report:
    grid = Grid.for_settings(settings)
    window = target.engine.context_window
    longest = max(settings.max_prompt, settings.max_context + 1)
    if longest >= window:
        raise CalibrationError(f"the engine's context window of {window} tokens is too small for prompts and "
                               f"contexts up to {longest}; raise the window or lower --max-prompt/--max-context")
    batch_cap = getattr(target.engine, "max_batch", None)
    if batch_cap is not None and batch_cap < settings.max_batch:
        raise CalibrationError(f"the engine batches at most {batch_cap} requests; lower --max-batch to {batch_cap}")
    identity = {**target.identity(), "reps": settings.reps, "warmup": settings.warmup}
    state_path = state_path_for(out)
    state = State.open(state_path, identity, restart)
    points = grid.points()
    schedule = [(k, p) for k in range(settings.passes) for p in (points if k % 2 == 0 else points[::-1])]
    todo = [(k, p) for k, p in schedule if _pass_key(p, k) not in state.points]
    resumed = len(schedule) - len(todo)
    session: dict[str, Any] = {"load_average_start": [round(x, 2) for x in os.getloadavg()], "points": len(todo)}
    t0 = time.perf_counter()
    if todo or not state.data["facts"]:
        from mesh.engines.engine_api import EngineError

        try:
            await target.engine.load()
        except EngineError as exc:
            raise CalibrationError(f"the {target.engine_name} engine could not load the model: {exc}") from exc
        session["load_s"] = round(time.perf_counter() - t0, 3)
    facts = state.data["facts"]
    facts.update({"kv_bytes_per_token": target.engine.kv_bytes_per_token,
                  "weight_bytes": target.engine.weight_bytes, "context_window": window})
    state.save()
    measurer = _Measurer(target, settings)
    measurer.wait_budget_s = max_wait_s
    bar = _progress(len(schedule), resumed, progress)
    try:
        for k, point in todo:
            bar.set_postfix_str(point.key, refresh=False)
            result = await measurer.measure(point)
            state.record(_pass_key(point, k), result)
            bar.update(1)
            if on_point is not None:
                on_point(point, result)
    finally:
        bar.close()
        session["seconds"] = round(time.perf_counter() - t0, 3)
        session["waited_for_quiet_s"] = round(measurer.waited_s, 1)
        session["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        state.data["sessions"].append(session)
        state.save()
        await target.engine.unload()

    seconds = sum(s.get("seconds", 0.0) for s in state.data["sessions"])
    provenance = {"method": "measured", **target.provenance()}
    provenance["calibration"] = {
        "created_by": command or "mesh.calibration.runner.calibrate",
        "date": state.date(),
        "settings": settings.as_dict(),
        "grid": grid.as_dict(),
        "statistic": "median of reps timed steps after warmup untimed ones, per point",
        "decode_prompt_rule": "prompt = context - 1 - warmup - (reps - 1) // 2: the median timed step runs at "
                              "mean context = the grid value (prompt + tokens produced, before the step)",
        "seconds": round(seconds, 1),
        "sessions": state.data["sessions"],
        "interference": _interference(state.points),
        "points": len(points),
        "measurements": len(schedule),
    }
    pooled = {p.key: _pool([state.points[_pass_key(p, k)] for k in range(settings.passes)]) for p in points}
    overheads = measured_overheads([state.points[_pass_key(p, k)] for p in points for k in range(settings.passes)])
    profile = build_profile(target, grid, pooled, facts, provenance, overheads)
    held = heldout_errors(profile, grid, pooled)
    provenance["heldout"] = held
    provenance["calibration"]["pass_to_pass"] = _repeatability(pooled)
    provenance["calibration"]["overheads"] = (
        "decode_after_prefill_s: median over decode points of the first step after the prefill minus the "
        "point's median; decode_batch_change_s: the same for the step after one request left; "
        "prefill_new_shape_s: median over prefill points of a length not prefilled before of the first "
        "(untimed) prefill minus the point's median; "
        "instance_switch_s and step_overhead_s not measured (one engine, no node runtime)")
    profile = build_profile(target, grid, pooled, facts, provenance, overheads)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, out)
    state_path.unlink(missing_ok=True)
    return Report(profile, out, len(todo), resumed, seconds, held)


def _pass_key(point: Point, k: int) -> str:
    return f"{point.key}#{k}"


def _pool(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One point's measurements over all passes: the median of all their timed samples."""
    samples = [x for r in results for x in r["samples_s"]]
    return {**results[0], "median_s": statistics.median(samples), "samples_s": samples,
            "pass_medians_s": [r["median_s"] for r in results]}


def _repeatability(pooled: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """How much the passes disagree about the same point: the noise floor a held-out MAPE
    should be read against (mean and median over points of |max - min| / mean of the
    passes' medians, in percent)."""
    spreads = []
    for r in pooled.values():
        m = r.get("pass_medians_s", [])
        if len(m) > 1:
            spreads.append(100 * (max(m) - min(m)) / statistics.fmean(m))
    if not spreads:
        return None
    return {"mean_pct": round(statistics.fmean(spreads), 2), "median_pct": round(statistics.median(spreads), 2),
            "points": len(spreads),
            "meaning": "spread between the passes' medians of the same point (|max - min| / mean)"}


def _interference(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    shares = [r["others_cpu_share"] for r in results.values() if r.get("others_cpu_share") is not None]
    return {
        "rule": f"a point measured while other processes used more than {BUSY_LIMIT:.0%} of the CPUs "
                f"(/proc/stat, steal included) is measured again, at most {BUSY_ATTEMPTS} times, after waiting "
                "(within the session's budget) for the machine to be quiet; the least disturbed measurement "
                "is kept",
        "points_remeasured": sum(1 for r in results.values() if r.get("attempts", 1) > 1),
        "points_over_limit": sum(1 for x in shares if x > BUSY_LIMIT),
        "others_cpu_share_median": round(statistics.median(shares), 3) if shares else None,
        "others_cpu_share_max": max(shares) if shares else None,
    }


def _progress(total: int, initial: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="point", desc="calibrating", file=sys.stderr,
                disable=not enabled, dynamic_ncols=True)


def format_heldout(held: dict[str, Any], repeat: dict[str, Any] | None = None) -> str:
    """The held-out comparison as a small table."""
    noise = (f"; the passes disagree by {repeat['mean_pct']}% on average about the same point"
             if repeat else "")
    lines = [f"held-out points: MAPE {held['mape_pct']}% (prefill {held['prefill_mape_pct']}%, "
             f"decode {held['decode_mape_pct']}%, worst {held['max_abs_pct_error']}%){noise}",
             "  kind     batch  length  measured ms  predicted ms  error %"]
    for r in held["points"]:
        lines.append(f"  {r['kind']:<7} {r['batch']:>6} {r['length']:>7} {1000 * r['measured_s']:>12.2f} "
                     f"{1000 * r['predicted_s']:>13.2f} {r['abs_pct_error']:>8.1f}")
    return "\n".join(lines)
