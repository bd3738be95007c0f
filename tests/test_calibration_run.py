"""Calibration runs (mesh.calibration.runner, mesh calibrate): grids, profile, held-out MAPE,
resuming after an interruption, the vLLM error; fast tests on a fake engine, slow ones on
the real OpenVINO engine with the demo model."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

from mesh.calibration.runner import (
    CalibrationError,
    Grid,
    Point,
    Settings,
    calibrate,
    powers_of_two,
    state_path_for,
)
from mesh.cli import main
from mesh.engines.engine_api import EngineRequest, FinishReason, StepResult
from mesh.perf import PerformanceModel, load_profile
from mesh.policy.batching import IterationKind

TINY = Settings(max_prompt=32, max_batch=2, max_context=32, reps=2, warmup=1)


# ---- a fake engine: iteration times from a formula (busy-waits, so perf_counter sees them) --

def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class FakeEngine:
    model_name = "fake"
    kv_bytes_per_token = 100
    weight_bytes = 10_000
    context_window = 256
    prefill_token_budget = 256
    max_batch = 8

    def __init__(self) -> None:
        self.pending: dict[str, list[int]] = {}
        self.running: dict[str, list[int]] = {}  # id -> [max_tokens, produced]
        self.loaded = False
        self.loads = self.prefills = self.decodes = 0

    async def load(self) -> None:
        self.loaded = True
        self.loads += 1

    async def unload(self) -> None:
        self.loaded = False

    async def resize_kv(self, capacity_bytes: int) -> None:
        pass

    def add_request(self, request: EngineRequest) -> None:
        assert self.loaded and len(request.prompt_token_ids) == request.prompt_len
        self.pending[request.request_id] = [request.prompt_len, request.sampling.max_tokens]

    async def step(self) -> StepResult:
        finished = {}
        if self.pending:
            self.prefills += 1
            batch, tokens = [], 0
            for rid, (prompt, _) in self.pending.items():
                if batch and tokens + prompt > self.prefill_token_budget:
                    break
                batch.append(rid)
                tokens += prompt
            _busy(0.001 + 2e-5 * tokens)
            for rid in batch:
                _, max_tokens = self.pending.pop(rid)
                if max_tokens == 1:
                    finished[rid] = FinishReason.LENGTH
                else:
                    self.running[rid] = [max_tokens, 1]
            return StepResult(IterationKind.PREFILL, batch, finished=finished)
        self.decodes += 1
        _busy(0.001 + 2e-4 * len(self.running))
        served = list(self.running)
        for rid in served:
            entry = self.running[rid]
            entry[1] += 1
            if entry[1] == entry[0]:
                finished[rid] = FinishReason.LENGTH
                del self.running[rid]
        return StepResult(IterationKind.DECODE, served, finished=finished)

    def abort(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.pending or self.running)

    def kv_bytes_in_use(self) -> int:
        return 0


class FakeTarget:
    engine_name = "fake"
    model_name = "fake-model"
    device = "test-cpu-2c"
    device_kind = "cpu"

    def __init__(self, knob: int = 1) -> None:
        self.engine = FakeEngine()
        self.knob = knob

    def prompt_ids(self, length: int, variant: int) -> list[int]:
        return [(variant + i) % 50 for i in range(length)]

    def identity(self) -> dict:
        return {"engine": "fake", "knob": self.knob}

    def provenance(self) -> dict:
        return {"hardware": {"cpu": "test"}, "engine": {"name": "fake"}}


# ---- fast tests -----------------------------------------------------------------------------

def test_grids_are_powers_of_two_with_held_out_points_between() -> None:
    assert powers_of_two(16, 100) == [16, 32, 64]
    grid = Grid.for_settings(Settings(max_prompt=512, max_batch=8, max_context=256, reps=3, warmup=1))
    assert grid.prefill_lengths == (16, 32, 64, 128, 256, 512)
    assert grid.decode_batches == (1, 2, 4, 8)
    assert grid.decode_contexts == (16, 32, 64, 128, 256)
    held = grid.heldout
    assert [p.length for p in held if p.kind == "prefill"] == [24, 48, 96, 192, 384]
    decode = {(p.batch, p.length) for p in held if p.kind == "decode"}
    assert {b for b, _ in decode} == {1, 3, 6} and {c for _, c in decode} == {24, 48, 96, 192}
    # every held-out point lies off the grid on at least one axis
    assert all(p.length not in grid.decode_contexts or p.batch not in grid.decode_batches for p in held)


def test_settings_are_checked() -> None:
    with pytest.raises(CalibrationError, match="max batch"):
        Settings(max_prompt=64, max_batch=1, max_context=64)
    with pytest.raises(CalibrationError, match="max prompt must be at least 32"):
        Settings(max_prompt=16, max_batch=2, max_context=64)
    with pytest.raises(CalibrationError, match="too many decode steps"):
        Settings(max_prompt=64, max_batch=2, max_context=64, reps=30, warmup=5)
    s = Settings(max_prompt=64, max_batch=2, max_context=64, reps=3, warmup=1)
    # the median timed step (warm-up 1, then 3 timed) runs at the grid context
    assert s.prompt_for_context(64) == 61 and s.centre_context(64) == 64


def test_fake_calibration_writes_a_valid_profile_with_mape(tmp_path: Path) -> None:
    out = tmp_path / "fake.json"
    target = FakeTarget()
    report = calibrate(target, TINY, out, progress=False, command="test")
    profile = load_profile(out)
    assert profile.prefill_lengths == (16, 32) and profile.decode_batches == (1, 2)
    assert profile.decode_contexts == (16, 32) and profile.engine == "fake"
    assert profile.max_context == 256 and profile.kv_bytes_per_token == 100
    prov = profile.provenance
    assert prov["method"] == "measured" and prov["hardware"] == {"cpu": "test"}
    cal = prov["calibration"]
    assert cal["settings"]["reps"] == 2 and cal["date"].endswith("Z") and cal["created_by"] == "test"
    assert cal["sessions"][0]["load_average_start"] and cal["interference"]["rule"]
    held = prov["heldout"]
    assert held["points"] and math.isfinite(held["mape_pct"]) and held["mape_pct"] >= 0
    assert report.heldout == held and report.measured_now == len(Grid.for_settings(TINY).points())
    assert PerformanceModel(profile).decode_s(2, 16) == pytest.approx(profile.decode_s[1][0])
    assert not state_path_for(out).exists() and target.engine.loaded is False


def test_interrupted_calibration_resumes_where_it_stopped(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    seen: list[str] = []

    def interrupt_after_three(point: Point, result: dict) -> None:
        seen.append(point.key)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calibrate(FakeTarget(), TINY, out, progress=False, on_point=interrupt_after_three)
    state = json.loads(state_path_for(out).read_text())
    assert sorted(k.split("#")[0] for k in state["points"]) == sorted(seen) and not out.exists()

    again: list[str] = []
    target = FakeTarget()
    report = calibrate(target, TINY, out, progress=False, on_point=lambda p, r: again.append(p.key))
    total = len(Grid.for_settings(TINY).points())
    assert report.resumed == 3 and report.measured_now == total - 3
    assert not set(again) & set(seen) and len(again) == total - 3
    assert len(load_profile(out).provenance["calibration"]["sessions"]) == 2


def test_state_from_other_settings_is_refused_unless_restarted(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    with pytest.raises(KeyboardInterrupt):
        calibrate(FakeTarget(knob=1), TINY, out, progress=False,
                  on_point=lambda p, r: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(CalibrationError, match="different settings .*knob"):
        calibrate(FakeTarget(knob=2), TINY, out, progress=False)
    report = calibrate(FakeTarget(knob=2), TINY, out, progress=False, restart=True)
    assert report.resumed == 0


def test_passes_pool_samples_in_alternating_order(tmp_path: Path) -> None:
    order: list[str] = []
    settings = Settings(max_prompt=32, max_batch=2, max_context=32, reps=1, warmup=0, passes=2)
    calibrate(FakeTarget(), settings, tmp_path / "p.json", progress=False, on_point=lambda p, r: order.append(p.key))
    n = len(order) // 2
    assert order[n:] == order[:n][::-1]
    prov = load_profile(tmp_path / "p.json").provenance
    assert prov["heldout"]["points"]
    assert prov["calibration"]["pass_to_pass"]["points"] == len(Grid.for_settings(settings).points())


def test_vllm_engine_not_built_is_a_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "mesh.engines.vllm_engine", None)  # as if the module did not exist
    monkeypatch.delitem(sys.modules, "mesh.calibration.vllm_calibration", raising=False)  # imported afresh
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    code = main(["calibrate", "--engine", "vllm", "--model", str(model), "--quick", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "vLLM engine is not built yet" in err and "--engine openvino" in err
    assert "Traceback" not in err and not (tmp_path / "p.json").exists()


def test_unknown_model_path_is_a_clear_error(tmp_path: Path, capsys) -> None:
    code = main(["calibrate", "--model", str(tmp_path / "missing.gguf"), "--quick"])
    assert code == 2 and "does not exist" in capsys.readouterr().err


# ---- slow tests on the real engine ------------------------------------------------------------

@pytest.mark.slow
def test_quick_calibration_of_the_demo_model(demo_gguf: Path, tmp_path: Path, capsys) -> None:
    """The CI grid, end to end through the CLI (about 40-60 s on 2 cores)."""
    out = tmp_path / "quick.json"
    code = main(["calibrate", "--engine", "openvino", "--model", str(demo_gguf), "--quick", "--out", str(out),
                 "--name", "smollm2-135m", "--no-progress", "--max-wait", "0"])
    printed = capsys.readouterr().out
    assert code == 0 and "held-out points: MAPE" in printed and str(out) in printed
    profile = load_profile(out)
    assert profile.engine == "openvino" and profile.device_kind == "cpu" and profile.model == "smollm2-135m"
    assert profile.prefill_lengths == (16, 32, 64, 128, 256, 512)
    assert profile.decode_batches == (1, 2, 4, 8) and profile.decode_contexts[-1] == 512
    assert profile.kv_bytes_per_token == 13680 and profile.max_context == 1024
    prov = profile.provenance
    hw = prov["hardware"]
    assert hw["cpu"] and hw["cores_used"] >= 1 and isinstance(hw["amx"], bool)
    assert isinstance(hw["matrix_extensions"], list) and hw["inference_precision"]
    engine = prov["engine"]
    assert engine["openvino"] and engine["openvino_genai"] and engine["openvino_tokenizers"]
    assert engine["dynamic_split_fuse"] is False
    assert prov["model"]["sha256"] and prov["software"]["python"]
    cal = prov["calibration"]
    assert cal["settings"] == {"max_prompt": 512, "max_batch": 8, "max_context": 512, "reps": 3, "warmup": 1,
                               "passes": 1}
    assert cal["seconds"] > 0 and cal["date"]
    held = prov["heldout"]
    assert math.isfinite(held["mape_pct"]) and held["prefill_mape_pct"] is not None
    assert len(held["points"]) == 5 + 3 * 5
    # times grow with the prompt: prefilling 512 tokens costs more than 16
    assert profile.prefill_s[-1] > 3 * profile.prefill_s[0]


@pytest.mark.slow
def test_interrupted_cli_calibration_resumes(demo_gguf: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """Interrupt `mesh calibrate` after 2 points, run it again: only the rest is measured."""
    import mesh.calibration.runner as runner

    out = tmp_path / "tiny.json"
    args = ["calibrate", "--model", str(demo_gguf), "--out", str(out), "--max-prompt", "32", "--max-batch", "2",
            "--max-context", "32", "--reps", "1", "--warmup", "0", "--passes", "1", "--no-progress", "--max-wait", "0"]
    real_measure = runner._Measurer.measure
    calls = {"n": 0}

    async def measure_then_interrupt(self, point):
        if calls["n"] == 2:
            raise KeyboardInterrupt
        calls["n"] += 1
        return await real_measure(self, point)

    monkeypatch.setattr(runner._Measurer, "measure", measure_then_interrupt)
    assert main(args) == 130
    assert "Run the same command again to resume" in capsys.readouterr().err
    assert len(json.loads(state_path_for(out).read_text())["points"]) == 2
    monkeypatch.setattr(runner._Measurer, "measure", real_measure)
    assert main(args) == 0
    printed = capsys.readouterr().out
    total = len(Grid.for_settings(Settings(32, 2, 32, reps=1, warmup=0)).points())
    assert f"({total - 2} measured now, 2 resumed)" in printed
    assert load_profile(out).provenance["calibration"]["points"] == total
    assert not state_path_for(out).exists()


def test_vllm_calibration_without_vllm_is_a_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    import mesh.calibration.vllm_calibration

    def vllm_target(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")

    monkeypatch.setattr(mesh.calibration.vllm_calibration, "VLLMTarget", vllm_target)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert main(["calibrate", "--engine", "vllm", "--model", str(model), "--quick"]) == 2
    err = capsys.readouterr().err
    assert "needs the vllm package, which is not installed" in err and "Traceback" not in err


def test_measured_overheads_are_medians_of_the_extras_never_below_zero():
    from mesh.calibration.runner import measured_overheads

    results = [{"after_prefill_extra_s": 0.004, "batch_change_extra_s": None},
               {"after_prefill_extra_s": 0.006, "batch_change_extra_s": -0.001},
               {"after_prefill_extra_s": 0.005, "batch_change_extra_s": -0.002},
               {"new_shape_extra_s": 0.01}, {"new_shape_extra_s": None}]
    assert measured_overheads(results) == {"decode_after_prefill_s": 0.005, "decode_batch_change_s": 0.0,
                                           "prefill_new_shape_s": 0.01}
    assert measured_overheads([]) == {}
