"""Calibrating the OpenVINO CPU engine: the CalibrationTarget for mesh.calibration.runner.

The engine is an `OpenVINOEngine` in vLLM mode, built with `ignore_eos=True` so every
request produces exactly max_tokens and decode batches keep their size. Prompts are real
text (a fixed English passage, tokenized by the model's own tokenizer, tiled to any
length); each request starts at a different offset so no two prompts are equal.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
from pathlib import Path
from typing import Any

from mesh.engines.openvino_engine import OpenVINOEngine

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
    "father had taught him. At the top he trimmed the wick, polished the great lens and wrote "
    "the weather in a leather book: wind from the north-west, a falling glass, fishing boats "
    "returning early to the harbour. Ships depended on the light through the long winter "
    "nights, when fog rolled in from the sea and the rocks below the cliff disappeared. In "
    "spring the island filled with nesting birds, and scientists arrived with notebooks, "
    "cameras and questions about migration, temperature and the number of eggs in each nest. "
    "The keeper answered patiently, made tea in a dented kettle, and told them about storms "
    "that had torn slates from the roof and flooded the cellar where he kept the oil. Years "
    "later, when the light was automated and the keeper moved to the mainland, he still woke "
    "at dusk and looked toward the sea, half expecting to see the beam sweep across the water. "
)


class TokenPrompts:
    """Prompts of any length cut from the passage's token ids (tiled), at varying offsets."""

    def __init__(self, corpus: list[int]) -> None:
        if not corpus:
            raise ValueError("the passage tokenized to nothing")
        self.corpus = corpus

    @classmethod
    def for_engine(cls, engine: OpenVINOEngine) -> "TokenPrompts":
        return cls(engine.encode_prompt(PASSAGE * 4))

    def ids(self, length: int, variant: int) -> list[int]:
        corpus = self.corpus
        start = (variant * 97) % len(corpus)
        out: list[int] = []
        while len(out) < length:
            out.extend(corpus[start:])
            start = 0
        return out[:length]


def cpu_slug(model_name: str, cores: int) -> str:
    """'Intel(R) Xeon(R) Gold 6462C' with 32 cores -> 'intel-xeon-gold-6462c-32c'."""
    name = re.sub(r"\((R|TM|tm|r)\)", "", model_name)
    name = re.sub(r"\b(CPU|Processor|[0-9]+-Core)\b", "", name)
    name = name.split("@")[0]
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cpu"
    return f"{slug}-{cores}c"


def model_slug(path: str | Path) -> str:
    p = Path(path)
    stem = p.stem if p.is_file() else p.name
    return re.sub(r"[^a-z0-9.]+", "-", stem.lower()).strip("-.") or "model"


def cores_used() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


class OpenVINOTarget:
    """An OpenVINOEngine to calibrate, its prompts and its provenance."""

    engine_name = "openvino"
    device_kind = "cpu"

    def __init__(self, model_path: str | Path, *, context_window: int, max_batch: int,
                 model_name: str | None = None, properties: dict[str, Any] | None = None) -> None:
        from mesh.hardware import read_cpuinfo

        self.engine = OpenVINOEngine(model_path, model_name=model_name, context_window=context_window,
                                     max_num_seqs=max_batch, ignore_eos=True, properties=properties)
        self.model_path = Path(model_path)
        self.model_name = model_name or model_slug(model_path)
        self.cpu = read_cpuinfo()
        self.cores = cores_used()
        self.device = cpu_slug(self.cpu.model_name, self.cores)
        self._prompts: TokenPrompts | None = None

    def prompt_ids(self, length: int, variant: int) -> list[int]:
        if self._prompts is None:
            self._prompts = TokenPrompts.for_engine(self.engine)
        return self._prompts.ids(length, variant)

    def _weights_file(self) -> Path:
        src = self.engine.source
        return src.path if src.kind == "gguf" else src.path / "openvino_model.bin"

    def identity(self) -> dict[str, Any]:
        weights = self._weights_file()
        e = self.engine
        return {
            "engine": self.engine_name,
            "model": str(self.model_path.resolve()),
            "model_bytes": weights.stat().st_size,
            "model_mtime_ns": weights.stat().st_mtime_ns,
            "context_window": e.context_window,
            "prefill_token_budget": e.prefill_token_budget,
            "max_num_seqs": e.max_num_seqs,
            "properties": {k: str(v) for k, v in sorted(e.properties.items())},
            "device": self.device,
            "openvino_genai": _version("openvino-genai"),
        }

    def provenance(self) -> dict[str, Any]:
        from mesh.hardware import openvino_info

        ov = openvino_info()
        weights = self._weights_file()
        e = self.engine
        return {
            "hardware": {
                "cpu": self.cpu.model_name,
                "logical_cpus": self.cpu.cores,
                "cores_used": self.cores,
                "amx": self.cpu.amx,
                "matrix_extensions": self.cpu.matrix_extensions,
                "flags": sorted(self.cpu.flags),
                "openvino_capabilities": ov.optimization_capabilities,
                "inference_precision": ov.inference_precision,
                "kv_cache_precision": ov.kv_cache_precision,
                "machine": platform.machine(),
            },
            "engine": {
                "name": self.engine_name,
                "openvino": _version("openvino"),
                "openvino_genai": _version("openvino-genai"),
                "openvino_tokenizers": _version("openvino-tokenizers"),
                "device": e.device,
                "dynamic_split_fuse": False,
                "context_window": e.context_window,
                "prefill_token_budget": e.prefill_token_budget,
                "max_num_seqs": e.max_num_seqs,
                "kv_cache": f"{e.key_precision} keys, {e.value_precision} values, {e.block_size}-token blocks",
                "properties": {k: str(v) for k, v in sorted(e.properties.items())},
                "ignore_eos": True,
            },
            "model": {
                "file": weights.name,
                "kind": e.source.kind,
                "bytes": weights.stat().st_size,
                "sha256": file_sha256(weights),
                "layers": e.source.shape.layers,
                "kv_heads": e.source.shape.kv_heads,
                "head_dim": e.source.shape.head_dim,
            },
            "software": {
                "python": platform.python_version(),
                "numpy": _version("numpy"),
                "scipy": _version("scipy"),
                "mesh": _version("mesh-serving"),
                "os": f"{platform.system()} {platform.release()}",
            },
        }
