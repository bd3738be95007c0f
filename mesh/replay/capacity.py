"""Capacity search for `mesh replay --capacity`: the highest request rate a policy serves
with at least a target SLO attainment.

The trace's arrival rate is scaled by a factor f (f = 1: the replay's own rate). A run at f
gives an SLO attainment a(f), assumed to fall as f grows. The search brackets the threshold by
growing f by `growth` (default 2; from a passing f) or dividing by it (from a failing f), then bisects until the bracket
[lo, hi] (lo passing, hi failing) is within `rel_tol` of lo; the capacity is lo. Every run is
kept by factor, so a second search (another SLO reading) reuses the first one's runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

DEFAULT_TARGET = 0.9
DEFAULT_REL_TOL = 0.05
MIN_FACTOR = 1 / 64  # below this the search gives up: capacity ~0
MAX_FACTOR = 64.0  # above this the search stops: capacity beyond what it tried


@dataclass
class CapacityResult:
    factor: float  # highest factor that passed (0.0 when none did)
    upper: float | None  # lowest factor that failed (None when none did)
    bounded: bool  # False: gave up at MIN_FACTOR or MAX_FACTOR
    runs: int  # evaluations this search added


@dataclass
class RunCache:
    """Attainments by factor; `evaluate(f)` runs the replay at factor f once and returns
    any number of readings (name -> attainment)."""

    evaluate: Callable[[float], dict[str, float]]
    results: dict[float, dict[str, float]] = field(default_factory=dict)

    @staticmethod
    def key(factor: float) -> float:
        """The factor as runs are kept and reported (rounded: 1.5 * 2 / 3 is 1.0)."""
        return round(factor, 9)

    def get(self, factor: float) -> dict[str, float]:
        key = self.key(factor)
        if key not in self.results:
            self.results[key] = self.evaluate(key)
        return self.results[key]


def search_capacity(
    cache: RunCache,
    reading: str,
    *,
    target: float = DEFAULT_TARGET,
    rel_tol: float = DEFAULT_REL_TOL,
    start: float = 1.0,
    growth: float = 2.0,
) -> CapacityResult:
    """Highest factor whose `reading` attainment is >= `target`, to within `rel_tol` (relative)."""
    if not 0 < target <= 1:
        raise ValueError(f"target attainment must be in (0, 1], got {target}")
    if not rel_tol > 0:
        raise ValueError(f"relative tolerance must be > 0, got {rel_tol}")
    if not growth > 1:
        raise ValueError(f"growth must be > 1, got {growth}")
    before = len(cache.results)

    def ok(f: float) -> bool:
        return cache.get(f)[reading] >= target

    # Start from the best bracket the cache already holds, else from `start`.
    passing = [f for f, r in cache.results.items() if r[reading] >= target]
    failing = [f for f, r in cache.results.items() if r[reading] < target]
    lo = max(passing) if passing else None
    hi = min((f for f in failing if lo is None or f > lo), default=None)
    if lo is None and hi is None:
        if ok(start):
            lo = cache.key(start)
        else:
            hi = cache.key(start)
    while hi is None:  # grow until a run fails
        f = cache.key(lo * growth)
        if f > MAX_FACTOR:
            return CapacityResult(lo, None, False, len(cache.results) - before)
        if ok(f):
            lo = f
        else:
            hi = f
    while lo is None:  # shrink until a run passes
        f = cache.key(hi / growth)
        if f < MIN_FACTOR:
            return CapacityResult(0.0, hi, False, len(cache.results) - before)
        if ok(f):
            lo = f
        else:
            hi = f
    while (hi - lo) > rel_tol * lo:
        mid = cache.key((lo + hi) / 2)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return CapacityResult(lo, hi, True, len(cache.results) - before)
