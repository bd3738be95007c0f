"""Loader for the Azure LLM inference trace 2023 (request arrival times and lengths).

File format (Patel et al., "Splitwise", ISCA 2024)::

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,374,44

TIMESTAMP is a date and time ("YYYY-MM-DD HH:MM:SS[.fraction]", "T" also accepted as the
separator, up to 9 fraction digits) or, in every row alike, a plain number of seconds.
Timestamps must not decrease. Token counts are non-negative integers. Malformed input
raises `TraceFormatError` naming the file, the line and what was expected.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

from workloads.azure_functions import TraceFormatError, first_nonblank_row

LENGTH_COLUMNS: tuple[str, ...] = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

_DATETIME = re.compile(r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?$")
_EPOCH = datetime(1970, 1, 1)
_ONE_SECOND = timedelta(seconds=1)


@dataclass(frozen=True, slots=True)
class LengthSample:
    """`n` sampled (prompt, output) pairs and what the length limit excluded.

    `excluded_fraction` is the fraction of the trace's requests left out of the pool that
    was sampled from: input + output above `max_total`, or an input or output below 1.
    """

    prompt_tokens: np.ndarray  # int64, shape (n,)
    output_tokens: np.ndarray  # int64, shape (n,)
    max_total: int | None
    eligible: int  # requests in the pool sampled from
    excluded: int  # requests of the trace left out of the pool
    excluded_fraction: float


@dataclass(frozen=True)
class LengthTrace:
    """Request arrival times and token lengths of an Azure LLM inference trace.

    `timestamps_s[i]` is row i's time in seconds after the first row (float64, so the first
    is 0.0); `context_tokens` and `generated_tokens` are int64 arrays of the same length.
    """

    path: str
    timestamps_s: np.ndarray
    context_tokens: np.ndarray
    generated_tokens: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.timestamps_s)
        if len(self.context_tokens) != n or len(self.generated_tokens) != n:
            raise ValueError("timestamps, context_tokens and generated_tokens differ in length")

    def __len__(self) -> int:
        return len(self.timestamps_s)

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last request."""
        return float(self.timestamps_s[-1]) if len(self) else 0.0

    def eligible_mask(self, max_total: int | None = None) -> np.ndarray:
        """Boolean mask of requests with input >= 1, output >= 1 and, when `max_total` is
        given, input + output <= max_total."""
        mask = (self.context_tokens >= 1) & (self.generated_tokens >= 1)
        if max_total is not None:
            mask &= (self.context_tokens + self.generated_tokens) <= max_total
        return mask

    def excluded_fraction(self, max_total: int | None = None) -> float:
        """Fraction of the trace's requests `sample(..., max_total)` never returns."""
        return float(1.0 - self.eligible_mask(max_total).mean()) if len(self) else 0.0

    def sample(
        self, n: int, rng: np.random.Generator, max_total: int | None = None
    ) -> LengthSample:
        """`n` (input, output) pairs drawn uniformly with replacement from the trace's
        requests with input >= 1, output >= 1 and input + output <= `max_total` (the model's
        context window; None: no limit). Pairs are kept together, never mixed across rows.
        ValueError when no request qualifies."""
        if n < 0:
            raise ValueError(f"sample size must be >= 0, got {n}")
        if max_total is not None and max_total < 2:
            raise ValueError(f"max_total must be >= 2 (one input and one output token), got {max_total}")
        idx = np.flatnonzero(self.eligible_mask(max_total))
        if len(idx) == 0:
            raise ValueError(
                f"no request of {self.path} has input >= 1, output >= 1 and "
                f"input + output <= {max_total}"
            )
        pick = idx[rng.integers(0, len(idx), size=n)]
        excluded = len(self) - len(idx)
        return LengthSample(
            prompt_tokens=self.context_tokens[pick].copy(),
            output_tokens=self.generated_tokens[pick].copy(),
            max_total=max_total,
            eligible=int(len(idx)),
            excluded=int(excluded),
            excluded_fraction=excluded / len(self),
        )


