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
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        # JSON has no inf/nan: an infinite TTFT percentile (requests never served) or a figure
        # without data is written as null
        finite = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in figures.items()}
        Path(json_path).write_text(json.dumps(finite, indent=2) + "\n")
        print(f"wrote {json_path}")
