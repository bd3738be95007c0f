"""Loader for Azure Functions 2019 per-minute invocation counts.

File format (Shahrad et al., ATC 2020, "invocations_per_function_md" files)::

    HashOwner,HashApp,HashFunction,Trigger,<minute>,<minute>,...
    <owner>,<app>,<function>,<trigger>,<count>,<count>,...

one row per function; each minute column holds that function's invocation count in that
minute of the day. Any number of minute columns (at least one) is accepted, starting at
any minute, as long as the minute numbers are consecutive integers. Counts are
non-negative integers.

Malformed input raises `TraceFormatError`, which names the file, the line and what was
expected.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

ID_COLUMNS: tuple[str, ...] = ("HashOwner", "HashApp", "HashFunction", "Trigger")


class TraceFormatError(ValueError):
    """A trace file does not have the expected format (names file, line, expectation)."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = message
        super().__init__(f"{self.path}, line {line}: {message}")


@dataclass(frozen=True)
class FunctionTrace:
    """Per-minute invocation counts of a set of functions.

    `function_ids[i]` is "HashOwner/HashApp/HashFunction" of row i (a repeated triple gets
    "#2", "#3", ... appended in file order, so ids are unique and stable);
    `counts[i, j]` is the number of invocations of function i in minute `minutes[j]`.
    """

    path: str
    function_ids: tuple[str, ...]
    triggers: tuple[str, ...]
    minutes: np.ndarray  # int64, shape (n_minutes,), consecutive minute-of-day numbers
    counts: np.ndarray  # int64, shape (n_functions, n_minutes)
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n_f, n_m = len(self.function_ids), len(self.minutes)
        if self.counts.shape != (n_f, n_m):
            raise ValueError(f"counts shape {self.counts.shape} != ({n_f}, {n_m})")
        if len(self.triggers) != n_f:
            raise ValueError(f"{len(self.triggers)} triggers for {n_f} functions")
        index = {fid: i for i, fid in enumerate(self.function_ids)}
        if len(index) != n_f:
            raise ValueError("function ids are not unique")
        object.__setattr__(self, "_index", index)

    @property
    def n_functions(self) -> int:
        return len(self.function_ids)

    @property
    def n_minutes(self) -> int:
        return len(self.minutes)

    @property
    def first_minute(self) -> int:
        return int(self.minutes[0])

    def index_of(self, function_id: str) -> int:
        """Row index of `function_id`; KeyError naming the trace when it is absent."""
        try:
            return self._index[function_id]
        except KeyError:
            raise KeyError(f"function {function_id!r} is not in {self.path}") from None

    def window(self, minutes: int, start_minute: int | None = None) -> slice:
        """Column slice of `minutes` consecutive minutes from `start_minute` (default: the
        first minute of the trace). ValueError when the window leaves the trace."""
        start = self.first_minute if start_minute is None else int(start_minute)
        if minutes < 1:
            raise ValueError(f"window must hold at least 1 minute, got {minutes}")
        last = int(self.minutes[-1])
        if start < self.first_minute or start + minutes - 1 > last:
            raise ValueError(
                f"window of {minutes} minutes from minute {start} is outside {self.path}, "
                f"which covers minutes {self.first_minute}..{last}"
            )
        col = start - self.first_minute
        return slice(col, col + minutes)


def _parse_header(path: Path, header: list[str]) -> np.ndarray:
    expected = ",".join(ID_COLUMNS) + ",<minute>,..."
    names = [h.strip() for h in header]
    if names and names[0].startswith("\ufeff"):
        names[0] = names[0][1:]
    if tuple(names[:4]) != ID_COLUMNS:
        raise TraceFormatError(
            path, 1, f"expected header {expected}, got {','.join(header[:5])[:120]!r}"
        )
    if len(names) < 5:
        raise TraceFormatError(
            path, 1, f"expected at least one minute column after {','.join(ID_COLUMNS)}"
        )
    minutes: list[int] = []
    for k, name in enumerate(names[4:], start=5):
        try:
            minutes.append(int(name))
        except ValueError:
            raise TraceFormatError(
                path, 1, f"column {k}: expected an integer minute number, got {name!r}"
            ) from None
    for k in range(1, len(minutes)):
        if minutes[k] != minutes[k - 1] + 1:
            raise TraceFormatError(
                path,
                1,
                f"column {k + 5}: expected consecutive minute numbers, got {minutes[k]} "
                f"after {minutes[k - 1]}",
            )
    return np.asarray(minutes, dtype=np.int64)


def first_nonblank_row(reader: Iterator[list[str]]) -> list[str] | None:
    """The first row of a CSV reader that is not blank (a trace's header), or None."""
    for row in reader:
        if any(c.strip() for c in row):
            return row
    return None


def load_function_trace(path: str | Path) -> FunctionTrace:
    """Load an Azure Functions per-minute invocation-count CSV (format in the module doc).

    Blank lines are skipped. Raises `TraceFormatError` (file, line, expectation) on an empty
    file, a bad header, a row with the wrong number of columns, an empty id field, or a
    count that is not a non-negative integer; FileNotFoundError when the file is missing.
    """
    path = Path(path)
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = first_nonblank_row(reader)
        if header is None:
            raise TraceFormatError(
                path, 1, f"empty file, expected header {','.join(ID_COLUMNS)},<minute>,..."
            )
        header_line = reader.line_num
        try:
            minutes = _parse_header(path, header)
        except TraceFormatError as e:
            raise TraceFormatError(path, header_line, e.reason) from None
        n_cols = 4 + len(minutes)
        ids: list[str] = []
        triggers: list[str] = []
        rows: list[list[int]] = []
        seen: dict[str, int] = {}
        for row in reader:
            line = reader.line_num
            if not any(c.strip() for c in row):
                continue
            if len(row) != n_cols:
                raise TraceFormatError(
                    path,
                    line,
                    f"expected {n_cols} columns (4 id columns + {len(minutes)} minutes), "
                    f"got {len(row)}",
                )
            for k in range(4):
                if not row[k].strip():
                    raise TraceFormatError(
                        path, line, f"column {k + 1} ({ID_COLUMNS[k]}): expected a non-empty value"
                    )
            values: list[int] = []
            for k, cell in enumerate(row[4:]):
                try:
                    v = int(cell)
                except ValueError:
                    raise TraceFormatError(
                        path,
                        line,
                        f"minute {minutes[k]} (column {k + 5}): expected a non-negative "
                        f"integer count, got {cell!r}",
                    ) from None
                if v < 0:
                    raise TraceFormatError(
                        path,
                        line,
                        f"minute {minutes[k]} (column {k + 5}): expected a non-negative "
                        f"integer count, got {v}",
                    )
                values.append(v)
            base = "/".join(c.strip() for c in row[:3])
            n_seen = seen.get(base, 0) + 1
            seen[base] = n_seen
            ids.append(base if n_seen == 1 else f"{base}#{n_seen}")
            triggers.append(row[3].strip())
            rows.append(values)
    if not rows:
        raise TraceFormatError(
            path, header_line + 1, "expected at least one function row after the header"
        )
    counts = np.asarray(rows, dtype=np.int64)
    return FunctionTrace(
        path=str(path),
        function_ids=tuple(ids),
        triggers=tuple(triggers),
        minutes=minutes,
        counts=counts,
    )
