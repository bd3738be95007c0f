"""The GPU roofline held against real GPUs (issue 35): the h200 and h100 entries are the fit of
the committed probes, predict every probe point within 10%, and the A100 takes their mean."""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from mesh.engines.emulation import emulated_cold_start
from mesh.perf.gpu_reference import (
    PROBE_DIR,
    PROBE_MODEL,
    PROBES,
    ProbeError,
    comparison_table,
    fit_device,
    fit_probe,
    load_probe,
    predicted_s,
    read_probe,
)
from mesh.perf.load_times import ColdStart
from mesh.perf.model import PerformanceModel
from mesh.perf.profile import reference_profile
from mesh.perf.roofline import ARCHITECTURES, FITTED_GPUS, HARDWARE, VLLM_STEP_OVERHEAD_S, decode_seconds

DOCS = Path(__file__).resolve().parents[1] / "docs" / "roofline.md"
FIELDS = ("eff_gemm", "eff_attn", "eff_bw", "eff_kv", "device_overhead_s", "host_to_device_bytes_per_s",
          "host_to_device_pageable_bytes_per_s")


@pytest.mark.parametrize("device", FITTED_GPUS)
def test_refitting_the_committed_probe_gives_the_committed_entry(device: str) -> None:
    """The entry carries the fit to 3 significant digits: each committed number is within
    half a unit of its third digit of the refit (and a hair more, for another BLAS)."""
    hw = HARDWARE[device]
    fit = asdict(fit_probe(load_probe(device), hw.peak_flop_per_s, hw.peak_bytes_per_s))
    for name in FIELDS:
        committed = getattr(hw, name)
        half_unit = 0.5 * 10 ** (math.floor(math.log10(abs(committed))) - 2)
        assert abs(fit[name] - committed) <= 1.01 * half_unit, (name, fit[name], committed)
    assert asdict(fit_device(device)) == pytest.approx({f: getattr(hw, f) for f in FIELDS}, rel=2e-3)
    assert hw.engine_overhead_s == VLLM_STEP_OVERHEAD_S


@pytest.mark.parametrize("device", FITTED_GPUS)
def test_the_entry_predicts_every_probe_point_within_10_percent(device: str) -> None:
    arch, hw, probe = ARCHITECTURES[PROBE_MODEL], HARDWARE[device], load_probe(device)
    kinds = {p.kind for p in probe.points}
    assert kinds == {"decode", "prefill"} and len(probe.points) >= (12 if device == "h200" else 10)
    for p in probe.points:
        assert predicted_s(arch, hw, p) == pytest.approx(p.seconds, rel=0.10), p


def test_the_probe_reads_every_default_backend_point_of_the_h200_json() -> None:
    raw = json.loads((PROBE_DIR / PROBES["h200"]).read_text())
    decodes = [d for d in raw["decode"] if "sdpa_backend" not in d]
    probe = load_probe("h200")
    assert [(p.batch, p.tokens) for p in probe.points if p.kind == "decode"] == [(d["B"],
                                                                                  d["context"]) for d in decodes]
    assert [p.tokens for p in probe.points if p.kind == "prefill"] == [p["L"] for p in raw["prefill"]]
    pinned_s = raw["h2d"]["pinned_whole_s"] + raw["h2d"]["pinned_chunked_s"]
    assert probe.pinned_bytes_per_s == pytest.approx(13.5e9 / min(pinned_s))


def test_the_a100_takes_the_mean_of_the_two_fits_and_its_own_peaks() -> None:
    a100 = HARDWARE["a100-80gb"]
    for name in ("eff_gemm", "eff_attn", "eff_bw", "eff_kv", "device_overhead_s"):
        mean = sum(getattr(HARDWARE[d], name) for d in FITTED_GPUS) / len(FITTED_GPUS)
        assert getattr(a100, name) == float(f"{mean:.3g}"), name
    assert (a100.peak_flop_per_s, a100.peak_bytes_per_s) == (312e12, 2039e9)
    assert a100.engine_overhead_s == VLLM_STEP_OVERHEAD_S
    assert a100.host_to_device_bytes_per_s == ColdStart().pcie_bytes_per_s  # PCIe 4.0 x16, assumed


def test_a_profile_step_is_the_gpu_side_plus_vllms_step() -> None:
    arch, hw = ARCHITECTURES["llama-2-7b"], HARDWARE["h200"]
    model = PerformanceModel(reference_profile("llama-2-7b", "h200"))
    gpu_side = decode_seconds(arch, hw, 16, 512, engine=False)
    assert model.decode_s(16, 512) == pytest.approx(gpu_side + VLLM_STEP_OVERHEAD_S, rel=1e-5)
    # the H200 is faster than the A100 at every grid point of the 7B decode
    a100 = reference_profile("llama-2-7b", "a100-80gb")
    h200 = reference_profile("llama-2-7b", "h200")
    assert all(h < a for hr, ar in zip(h200.decode_s, a100.decode_s) for h, a in zip(hr, ar))


