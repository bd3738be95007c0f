"""A model's sampling defaults: the temperature and top_p a request gets when it omits them.

Where they come from, first found wins per field:
1. the registration body's `sampling_defaults` ({"temperature": 0.2, "top_p": 0.9});
2. the model itself: a GGUF's `general.sampling.temp` / `general.sampling.top_p` (the keys
   llama.cpp's converters write from the author's recommendation), or a folder's
   `generation_config.json` (`temperature`, `top_p`; `do_sample: false` means greedy, 0);
3. OpenAI's defaults, temperature 1 and top_p 1.
The engines implement temperature and top_p only, so top_k and min_p in the model's metadata
are not used. A request's own `temperature` / `top_p` always win.

Values too small for the engines' 32-bit sampling settings (a temperature or top_p above 0
but below MIN_POSITIVE, e.g. 5e-324, which becomes 0 in float32 and is refused by the
engine) are raised to MIN_POSITIVE: the same sampling, the most likely token only.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

FIELDS = ("temperature", "top_p")
MIN_POSITIVE = 1e-6
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p"}


class SamplingDefaultsError(ValueError):
    """A sampling default is not valid; the message names it."""


def check(value: Any, where: str = "sampling_defaults") -> dict[str, float]:
    """Valid defaults from a registration body or a model's metadata: temperature in [0, 2],
    top_p in (0, 1]; unknown fields are refused."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SamplingDefaultsError(f"'{where}' must be an object like {{\"temperature\": 0.2, \"top_p\": 0.9}}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise SamplingDefaultsError(f"'{where}' has unknown fields {unknown}; use {', '.join(FIELDS)}")
    out = {}
    for name, x in value.items():
        number = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        ok = number and (0 <= x <= 2 if name == "temperature" else 0 < x <= 1)
        if not ok:
            raise SamplingDefaultsError(f"'{where}.{name}' must be a number in "
                                        f"{'[0, 2]' if name == 'temperature' else '(0, 1]'}")
        out[name] = float(x)
    return out


def from_gguf_metadata(meta: Mapping[str, Any]) -> dict[str, float]:
    """The defaults a GGUF file carries (out-of-range values are ignored, not trusted)."""
    found = {name: meta[key] for name, key in GGUF_KEYS.items() if key in meta}
    return _valid_fields(found)


def from_generation_config(folder: Path) -> dict[str, float]:
    """The defaults in a Hugging Face / OpenVINO IR folder's generation_config.json, or {}."""
    try:
        data = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    if data.get("do_sample") is False:
        return {"temperature": 0.0}
    return _valid_fields({k: data[k] for k in FIELDS if k in data})


def _valid_fields(found: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for name, x in found.items():
        try:
            out.update(check({name: x}))
        except SamplingDefaultsError:
            continue
    return out


def resolve(temperature: float | None, top_p: float | None, defaults: Mapping[str, float] | None) -> tuple[float,
                                                                                                           float]:
    """(temperature, top_p) of a request: its own values, else the model's defaults, else OpenAI's."""
    merged = {**OPENAI_DEFAULTS, **(defaults or {})}
    t = merged["temperature"] if temperature is None else temperature
    p = merged["top_p"] if top_p is None else top_p
    return (max(t, MIN_POSITIVE) if t > 0 else t, max(p, MIN_POSITIVE))
