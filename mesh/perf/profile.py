"""Profile files: measured or modelled iteration times of one model on one device and engine.

A profile holds prefill time over prompt length and decode iteration time over
(batch size, average context length), sampled on 2^k grids (LLM-Mesh 5.2). The file is JSON
with the format tag "mesh-profile/1":

    {"format": "mesh-profile/1", "model": ..., "device": ..., "device_kind": "cpu" | "gpu",
     "engine": ..., "kv_bytes_per_token": int, "weight_bytes": int, "max_context": int,
     "prefill": {"prompt_lengths": [...], "seconds": [...]},
     "decode": {"batch_sizes": [...], "context_lengths": [...],
                "seconds": [[one per context length] one row per batch size]},
     "provenance": {"method": "roofline" | "measured", "hardware": {...}, ...}}

"mesh-profile/2" adds one optional field, the costs an iteration pays beyond the grid's
time, measured by calibration (seconds, each >= 0; a missing key is 0):

     "overheads": {"decode_after_prefill_s": ..., "decode_batch_change_s": ...,
                   "prefill_new_shape_s": ..., "instance_switch_s": ..., "step_overhead_s": ...}

decode_after_prefill_s: a decode step right after a prefill of the same instance (the CPU
plugin reconfigures for the decode shape: about 5 ms for the demo model on 2 cores);
decode_batch_change_s: a decode step whose batch differs from the previous decode's (a
request left); prefill_new_shape_s: a prefill of a token count the instance has not
prefilled before (the plugin prepares kernels for a new input shape: 10-20 ms for the demo
model); instance_switch_s: an iteration of another instance than the previous one;
step_overhead_s: the engine's own work per step outside the timed grid. Files of format
/1 are read as /2 with no overheads, and a profile without overheads is written as /1,
so old files round-trip unchanged.

Every loading path validates the whole file; a ProfileError names the file and the field.
"""
from __future__ import annotations

import copy
import json
import math
import numbers
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

FORMAT = "mesh-profile/2"
FORMAT_V1 = "mesh-profile/1"
READABLE = (FORMAT_V1, FORMAT)
OVERHEADS = ("decode_after_prefill_s", "decode_batch_change_s", "prefill_new_shape_s", "instance_switch_s",
             "step_overhead_s")
DEVICE_KINDS = ("cpu", "gpu")
METHODS = ("roofline", "measured", "prior")  # prior: a hand-fitted model, before calibration
_FIELDS = (
    "format", "model", "device", "device_kind", "engine", "kv_bytes_per_token",
    "weight_bytes", "max_context", "prefill", "decode", "provenance", "overheads",
)
_REFERENCE_PACKAGE = "mesh.perf"
_REFERENCE_DIR = "profiles"


class ProfileError(ValueError):
    """A profile file or dict is invalid; the message names the source and the field."""


