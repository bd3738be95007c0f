"""mesh.hardware: cpuinfo parsing with and without AMX, and the `mesh info` command."""
from __future__ import annotations

import json

from mesh import hardware
from mesh.cli import main

SAPPHIRE_RAPIDS = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Gold 6462C
flags\t\t: fpu vme sse sse2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
bogomips\t: 6600.00

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Gold 6462C
flags\t\t: fpu vme sse sse2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""

EPYC = """\
processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_bf16 avx512_vnni

processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_bf16 avx512_vnni
"""


def test_parse_cpuinfo_with_amx() -> None:
    cpu = hardware.parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert cpu.model_name == "Intel(R) Xeon(R) Gold 6462C"
    assert cpu.cores == 2
    assert cpu.amx
    assert cpu.matrix_extensions[:3] == ["amx_tile", "amx_bf16", "amx_int8"]
    assert "avx512_bf16" in cpu.matrix_extensions and "sse2" not in cpu.matrix_extensions


def test_parse_cpuinfo_without_amx() -> None:
    cpu = hardware.parse_cpuinfo(EPYC)
    assert (cpu.model_name, cpu.cores, cpu.amx) == ("AMD EPYC", 2, False)
    assert cpu.matrix_extensions == ["avx512_bf16", "avx512_vnni", "avx512bw", "avx512f", "avx2", "fma", "f16c"]


def test_parse_empty_cpuinfo_falls_back() -> None:
    cpu = hardware.parse_cpuinfo("")
    assert cpu.model_name == "unknown" and cpu.cores >= 1 and not cpu.amx


def test_report_keys_and_vllm_detection_without_import(monkeypatch) -> None:
    import sys

    report = hardware.hardware_report(hardware.parse_cpuinfo(EPYC))
    assert set(report) >= {"cpu", "cores", "amx", "matrix_extensions", "openvino", "vllm"}
    assert report["cpu"] == "AMD EPYC" and report["amx"] is False
    assert set(report["openvino"]) >= {"version", "optimization_capabilities", "inference_precision"}
    assert set(report["vllm"]) >= {"installed", "version", "device"}
    assert "vllm" not in sys.modules  # detected through find_spec/metadata only
    monkeypatch.setattr(hardware.importlib.util, "find_spec", lambda name: None)
    assert hardware.vllm_info() == hardware.VllmInfo(installed=False)


def test_openvino_reports_cpu_precisions() -> None:
    info = hardware.openvino_info()
    assert info.error is None and info.version
    assert "FP32" in info.optimization_capabilities
    assert info.inference_precision in ("bf16", "f16", "f32")


def test_mesh_info_json(capsys) -> None:
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert isinstance(report["cores"], int) and isinstance(report["amx"], bool)
    assert main(["info"]) == 0
    assert "AMX" in capsys.readouterr().out
