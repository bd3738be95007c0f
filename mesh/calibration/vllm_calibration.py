"""Calibrating the vLLM engine: the CalibrationTarget for mesh.calibration.runner.

`mesh calibrate --engine vllm --model M` measures a `VLLMEngine` (worker process, phased
scheduler: the same engine the node agents run) with `ignore_eos=True`, so every request
produces exactly max_tokens and decode batches keep their size. M is one of:

- a Hugging Face folder (config.json, tokenizer, weights; a folder without weights runs
  with random weights, `load_format="dummy"`);
- a shape name from mesh/modelfiles/shapes (llama-3.2-3b, llama-2-7b, llama-2-13b): the real
  model's config with the local byte-level tokenizer and dummy weights, written into the
  data folder on first use (no download). Timing does not depend on weight values;
- `tiny-llama`: the 2-layer test model (mesh.modelfiles.local), for quick checks.

The KV cache is sized for the grid: the largest batch at the whole context window (plus
vLLM's null block), so decode points never preempt. Prompts are real text (the passage
of the OpenVINO calibration) through the model's tokenizer, tiled to any length.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from mesh.calibration.openvino_calibration import (
    PASSAGE,
    TokenPrompts,
    _version,
    cores_used,
    cpu_slug,
    file_sha256,
    model_slug,
)
from mesh.engines.vllm_engine import VLLMEngine, default_device, weight_files

TINY = "tiny-llama"


def resolve_model_arg(model: str | Path) -> tuple[Path, str]:
    """(HF folder, default profile model name) for a path, a shape name or `tiny-llama`."""
    from mesh.modelfiles.local import shape_names, write_shape_folder, write_tiny_llama
    from mesh.paths import data_dir

    text = str(model)
    if Path(text).expanduser().exists():
        p = Path(text).expanduser()
        return p, model_slug(p.parent if p.name == "config.json" else p)
    if text in shape_names():
        folder = data_dir() / "models" / "shapes" / text
        if not (folder / "config.json").exists():
            write_shape_folder(text, folder)
        return folder, text
    if text == TINY:
        folder = data_dir() / "models" / "tiny-llama-seed0"
        if not (folder / "config.json").exists():
            write_tiny_llama(folder, seed=0)
        return folder, TINY
    return Path(text), model_slug(text)  # VLLMEngine says what is wrong with it


def gpu_name() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    line = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""
    return line or None


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3, 81559 MiB' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.split(",")[0].lower()).strip("-") or "gpu"


class VLLMTarget:
    """A VLLMEngine to calibrate, its prompts and its provenance."""

    engine_name = "vllm"

    def __init__(self, model: str | Path, *, context_window: int, max_batch: int, model_name: str | None = None,
                 device: str | None = None, kv_capacity_bytes: int | None = None, **engine_options: Any) -> None:
        from mesh.hardware import read_cpuinfo

        folder, default_name = resolve_model_arg(model)
        device = device or default_device()
        probe = VLLMEngine(folder, context_window=context_window, max_num_seqs=max_batch, device=device,
                           **engine_options)
        if kv_capacity_bytes is None:  # the largest batch at the whole window, never preempted
            blocks = max_batch * math.ceil(context_window / probe.block_size) + 1
            kv_capacity_bytes = blocks * probe.block_size * probe.kv_bytes_per_token
        self.engine = VLLMEngine(folder, model_name=model_name or default_name, context_window=context_window,
                                 max_num_seqs=max_batch, device=device, ignore_eos=True,
                                 kv_capacity_bytes=kv_capacity_bytes, **engine_options)
        self.model_path = folder
        self.model_name = model_name or default_name
        self.device_kind = "gpu" if self.engine.device == "cuda" else "cpu"
        self.cpu = read_cpuinfo()
        self.cores = cores_used()
        self.gpu = gpu_name() if self.device_kind == "gpu" else None
        self.device = gpu_slug(self.gpu) if self.gpu else cpu_slug(self.cpu.model_name, self.cores)
        self._prompts: TokenPrompts | None = None  # built on first use (needs the tokenizer)

    def own_pids(self) -> list[int]:
        """The worker process computes the iterations: its CPU time is the calibration's own."""
        pid = self.engine.worker_pid
        return [pid] if pid is not None and pid != os.getpid() else []

    def prompt_ids(self, length: int, variant: int) -> list[int]:
        if self._prompts is None:
            self._prompts = TokenPrompts(self.engine.encode_prompt(PASSAGE * 4))
        return self._prompts.ids(length, variant)

    def _weights(self) -> dict[str, Any]:
        files = weight_files(self.model_path) if self.engine.load_format != "dummy" else []
        config = (self.model_path / "config.json").read_bytes()
        return {"load_format": self.engine.load_format,
                "files": [f.name for f in files],
                "bytes": sum(f.stat().st_size for f in files),
                "mtime_ns": max((f.stat().st_mtime_ns for f in files), default=0),
                "config_sha256": hashlib.sha256(config).hexdigest()}

    def identity(self) -> dict[str, Any]:
        from mesh.hardware import vllm_info

        e = self.engine
        return {
            "engine": self.engine_name,
            "model": str(self.model_path.resolve()),
            "weights": self._weights(),
            "context_window": e.context_window,
            "prefill_token_budget": e.prefill_token_budget,
            "max_num_seqs": e.max_num_seqs,
            "dtype": e.dtype,
            "kv_capacity_bytes": e.kv_capacity_bytes,
            "device": self.device,
            "vllm": vllm_info(other_pythons=True).version,
        }

    def provenance(self) -> dict[str, Any]:
        from mesh.hardware import vllm_info

        e = self.engine
        info = vllm_info(other_pythons=True)
        weights = self._weights()
        if weights["files"]:
            weights["sha256"] = {f: file_sha256(self.model_path / f) for f in weights["files"]}
        config = json.loads((self.model_path / "config.json").read_text())
        config = config.get("text_config", config)
        return {
            "hardware": {
                "cpu": self.cpu.model_name,
                "logical_cpus": self.cpu.cores,
                "cores_used": self.cores,
                "matrix_extensions": self.cpu.matrix_extensions,
                "gpu": self.gpu,
                "machine": platform.machine(),
            },
            "engine": {
                "name": self.engine_name,
                "vllm": info.version,
                "vllm_build": info.device,
                "python": info.python,
                "device": e.device,
                "dtype": e.dtype,
                "kv_cache_dtype": "auto (the model dtype)",
                "block_size": e.block_size,
                "kv_capacity_bytes": e.kv_capacity_bytes,
                "context_window": e.context_window,
                "prefill_token_budget": e.prefill_token_budget,
                "max_num_seqs": e.max_num_seqs,
                "chunked_prefill": False,
                "scheduler": "mesh.engines.vllm_scheduler.PhasedScheduler (prefill-only or decode-only steps)",
                "enforce_eager": e.settings.enforce_eager,
                "process": "one worker process per instance, engine core in-process; timings include the "
                           "socket round trip the node agent sees",
                "ignore_eos": True,
                "facts": {k: v for k, v in e.facts.items() if k != "vllm_version"},
            },
            "model": {
                "folder": self.model_path.name,
                "architecture": config.get("model_type"),
                "layers": config.get("num_hidden_layers"),
                "hidden_size": config.get("hidden_size"),
                "kv_heads": config.get("num_key_value_heads"),
                "vocab_size": config.get("vocab_size"),
                **weights,
            },
            "software": {
                "python": platform.python_version(),
                "mesh": _version("mesh-serving"),
                "os": f"{platform.system()} {platform.release()}",
            },
        }
