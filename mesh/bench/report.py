"""Printing and saving benchmark figures."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def emit(title: str, figures: dict[str, Any], json_path: str | None, units: dict[str, str] | None = None) -> None:
    """Print `figures` as a two-column table; write them as JSON if asked."""
    units = units or {}
    width = max(len(k) for k in figures)
    print(title)
    for key, value in figures.items():
        shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
        print(f"  {key:<{width}}  {shown} {units.get(key, '')}".rstrip())
    if json_path:
        write_json(json_path, figures)


def finite(value: Any) -> Any:
    """`value` with every inf or nan float, at any depth, as None: JSON has neither (an
    infinite TTFT percentile of requests never served, a figure without data)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(path: str | Path, figures: Any) -> None:
    """A benchmark's figures as JSON at `path` (its folder made), and say so."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(finite(figures), indent=2) + "\n")
    print(f"wrote {path}")