@dataclass(frozen=True)
class Profile:
    """One (model, device, engine) profile. Times are seconds per iteration."""

    model: str
    device: str
    device_kind: str
    engine: str
    kv_bytes_per_token: int
    weight_bytes: int
    max_context: int
    prefill_lengths: tuple[int, ...]
    prefill_s: tuple[float, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_s: tuple[tuple[float, ...], ...]  # [batch index][context index]
    provenance: dict
    overheads: dict = field(default_factory=dict)  # OVERHEADS -> seconds (mesh-profile/2)

    def overhead(self, name: str) -> float:
        """One of OVERHEADS in seconds (0 where the profile has none)."""
        if name not in OVERHEADS:
            raise KeyError(f"unknown overhead {name!r}; the overheads are {', '.join(OVERHEADS)}")
        return float(self.overheads.get(name, 0.0))

    def __post_init__(self) -> None:
        # Same rules as a file, however the Profile was built; sequences become tuples.
        values = _check(profile_to_dict(self), source=f"<Profile {self.model}/{self.device}>")
        for name, value in zip(self.__dataclass_fields__, values, strict=True):
            object.__setattr__(self, name, value)


def _fail(source: str, field: str, problem: str) -> ProfileError:
    return ProfileError(f"{source}: {field}: {problem}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_list(value: Any) -> Any:
    """Lists for sequences (tuples from a Profile, lists from JSON); anything else as is."""
    return list(value) if isinstance(value, (list, tuple)) else value


def _get(obj: dict, key: str, source: str, prefix: str = "") -> Any:
    if key not in obj:
        raise _fail(source, prefix + key, "missing field; add it (see mesh/perf/profile.py for the format)")
    return obj[key]


def _string(obj: dict, key: str, source: str) -> str:
    value = _get(obj, key, source)
    if not isinstance(value, str) or not value.strip():
        raise _fail(source, key, f"must be a non-empty string, got {value!r}")
    return value


def _positive_int(obj: dict, key: str, source: str) -> int:
    value = _get(obj, key, source)
    if not _is_int(value) or value < 1:
        raise _fail(source, key, f"must be a positive integer, got {value!r}")
    return int(value)


def _object(obj: dict, key: str, source: str, prefix: str = "") -> dict:
    value = _get(obj, key, source, prefix)
    if not isinstance(value, dict):
        raise _fail(source, prefix + key, f"must be a JSON object, got {type(value).__name__}")
    return value


def _axis(obj: dict, key: str, source: str, prefix: str) -> tuple[int, ...]:
    """A grid axis: at least two strictly increasing powers of two (LLM-Mesh 5.2)."""
    field = prefix + key
    values = _get(obj, key, source, prefix)
    values = _as_list(values)
    if not isinstance(values, list) or len(values) < 2:
        raise _fail(source, field, f"must be a list of at least 2 powers of two, got {values!r}")
    for i, v in enumerate(values):
        if not _is_int(v) or v < 1 or v & (v - 1):
            raise _fail(source, f"{field}[{i}]", f"must be a positive power of two, got {v!r}")
        if i and v <= values[i - 1]:
            raise _fail(
                source, f"{field}[{i}]",
                f"must be greater than the previous point {values[i - 1]} (sort the grid ascending, no repeats)",
            )
    return tuple(int(v) for v in values)


def _seconds(values: Any, n: int, source: str, field: str, axis_field: str) -> tuple[float, ...]:
    values = _as_list(values)
    if not isinstance(values, list):
        raise _fail(source, field, f"must be a list of {n} times in seconds, got {type(values).__name__}")
    if len(values) != n:
        raise _fail(
            source, field,
            f"has {len(values)} times but {axis_field} has {n} points; give one time per grid point",
        )
    out = []
    for i, v in enumerate(values):
        ok = _is_number(v) and math.isfinite(v) and v > 0
        if not ok:
            raise _fail(source, f"{field}[{i}]", f"must be a positive number, got {v!r}")
        out.append(float(v))
    return tuple(out)


def profile_from_dict(data: dict, source: str = "<dict>") -> Profile:
    """Validate a decoded profile document and build a Profile; errors name `source`."""
    return Profile(*_check(data, source))


def _check(data: dict, source: str) -> tuple:
    """Validate a profile document; return the Profile field values in order."""
    if not isinstance(data, dict):
        raise _fail(source, "<top level>", f"must be a JSON object, got {type(data).__name__}")
    fmt = _get(data, "format", source)
    if fmt not in READABLE:
        raise _fail(source, "format", f"must be one of {READABLE}, got {fmt!r}; this Mesh reads only those")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise _fail(source, unknown[0], f"unknown field; the fields are {', '.join(_FIELDS)}")
    model = _string(data, "model", source)
    device = _string(data, "device", source)
    engine = _string(data, "engine", source)
    kind = _get(data, "device_kind", source)
    if kind not in DEVICE_KINDS:
        raise _fail(source, "device_kind", f"must be one of {DEVICE_KINDS}, got {kind!r}")
    kv = _positive_int(data, "kv_bytes_per_token", source)
    weights = _positive_int(data, "weight_bytes", source)
    max_context = _positive_int(data, "max_context", source)

    prefill = _object(data, "prefill", source)
    lengths = _axis(prefill, "prompt_lengths", source, "prefill.")
    prefill_s = _seconds(
        _get(prefill, "seconds", source, "prefill."), len(lengths), source,
        "prefill.seconds", "prefill.prompt_lengths",
    )

    decode = _object(data, "decode", source)
    batches = _axis(decode, "batch_sizes", source, "decode.")
    contexts = _axis(decode, "context_lengths", source, "decode.")
    rows = _as_list(_get(decode, "seconds", source, "decode."))
    if not isinstance(rows, list) or len(rows) != len(batches):
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise _fail(
            source, "decode.seconds",
            f"must be a list of {len(batches)} rows (one per batch size), got {got}",
        )
    decode_s = tuple(
        _seconds(row, len(contexts), source, f"decode.seconds[{b}]", "decode.context_lengths")
        for b, row in enumerate(rows)
    )

    prov = _object(data, "provenance", source)
    method = _get(prov, "method", source, "provenance.")
    if method not in METHODS:
        raise _fail(source, "provenance.method", f"must be one of {METHODS}, got {method!r}")
    _object(prov, "hardware", source, "provenance.")

    overheads: dict[str, float] = {}
    if data.get("overheads") is not None:
        if fmt == FORMAT_V1:
            raise _fail(source, "overheads", f"needs format {FORMAT!r} (format {FORMAT_V1!r} has no overheads)")
        raw = _object(data, "overheads", source)
        for key, value in raw.items():
            if key not in OVERHEADS:
                raise _fail(source, f"overheads.{key}", f"unknown overhead; the overheads are {', '.join(OVERHEADS)}")
            if not (_is_number(value) and math.isfinite(value) and value >= 0):
                raise _fail(source, f"overheads.{key}", f"must be a number of seconds >= 0, got {value!r}")
            overheads[key] = float(value)

    return (
        model, device, kind, engine, kv, weights, max_context,
        lengths, prefill_s, batches, contexts, decode_s, copy.deepcopy(prov), overheads,
    )


def profile_to_dict(p: Profile) -> dict:
    """The JSON document for `p`, fields in file order (format /1 when it has no overheads)."""
    doc = {
        "format": FORMAT if p.overheads else FORMAT_V1,
        "model": p.model,
        "device": p.device,
        "device_kind": p.device_kind,
        "engine": p.engine,
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "weight_bytes": p.weight_bytes,
        "max_context": p.max_context,
        "prefill": {"prompt_lengths": _as_list(p.prefill_lengths), "seconds": _as_list(p.prefill_s)},
        "decode": {
            "batch_sizes": _as_list(p.decode_batches),
            "context_lengths": _as_list(p.decode_contexts),
            "seconds": [_as_list(row) for row in p.decode_s]
            if isinstance(p.decode_s, (list, tuple)) else p.decode_s,
        },
        "provenance": copy.deepcopy(p.provenance),
    }
    if p.overheads:
        doc["overheads"] = dict(p.overheads)
    return doc


# A list of numbers that json.dumps(indent=2) spread over several lines; only the indenter
# puts raw newlines inside brackets, so string contents are never matched.
_NUMBER_LIST = re.compile(r"\[\n\s+([-+0-9.eE]+(?:,\n\s+[-+0-9.eE]+)*)\n\s*\]")


def dumps_profile(p: Profile) -> str:
    """Pretty JSON: two-space indent, each list of numbers on one line."""
    text = json.dumps(profile_to_dict(p), indent=2, allow_nan=False)
    return _NUMBER_LIST.sub(lambda m: "[" + re.sub(r",\n\s+", ", ", m.group(1)) + "]", text) + "\n"


def save_profile(p: Profile, path: str | Path) -> None:
    """Write `p` as pretty JSON; load_profile(path) gives back an equal Profile."""
    Path(path).write_text(dumps_profile(p), encoding="utf-8")


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"{source}: cannot read the profile file ({exc.strerror or exc})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(
            f"{source}: line {exc.lineno} column {exc.colno}: not valid JSON ({exc.msg}); fix the file or regenerate it"
        ) from exc
    return profile_from_dict(data, source=source)


def _reference_dir() -> Any:
    return resources.files(_REFERENCE_PACKAGE).joinpath(_REFERENCE_DIR)


def reference_profiles() -> list[tuple[str, str]]:
    """The (model, device) pairs with a packaged reference profile, sorted."""
    pairs = []
    for entry in _reference_dir().iterdir():
        name = entry.name
        if name.endswith(".json") and "__" in name:
            model, device = name[: -len(".json")].split("__", 1)
            pairs.append((model, device))
    return sorted(pairs)


def reference_profile(model: str, device: str) -> Profile:
    """The packaged profile mesh/perf/profiles/{model}__{device}.json."""
    entry = _reference_dir().joinpath(f"{model}__{device}.json")
    if not entry.is_file():
        valid = ", ".join(f"{m}/{d}" for m, d in reference_profiles()) or "none"
        raise ProfileError(
            f"mesh/perf/profiles/{model}__{device}.json: model/device: no reference profile for "
            f"model {model!r} on device {device!r}; available (model/device): {valid}"
        )
    with resources.as_file(entry) as path:
        return load_profile(path)


def catalog_profile(model: str, device: str, profile_dir: str | Path | None = None) -> Profile:
    """The catalog's profile of `model` on `device`: `profile_dir/<model>__<device>.json` if
    that file exists (a calibrated profile), else the packaged reference profile. The one
    lookup behind the replay's catalog (mesh.replay.driver.build_catalog) and emulated nodes
    (mesh.engines.emulation), so both time and size a model alike."""
    path = Path(profile_dir) / f"{model}__{device}.json" if profile_dir is not None else None
    if path is not None and path.exists():
        profile = load_profile(path)
        if profile.model != model:
            raise ProfileError(f"{path}: model: the file is for {profile.model!r}, expected {model!r}")
        return profile
    return reference_profile(model, device)


def catalog_models(device: str, profile_dir: str | Path | None = None) -> list[str]:
    """The models the catalog has a profile for on `device` (packaged or in `profile_dir`)."""
    names = {m for m, d in reference_profiles() if d == device}
    if profile_dir is not None and Path(profile_dir).is_dir():
        names |= {p.name[: -len(f"__{device}.json")] for p in Path(profile_dir).glob(f"*__{device}.json")}
    return sorted(names)


def device_kind(device: str, profile_dir: str | Path | None = None) -> str:
    """"cpu" or "gpu": the kind of node a profiled device is (any of its profiles says)."""
    models = catalog_models(device, profile_dir)
    if not models:
        devices = sorted({d for _m, d in reference_profiles()})
        raise ProfileError(f"no profile for device {device!r}; profiled devices: {', '.join(devices)}")
    return catalog_profile(models[0], device, profile_dir).device_kind
