"""What the control plane's own work costs it: latency histograms and the event-loop lag probe.

`LogHistogram` counts values in logarithmic buckets (`BUCKETS_PER_OCTAVE` a power of two,
from 1 us up: about 9% wide each), so any quantile is known within one bucket from a few
hundred counters, however many values went in, and two snapshots subtract: what happened
between them (`mesh bench control-plane` reads one at the start and one at the end of each
step). Values at or below 1 us fall into the first bucket, values past the last bucket's edge
into the last one.

`LoopLagProbe` measures the event loop's lag the usual way: a task sleeps `interval_s` and
records how late it woke up. Whatever holds the loop (a slow callback, a burst of token
events, a long JSON encode) shows as lag; an idle loop shows about zero. The service runs one
(`/admin/cluster` "control_plane", `/metrics` `mesh_event_loop_lag_seconds`), and beside it a
bound of the part of the lag the process's own work caused (`own_lag`: a busy loop, not a
machine short of cores); the cluster dispatcher records its decisions' durations in a
LogHistogram too.
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Iterable, Mapping

BUCKETS_PER_OCTAVE = 8
FIRST_EDGE_S = 1e-6  # the first bucket's upper edge
OCTAVES = 27  # 1 us .. about 134 s
NUM_BUCKETS = BUCKETS_PER_OCTAVE * OCTAVES + 1


def bucket_of(value: float) -> int:
    """The bucket a value falls in: 0 for value <= FIRST_EDGE_S, k for value in
    (edge(k - 1), edge(k)], the last bucket for anything larger (and for inf and nan)."""
    if not value > FIRST_EDGE_S:  # also nan
        return 0 if value == value else NUM_BUCKETS - 1
    if value == math.inf:
        return NUM_BUCKETS - 1
    k = math.ceil(math.log2(value / FIRST_EDGE_S) * BUCKETS_PER_OCTAVE - 1e-9)
    return min(max(k, 0), NUM_BUCKETS - 1)


def edge(k: int) -> float:
    """Bucket k's upper edge, seconds."""
    return FIRST_EDGE_S * 2.0 ** (k / BUCKETS_PER_OCTAVE)


class LogHistogram:
    """Counts of values (seconds) in logarithmic buckets, their sum and their maximum."""

    __slots__ = ("counts", "count", "total", "max")

    def __init__(self) -> None:
        self.counts = [0] * NUM_BUCKETS
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, value: float) -> None:
        self.counts[bucket_of(value)] += 1
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value

    def quantile(self, q: float) -> float | None:
        """The upper edge of the bucket holding the q-quantile (the smallest value with at
        least q of the values at or below it), never above the largest value seen; None
        when empty."""
        return quantile(self.counts, q, self.max)

    def snapshot(self) -> dict[str, Any]:
        """JSON: count, sum, max, p50/p99, and the non-empty buckets as {bucket: count}."""
        return {"count": self.count, "sum_s": self.total, "max_s": self.max,
                "p50_s": self.quantile(0.5), "p99_s": self.quantile(0.99),
                "buckets": {str(k): n for k, n in enumerate(self.counts) if n}}

    def cumulative(self, bounds: Iterable[float]) -> list[tuple[float, int]]:
        """(bound, values at or below it) for each bound, counted by whole buckets (a bucket
        counts under a bound when its upper edge is at or below it)."""
        out, running, k = [], 0, 0
        for bound in sorted(bounds):
            while k < NUM_BUCKETS and edge(k) <= bound * (1 + 1e-9):
                running += self.counts[k]
                k += 1
            out.append((bound, running))
        return out


def quantile(counts: list[int] | Mapping[int, int], q: float, ceiling: float | None = None) -> float | None:
    """The q-quantile of bucket counts (a list by bucket, or {bucket: count}): the upper edge
    of the first bucket at which the running count reaches ceil(q * total), capped at
    `ceiling` (the largest value seen, when known); None when there are no values."""
    items = sorted(counts.items()) if isinstance(counts, Mapping) else list(enumerate(counts))
    total = sum(n for _k, n in items)
    if total <= 0:
        return None
    rank = max(1, math.ceil(q * total - 1e-9))
    running = 0
    for k, n in items:
        running += n
        if running >= rank:
            value = edge(k)
            return min(value, ceiling) if ceiling is not None else value
    return edge(items[-1][0])  # unreachable: rank <= total


def between(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> dict[str, Any]:
    """What two snapshots of one histogram (LogHistogram.snapshot) say about the values added
    between them: count, mean and p50/p99 (None when none were added). `max_s` is the later
    snapshot's whole-run maximum only when nothing was added before (else unknown: None)."""
    old = {int(k): n for k, n in ((before or {}).get("buckets") or {}).items()}
    new = {int(k): n for k, n in (after.get("buckets") or {}).items()}
    diff = {k: n - old.get(k, 0) for k, n in new.items() if n - old.get(k, 0) > 0}
    count = after.get("count", 0) - (before or {}).get("count", 0)
    total = after.get("sum_s", 0.0) - (before or {}).get("sum_s", 0.0)
    first = not (before or {}).get("count")
    return {"count": count, "mean_s": total / count if count > 0 else None,
            "p50_s": quantile(diff, 0.5), "p99_s": quantile(diff, 0.99),
            "max_s": after.get("max_s") if first else None}


class LoopLagProbe:
    """Every `interval_s` the probe's task sleeps and records, in `lag`, how much later than
    asked it woke (never below 0). `start()` inside a running loop; `stop()` ends the task.

    A late wake-up has two causes: the loop was busy with the process's own work, or the
    process was waiting for a core (a machine with more runnable threads than cores). The
    loop's thread cannot have delayed the wake-up by more than the CPU it used meanwhile, so
    `own_lag` records min(lag, the thread's CPU time over the interval): an upper bound of
    the lag the service's own work caused; lag well above it is the machine's."""

    def __init__(self, interval_s: float = 0.02) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self.lag = LogHistogram()
        self.own_lag = LogHistogram()
        self._task: asyncio.Task | None = None

    def record(self, asked_at: float, woke_at: float, cpu_s: float | None = None) -> float:
        """The lag of one wake-up: woke_at - (asked_at + interval_s), at least 0; recorded,
        with min(lag, cpu_s) in `own_lag` when the thread's CPU time over it is given."""
        lag = max(0.0, woke_at - asked_at - self.interval_s)
        self.lag.add(lag)
        if cpu_s is not None:
            self.own_lag.add(min(lag, max(0.0, cpu_s)))
        return lag

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="event-loop lag probe")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked, cpu = loop.time(), time.thread_time()
            await asyncio.sleep(self.interval_s)
            self.record(asked, loop.time(), time.thread_time() - cpu)

    def view(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, **self.lag.snapshot(), "own": self.own_lag.snapshot()}


EXPORT_OCTAVES = range(4, OCTAVES, 2)  # Prometheus buckets: 16 us, 64 us, 256 us, ~1 ms, ... ~67 s


def export_buckets(snapshot: Mapping[str, Any]) -> list[tuple[str, float]]:
    """A snapshot's cumulative counts at the exported bounds (whole buckets: exact, since
    every bound is a bucket edge), then +Inf: Prometheus' histogram buckets."""
    counts = {int(k): n for k, n in (snapshot.get("buckets") or {}).items()}
    out = []
    for octave in EXPORT_OCTAVES:
        k = octave * BUCKETS_PER_OCTAVE
        out.append((repr(edge(k)), float(sum(n for b, n in counts.items() if b <= k))))
    out.append(("+Inf", float(snapshot.get("count", 0))))
    return out
