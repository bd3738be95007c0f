"""Capacity: the highest request rate a policy serves with at least a target SLO attainment.

At one load a ratio of SLO-compliant requests is capped by the better system's 100%; the
capacity (requests per second served at >= 90% attainment) is not. `find_capacity` brackets
the rate by doubling or halving from a start, then bisects geometrically until the bracket
is within a relative tolerance. Attainment is assumed to fall as the rate rises; where
noise makes it not quite monotone, the result is the highest rate seen to pass with a
failing rate above it within the tolerance.

No I/O, no clock: the caller's `attainment(rps)` runs the replays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

DEFAULT_TARGET = 0.9
DEFAULT_REL_TOL = 0.05
MAX_FACTOR = 64.0  # bracketing stops this far from the start


@dataclass
class Capacity:
    rps: float  # the highest rate seen to pass (0.0: none did, down to start / MAX_FACTOR)
    points: list[tuple[float, float]] = field(default_factory=list)  # (rate tried, attainment), in order
    bracket: tuple[float, float] = (0.0, math.inf)  # (passing, failing) rates at the end


def find_capacity(attainment: Callable[[float], float], start: float, target: float = DEFAULT_TARGET,
                  rel_tol: float = DEFAULT_REL_TOL) -> Capacity:
    """The highest rate r with attainment(r) >= target, to within `rel_tol` of the rate."""
    if not (start > 0 and math.isfinite(start)):
        raise ValueError(f"the start rate must be a positive number, got {start}")
    if not 0 < target <= 1 or not rel_tol > 0:
        raise ValueError(f"need 0 < target <= 1 and rel_tol > 0, got {target}, {rel_tol}")
    out = Capacity(0.0)

    def passes(rps: float) -> bool:
        value = attainment(rps)
        out.points.append((rps, value))
        return value >= target

    lo, hi = 0.0, math.inf
    if passes(start):
        lo, rate = start, start * 2
        while rate <= start * MAX_FACTOR:
            if not passes(rate):
                hi = rate
                break
            lo, rate = rate, rate * 2
    else:
        hi, rate = start, start / 2
        while rate >= start / MAX_FACTOR:
            if passes(rate):
                lo = rate
                break
            hi, rate = rate, rate / 2
    if lo > 0 and math.isfinite(hi):
        while hi / lo > 1 + rel_tol:
            mid = math.sqrt(lo * hi)
            if passes(mid):
                lo = mid
            else:
                hi = mid
    out.rps, out.bracket = lo, (lo, hi)
    return out