def _parse_time_ns(path: Path, line: int, cell: str, numeric: bool | None) -> tuple[int, bool]:
    """Parse one TIMESTAMP cell to integer nanoseconds; returns (ns, is_numeric)."""
    text = cell.strip()
    m = _DATETIME.match(text)
    if m is not None and numeric is not True:
        try:
            dt = datetime.strptime(f"{m.group(1)} {m.group(2)}", "%Y-%m-%d %H:%M:%S")
        except ValueError:
            m = None
        else:
            frac = (m.group(3) or "").ljust(9, "0")
            seconds = (dt - _EPOCH) // _ONE_SECOND
            return seconds * 1_000_000_000 + int(frac), False
    if numeric is not False:
        try:
            value = float(text)
        except ValueError:
            pass
        else:
            if np.isfinite(value):
                return int(round(value * 1e9)), True
    kind = {None: "a date-time YYYY-MM-DD HH:MM:SS[.fraction] or a number of seconds",
            False: "a date-time YYYY-MM-DD HH:MM:SS[.fraction], like the first row",
            True: "a number of seconds, like the first row"}[numeric]
    raise TraceFormatError(path, line, f"TIMESTAMP: expected {kind}, got {cell!r}")


def _parse_tokens(path: Path, line: int, column: str, cell: str) -> int:
    try:
        value = int(cell)
    except ValueError:
        raise TraceFormatError(
            path, line, f"{column}: expected a non-negative integer, got {cell!r}"
        ) from None
    if value < 0:
        raise TraceFormatError(path, line, f"{column}: expected a non-negative integer, got {value}")
    return value


def load_lengths(path: str | Path) -> LengthTrace:
    """Load an Azure LLM inference trace CSV (format in the module doc).

    Blank lines are skipped. Raises `TraceFormatError` (file, line, expectation) on an empty
    file, a bad header, a wrong column count, a bad timestamp, a decreasing timestamp or a
    token count that is not a non-negative integer; FileNotFoundError when it is missing.
    """
    path = Path(path)
    expected_header = ",".join(LENGTH_COLUMNS)
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = first_nonblank_row(reader)
        if header is None:
            raise TraceFormatError(path, 1, f"empty file, expected header {expected_header}")
        header_line = reader.line_num
        names = [h.strip().lstrip("\ufeff") for h in header]
        if tuple(names) != LENGTH_COLUMNS:
            raise TraceFormatError(
                path, header_line, f"expected header {expected_header}, got {','.join(header)[:120]!r}"
            )
        times: list[int] = []
        ctx: list[int] = []
        gen: list[int] = []
        numeric: bool | None = None
        for row in reader:
            line = reader.line_num
            if not any(c.strip() for c in row):
                continue
            if len(row) != 3:
                raise TraceFormatError(
                    path, line, f"expected 3 columns ({expected_header}), got {len(row)}"
                )
            t, numeric = _parse_time_ns(path, line, row[0], numeric)
            if times and t < times[-1]:
                raise TraceFormatError(
                    path, line, f"TIMESTAMP: expected a time no earlier than the previous row's, got {row[0]!r}"
                )
            times.append(t)
            ctx.append(_parse_tokens(path, line, "ContextTokens", row[1]))
            gen.append(_parse_tokens(path, line, "GeneratedTokens", row[2]))
    if not times:
        raise TraceFormatError(path, header_line + 1, "expected at least one request row after the header")
    t_ns = np.asarray(times, dtype=np.int64)
    return LengthTrace(
        path=str(path),
        timestamps_s=(t_ns - t_ns[0]).astype(np.float64) / 1e9,
        context_tokens=np.asarray(ctx, dtype=np.int64),
        generated_tokens=np.asarray(gen, dtype=np.int64),
    )

