"""The GPU roofline factors fitted to a real GPU's probe (docs/roofline.md, "GPU reference").

A probe (`mesh/calibration/gpu_probe.py`, `mesh calibrate --gpu-reference`) times a
Llama-2-7B-shaped decoder in PyTorch (bf16, random weights, CUDA graphs, PyTorch's SDPA) and
the host-to-GPU copies a cold start makes, and writes one JSON. The committed probes are in
`mesh/perf/gpu_reference/` (measured on a lent H200 and H100; ../shared/data/README.md).

`fit_probe` turns one probe into the GPU-side factors of a `mesh.perf.roofline.Hardware`:

- `eff_bw` (weights streamed at this fraction of peak bandwidth) from the probe's GEMM
  micro-benchmark, the [B,4096]x[4096,11008] bf16 matmul replayed in a CUDA graph at B <= 16,
  where it only streams its weight (mean of those points). With a single model shape the
  weights' time and a fixed per-step overhead are nearly interchangeable in the decode
  points, so the bandwidth is taken from where it is measured alone.
- `eff_gemm`, `eff_attn`, `eff_kv` and `device_overhead_s` by least squares
  (scipy.optimize.least_squares) on the log of predicted over measured time of every
  decode step (CUDA graph, the default SDPA backend; the variants the probe runs with a
  forced backend are left out) and every prefill (CUDA graph).
- `host_to_device_bytes_per_s`: the best pinned copy of 13.5 GB (whole tensor, and in
  512 MiB chunks), `host_to_device_pageable_bytes_per_s` the best pageable one.

The probe is not vLLM (no fused elementwise ops, no paged attention), so the fit is the
GPU's side of a step only; `mesh.perf.roofline` adds the engine's own per-step time
(`engine_overhead_s`) on top. `python -m mesh.perf.gpu_reference` prints the fits and the
measured-against-predicted tables of docs/roofline.md.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.optimize import least_squares

from mesh.perf.roofline import ARCHITECTURES, HARDWARE, Architecture, Hardware, decode_seconds, prefill_seconds

PROBE_DIR = Path(__file__).parent / "gpu_reference"
PROBES: dict[str, str] = {"h200": "gpu-h200-probe.json", "h100": "gpu-h100-probe.json"}
PROBE_MODEL = "llama-2-7b"  # the probe's decoder has this shape (its "config" is checked)
BANDWIDTH_GEMM_MAX_BATCH = 16  # GEMM micro-benchmark points that only stream their weight
FIT_DIGITS = 3  # the committed entries carry the fit to 3 significant digits


class ProbeError(ValueError):
    """A probe JSON lacks what the fit needs; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class ProbePoint:
    """One measured step: a decode of `batch` requests at `context`, or a prefill (batch 0)."""

    kind: str  # "decode" | "prefill"
    batch: int
    tokens: int  # decode: context length; prefill: prompt length
    seconds: float


@dataclass(frozen=True, slots=True)
class Probe:
    """What the fit reads from one probe JSON."""

    source: str
    gpu: str  # nvidia-smi's name
    points: tuple[ProbePoint, ...]
    gemm_weight_bytes_per_s: tuple[float, ...]  # small-batch GEMM points
    pinned_bytes_per_s: float
    pageable_bytes_per_s: float
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class GpuFit:
    """The GPU-side roofline factors fitted to one probe."""

    eff_gemm: float
    eff_attn: float
    eff_bw: float
    eff_kv: float
    device_overhead_s: float
    host_to_device_bytes_per_s: float
    host_to_device_pageable_bytes_per_s: float

    def rounded(self, digits: int = FIT_DIGITS) -> GpuFit:
        return GpuFit(*(float(f"{v:.{digits}g}") for v in (
            self.eff_gemm, self.eff_attn, self.eff_bw, self.eff_kv, self.device_overhead_s,
            self.host_to_device_bytes_per_s, self.host_to_device_pageable_bytes_per_s)))