def test_a_tiny_or_incomplete_probe_is_refused_with_its_name() -> None:
    raw = json.loads((PROBE_DIR / PROBES["h100"]).read_text())
    with pytest.raises(ProbeError, match="tiny.json.*not the llama-2-7b shape"):
        read_probe({**raw, "tiny": True}, "tiny.json")
    with pytest.raises(ProbeError, match="partial.json: no 'h2d'"):
        read_probe({k: v for k, v in raw.items() if k != "h2d"}, "partial.json")
    with pytest.raises(ProbeError, match="no committed probe for 'a100-80gb'"):
        load_probe("a100-80gb")


def test_gpu_cold_starts_copy_at_the_devices_pinned_bandwidth() -> None:
    weights = reference_profile("llama-2-7b", "h200").weight_bytes
    h200 = emulated_cold_start(["xeon-6462c", "h200"])
    assert h200.load_s(weights, "gpu") == pytest.approx(weights / 55.3e9)  # 0.244 s, as the probe's 13.5 GB copy
    assert load_probe("h200").pinned_bytes_per_s == pytest.approx(55.3e9, rel=1e-3)
    assert emulated_cold_start(["a100-80gb"]).pcie_bytes_per_s == 25e9
    assert emulated_cold_start(["h200", "a100-80gb"]).pcie_bytes_per_s == 25e9  # the slowest GPU's


def test_docs_tables_are_current() -> None:
    text = DOCS.read_text()
    for device in FITTED_GPUS:
        assert comparison_table(device) in text, device
    for name in ("device_overhead_s", "engine_overhead_s"):
        row = re.search(rf"\| `{name}` \|(.*)\|", text)
        assert row is not None, name
        for hw in HARDWARE.values():
            assert f"{getattr(hw, name) * 1e3:g} ms" in row.group(1), (name, hw.device)


# --- the probe, brought into the project (mesh calibrate --gpu-reference) -------------------

ROOT = Path(__file__).resolve().parents[1]


def _torch_python() -> str | None:
    """An interpreter with PyTorch (the vLLM environment's, where set up), else None."""
    import os
    import subprocess

    for python in (os.environ.get("MESH_VLLM_PYTHON"), str(ROOT / ".venv-vllm" / "bin" / "python")):
        if python and Path(python).exists():
            if subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0:
                return python
    return None


def test_gpu_reference_without_pytorch_says_what_it_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mesh.commands.calibrate import gpu_reference

    missing = tmp_path / "no-python"
    assert gpu_reference(str(tmp_path / "out.json"), str(missing)) == 2
    err = capsys.readouterr().err
    assert "needs PyTorch" in err and "--python" in err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_gpu_reference_refuses_a_machine_without_a_gpu_and_its_tiny_run_writes_the_probes_format(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real probe in an interpreter with PyTorch (CPU build here): refused without a GPU;
    --quick runs its tiny configuration on the CPU into a JSON of the committed probes' format,
    which the fit refuses as not the 7B shape."""
    from mesh.commands.calibrate import gpu_reference

    python = _torch_python()
    if python is None:
        pytest.skip("no interpreter with PyTorch (.venv-vllm, $MESH_VLLM_PYTHON)")
    out = tmp_path / "probe.json"
    import subprocess

    if subprocess.run([python, "-c", "import torch, sys; sys.exit(torch.cuda.is_available())"]).returncode == 0:
        assert gpu_reference(str(out), python) == 2
        assert "no CUDA GPU" in capsys.readouterr().err and not out.exists()
    assert gpu_reference(str(out), python, tiny=True) == 0
    tiny = json.loads(out.read_text())
    committed = json.loads((PROBE_DIR / PROBES["h100"]).read_text())
    assert tiny["tiny"] is True and tiny["errors"] == []
    for section in ("config", "info", "h2d", "micro", "model", "prefill", "decode"):
        assert section in tiny, section
    assert set(tiny["decode"][0]) >= {"B", "context", "kv_bytes", "graph"}
    assert set(tiny["prefill"][0]) >= {"L", "median_s"} and set(tiny["config"]) == set(committed["config"])
    with pytest.raises(ProbeError, match="not the llama-2-7b shape"):
        read_probe(tiny, str(out))
