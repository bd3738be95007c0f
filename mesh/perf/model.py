"""Performance model (LLM-Mesh 5.2): iteration times interpolated from a profile.

Prefill time: 1-D linear interpolation over prompt length. Decode iteration time: 2-D
(bilinear) interpolation over (batch size, average context length). Both use the profile's
2^k grids.

Rule outside the grid, per axis:
  - below the first grid point (e.g. a 5-token prompt on a grid that starts at 16), the input
    is clamped up to the first point: the time is flat there, which is conservative because
    times grow with size;
  - above the last grid point, the time is extrapolated linearly from the last grid segment
    (bilinearly from the last grid cell in 2-D), and it is never less than the value at the
    input clamped into the grid (the "edge value");
  - inputs below 1 (batch 0, length 0, NaN) raise ValueError.

The scalar methods are the scheduler's hot path (shadow validation calls them thousands of
times per request), so they are plain Python with `bisect` over the grid tuples: about a
microsecond a call, where scipy's per-call overhead is 30-50 us. The vectorised methods use
scipy.interpolate and are the reference: tests check that both paths agree.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

import numpy as np
from scipy.interpolate import RegularGridInterpolator, make_interp_spline

from mesh.perf.profile import Profile


def _cell(grid: tuple[float, ...], inverse_widths: tuple[float, ...], x: float) -> tuple[int, float]:
    """The grid cell holding x and x's fraction across it: (0, 0) below the grid, the last
    cell with a fraction above 1 past it (linear extrapolation)."""
    if x <= grid[0]:
        return 0, 0.0
    i = min(bisect_right(grid, x) - 1, len(grid) - 2)
    return i, (x - grid[i]) * inverse_widths[i]


def _bad(name: str, value: object) -> ValueError:
    return ValueError(f"{name} must be at least 1 (got {value!r}); pass a positive count of tokens/requests")


class PerformanceModel:
    """Iteration times of one model on one device, from its profile (LLM-Mesh 5.2)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        # Costs beyond the grid (mesh-profile/2; 0 for older profiles): mesh.policy.batching.extra_s.
        self.decode_after_prefill_s = profile.overhead("decode_after_prefill_s")
        self.decode_batch_change_s = profile.overhead("decode_batch_change_s")
        self.prefill_new_shape_s = profile.overhead("prefill_new_shape_s")
        self.instance_switch_s = profile.overhead("instance_switch_s")
        self.step_overhead_s = profile.overhead("step_overhead_s")
        # Grids as floats, cached per-segment reciprocals: the scalar path is arithmetic only.
        self._pl = tuple(float(x) for x in profile.prefill_lengths)
        self._pv = profile.prefill_s
        self._p_inv = tuple(1.0 / (b - a) for a, b in zip(self._pl, self._pl[1:]))
        self._db = tuple(float(x) for x in profile.decode_batches)
        self._dc = tuple(float(x) for x in profile.decode_contexts)
        self._dv = profile.decode_s
        self._b_inv = tuple(1.0 / (b - a) for a, b in zip(self._db, self._db[1:]))
        self._c_inv = tuple(1.0 / (b - a) for a, b in zip(self._dc, self._dc[1:]))
        # Reference (vectorised) interpolants: k=1 spline / linear grid interpolator, both
        # extrapolating linearly from the edge segment; clamping and the edge max are applied
        # around them in the *_many methods.
        self._prefill_spline = make_interp_spline(np.array(self._pl), np.array(self._pv), k=1)
        self._decode_rgi = RegularGridInterpolator(
            (np.array(self._db), np.array(self._dc)), np.array(self._dv),
            method="linear", bounds_error=False, fill_value=None,
        )

    def prefill_s(self, prompt_len: int) -> float:
        """Seconds to prefill one prompt of `prompt_len` tokens."""
        if not prompt_len >= 1:
            raise _bad("prompt_len", prompt_len)
        g, v = self._pl, self._pv
        n = len(g)
        if prompt_len <= g[0]:
            return v[0]
        if prompt_len >= g[-1]:
            edge = v[-1]
            value = edge + (prompt_len - g[-1]) * (edge - v[-2]) * self._p_inv[-1]
            return value if value > edge else edge
        i = bisect_right(g, prompt_len) - 1
        if i > n - 2:
            i = n - 2
        return v[i] + (prompt_len - g[i]) * (v[i + 1] - v[i]) * self._p_inv[i]

    def decode_s(self, batch: int, avg_context: float) -> float:
        """Seconds for one decode iteration of `batch` requests at mean context `avg_context`."""
        if not batch >= 1:
            raise _bad("batch", batch)
        if not avg_context >= 1:
            raise _bad("avg_context", avg_context)
        gb, gc = self._db, self._dc
        i, t = _cell(gb, self._b_inv, batch)  # batch axis: cell index and fraction (> 1 above the grid)
        j, u = _cell(gc, self._c_inv, avg_context)
        r0, r1 = self._dv[i], self._dv[i + 1]
        v00, v01, v10, v11 = r0[j], r0[j + 1], r1[j], r1[j + 1]
        a = v00 + (v01 - v00) * u
        b = v10 + (v11 - v10) * u
        value = a + (b - a) * t
        if t > 1.0 or u > 1.0:
            # Above the grid: never less than the edge value (input clamped into the grid).
            tc = t if t < 1.0 else 1.0
            uc = u if u < 1.0 else 1.0
            a = v00 + (v01 - v00) * uc
            b = v10 + (v11 - v10) * uc
            edge = a + (b - a) * tc
            if edge > value:
                return edge
        return value

    def prefill_s_many(self, lengths: Sequence[float] | np.ndarray) -> np.ndarray:
        """prefill_s for each prompt length, vectorised with scipy (the reference path)."""
        x = np.asarray(lengths, dtype=float)
        if not np.all(x >= 1):
            raise _bad("every prompt length", x[~(x >= 1)][0].item())
        g = self._pl
        x = np.maximum(x, g[0])  # clamp below
        extrapolated = self._prefill_spline(x, extrapolate=True)
        edge = self._prefill_spline(np.minimum(x, g[-1]))
        return np.where(x > g[-1], np.maximum(extrapolated, edge), extrapolated)

    def decode_s_many(
        self, batches: Sequence[float] | np.ndarray, contexts: Sequence[float] | np.ndarray
    ) -> np.ndarray:
        """decode_s for each (batch, context) pair, vectorised with scipy (the reference path)."""
        b, c = np.broadcast_arrays(np.asarray(batches, dtype=float), np.asarray(contexts, dtype=float))
        if not np.all(b >= 1):
            raise _bad("every batch", b[~(b >= 1)][0].item())
        if not np.all(c >= 1):
            raise _bad("every avg_context", c[~(c >= 1)][0].item())
        b = np.maximum(b, self._db[0])  # clamp below
        c = np.maximum(c, self._dc[0])
        extrapolated = self._decode_rgi(np.stack([b, c], axis=-1))
        edge = self._decode_rgi(np.stack([np.minimum(b, self._db[-1]), np.minimum(c, self._dc[-1])], axis=-1))
        above = (b > self._db[-1]) | (c > self._dc[-1])
        return np.where(above, np.maximum(extrapolated, edge), extrapolated)