def _get(data: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in data:
        raise ProbeError(f"{source}: no {key!r}; a probe from mesh/calibration/gpu_probe.py has it")
    return data[key]


def read_probe(data: Mapping[str, Any], source: str = "<probe>") -> Probe:
    """The points of a probe JSON (as mesh/calibration/gpu_probe.py writes it)."""
    config = _get(data, "config", source)
    arch = ARCHITECTURES[PROBE_MODEL]
    want = {"layers": arch.layers, "hidden": arch.hidden, "inter": arch.intermediate, "heads": arch.heads,
            "kv_heads": arch.kv_heads, "vocab": arch.vocab}
    if data.get("tiny") or any(config.get(k) != v for k, v in want.items()):
        raise ProbeError(f"{source}: config {config} is not the {PROBE_MODEL} shape the fit needs (a --tiny probe?)")
    points = []
    for d in _get(data, "decode", source):
        if "graph" in d and "sdpa_backend" not in d and "sdpa_restricted" not in d:
            points.append(ProbePoint("decode", int(d["B"]), int(d["context"]), float(d["graph"]["median_s"])))
    for p in _get(data, "prefill", source):
        if "graph" in p:
            points.append(ProbePoint("prefill", 1, int(p["L"]), float(p["graph"]["median_s"])))
    gemm = _get(_get(data, "micro", source), "gemm", source)
    bw = tuple(float(g["weight_GBps"]) * 1e9 for g in gemm if g["B"] <= BANDWIDTH_GEMM_MAX_BATCH)
    h2d = _get(data, "h2d", source)
    pinned = max(float(h2d.get("pinned_chunked_best_GBps", 0)), float(h2d.get("pinned_whole_best_GBps", 0)))
    pageable = max(float(h2d.get("pageable_whole_best_GBps", 0)), float(h2d.get("pageable_chunked_best_GBps", 0)))
    if not points or not bw or not pinned > 0 or not pageable > 0:
        raise ProbeError(f"{source}: needs decode and prefill graph times, GEMM points at B <= "
                         f"{BANDWIDTH_GEMM_MAX_BATCH} and pinned and pageable copies")
    info = _get(data, "info", source)
    name = str(info.get("nvidia_smi", "")).splitlines()[-1].split(",")[0].strip()
    memory = int(info.get("torch_props", {}).get("total_memory", 0))
    return Probe(source, name, tuple(points), bw, pinned * 1e9, pageable * 1e9, memory)


def load_probe(device: str) -> Probe:
    """The committed probe of `device` (a key of PROBES)."""
    if device not in PROBES:
        raise ProbeError(f"no committed probe for {device!r}; probes: {', '.join(sorted(PROBES))}")
    path = PROBE_DIR / PROBES[device]
    return read_probe(json.loads(path.read_text()), str(path))


def predicted_s(arch: Architecture, hw: Hardware, point: ProbePoint, engine: bool = False) -> float:
    """The roofline's time of one probe point on `hw` (GPU side only unless `engine`)."""
    if point.kind == "decode":
        return decode_seconds(arch, hw, point.batch, point.tokens, engine=engine)
    return prefill_seconds(arch, hw, point.tokens, engine=engine)


def fit_probe(probe: Probe, peak_flop_per_s: float, peak_bytes_per_s: float) -> GpuFit:
    """The GPU-side factors that best predict `probe` on a device with these datasheet peaks."""
    arch = ARCHITECTURES[PROBE_MODEL]
    eff_bw = float(np.mean(probe.gemm_weight_bytes_per_s)) / peak_bytes_per_s
    base = Hardware(device="fit", kind="gpu", description="", engine="", peak_flop_per_s=peak_flop_per_s,
                    peak_bytes_per_s=peak_bytes_per_s, eff_gemm=0.5, eff_attn=0.5, eff_bw=eff_bw, eff_kv=0.8,
                    device_overhead_s=0.0, engine_overhead_s=0.0, peak_note="")

    def residuals(x: np.ndarray) -> list[float]:
        hw = replace(base, eff_gemm=x[0], eff_attn=x[1], eff_kv=x[2], device_overhead_s=x[3])
        return [math.log(predicted_s(arch, hw, p) / p.seconds) for p in probe.points]

    fit = least_squares(residuals, x0=[0.6, 0.4, 0.8, 0.001], bounds=([0.05, 0.01, 0.05, 0.0], [1.0, 1.0, 1.0, 0.02]))
    if not fit.success:
        raise ProbeError(f"{probe.source}: the fit did not converge: {fit.message}")
    g, a, kv, ovh = (float(v) for v in fit.x)
    return GpuFit(g, a, eff_bw, kv, ovh, probe.pinned_bytes_per_s, probe.pageable_bytes_per_s)


def fit_device(device: str) -> GpuFit:
    """The fit of `device`'s committed probe on its HARDWARE entry's datasheet peaks, rounded
    as the entry carries it."""
    hw = HARDWARE[device]
    return fit_probe(load_probe(device), hw.peak_flop_per_s, hw.peak_bytes_per_s).rounded()


def comparison_table(device: str) -> str:
    """Measured against predicted (GPU side, the committed entry) for every fitted point."""
    arch, hw, probe = ARCHITECTURES[PROBE_MODEL], HARDWARE[device], load_probe(device)
    lines = [f"| {device} point | measured ms | predicted ms | predicted / measured |", "|---|---|---|---|"]
    for p in probe.points:
        what = f"decode B={p.batch}, ctx {p.tokens}" if p.kind == "decode" else f"prefill {p.tokens} tokens"
        pred = predicted_s(arch, hw, p)
        lines.append(f"| {what} | {p.seconds * 1e3:.2f} | {pred * 1e3:.2f} | {pred / p.seconds:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mesh.perf.gpu_reference",
                                     description="Fit the GPU roofline factors to the committed probes.")
    parser.add_argument("--table", action="store_true", help="print docs/roofline.md's measured-vs-predicted tables")
    args = parser.parse_args(argv)
    for device in PROBES:
        if args.table:
            print(comparison_table(device))
            continue
        fit = fit_device(device)
        print(f"{device} ({load_probe(device).gpu}): eff_gemm={fit.eff_gemm:g} eff_attn={fit.eff_attn:g} "
              f"eff_bw={fit.eff_bw:g} eff_kv={fit.eff_kv:g} device_overhead_s={fit.device_overhead_s:g} "
              f"host_to_device={fit.host_to_device_bytes_per_s / 1e9:.3g} GB/s pinned, "
              f"{fit.host_to_device_pageable_bytes_per_s / 1e9:.3g} GB/s pageable")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
