"""LoRA adapters in PEFT's format: a folder with `adapter_config.json` and
`adapter_model.safetensors` whose keys are `base_model.model.model.layers.N.<block>.<module>.lora_A.weight`
and `...lora_B.weight` (A: rank x in, B: out x rank).

What is here: the base's linear shapes (from its Hugging Face `config.json`, which an OpenVINO IR
exported by optimum keeps), the check of an adapter against them (`read_adapter`), and the
writer (`write_adapter`) that the OpenVINO engine uses for its zero "slot" adapter and the tests
for their own adapters. Only safetensors and numpy: no torch, no peft.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers."
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION + MLP
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be used on its base; the message says what is wrong."""


@dataclass(frozen=True)
class BaseLinears:
    """The base model's projection shapes an adapter may target: module -> (out, in), per layer."""

    layers: int
    shapes: Mapping[str, tuple[int, int]]

    @classmethod
    def of_config(cls, config: Mapping[str, Any]) -> BaseLinears:
        """From a Llama-style Hugging Face config (Llama, Mistral, Qwen2, SmolLM: q/k/v/o, gate/up/down)."""
        try:
            hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
            heads = int(config["num_attention_heads"])
            kv = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            inter = int(config["intermediate_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterError(f"the base's config.json lacks a Llama-style shape ({exc})") from exc
        q, k = heads * head_dim, kv * head_dim
        return cls(layers, {"q_proj": (q, hidden), "k_proj": (k, hidden), "v_proj": (k, hidden),
                            "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                            "down_proj": (hidden, inter)})

    @classmethod
    def of_folder(cls, folder: str | Path) -> BaseLinears:
        """From the `config.json` of a base model's folder (Hugging Face, or an IR optimum exported)."""
        path = Path(folder) / "config.json"
        try:
            return cls.of_config(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise AdapterError(f"the base has no readable config.json ({path.name}: {exc})") from exc


@dataclass(frozen=True)
class AdapterFacts:
    """A checked adapter: its weights file, rank, PEFT scale (lora_alpha / r) and targeted modules."""

    weights: Path
    rank: int
    scale: float
    modules: tuple[str, ...]
    nbytes: int


def read_adapter(folder: str | Path, base: BaseLinears) -> AdapterFacts:
    """Check a PEFT LoRA folder against its base: the config's kind and options, every key's
    name and every matrix's shape. Raises AdapterError naming the file and what is wrong."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"an adapter is a PEFT folder ({CONFIG} and {WEIGHTS}); {folder.name} is not a folder")
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise AdapterError(f"the adapter folder has no {name} (PEFT's format: {CONFIG} and {WEIGHTS})")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG} is not a JSON object")
    rank, scale = _check_config(config)
    try:
        with safe_open(str(folder / WEIGHTS), framework="numpy") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{WEIGHTS} is not a safetensors file: {exc}") from exc
    modules = _check_tensors(shapes, rank, base)
    return AdapterFacts(folder / WEIGHTS, rank, scale, modules, (folder / WEIGHTS).stat().st_size)


def _check_config(config: Mapping[str, Any]) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{CONFIG}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    for option in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(option):
            raise AdapterError(f"{CONFIG}: {option} is not supported (plain LoRA: one r and lora_alpha)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG}: bias {config['bias']!r} is not supported (only 'none')")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{CONFIG}: r must be a positive integer, got {r!r}")
    if alpha is None:
        alpha = r  # PEFT's default lora_alpha is 8 with r 8: a scale of 1
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise AdapterError(f"{CONFIG}: lora_alpha must be a positive number, got {alpha!r}")
    scale = alpha / (r ** 0.5) if config.get("use_rslora") else alpha / r
    return r, float(scale)


def _check_tensors(shapes: Mapping[str, tuple[int, ...]], rank: int, base: BaseLinears) -> tuple[str, ...]:
    if not shapes:
        raise AdapterError(f"{WEIGHTS} holds no tensors")
    seen: dict[tuple[int, str], set[str]] = {}
    for key, shape in shapes.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{WEIGHTS}: {key!r} is not a PEFT LoRA key "
                               f"(expected {PREFIX}N.self_attn|mlp.<module>.lora_A|lora_B.weight)")
        layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in base.shapes or block != ("mlp" if module in MLP else "self_attn"):
            raise AdapterError(f"{WEIGHTS}: {key!r} targets {block}.{module}, which the base does not have "
                               f"(it has {', '.join(MODULES)})")
        if layer >= base.layers:
            raise AdapterError(f"{WEIGHTS}: {key!r} targets layer {layer}; the base has {base.layers} layers")
        out, inp = base.shapes[module]
        want = (rank, inp) if ab == "A" else (out, rank)
        if tuple(shape) != want:
            raise AdapterError(f"{WEIGHTS}: {key!r} has shape {list(shape)}; the base and r={rank} need {list(want)}")
        seen.setdefault((layer, module), set()).add(ab)
    for (layer, module), halves in seen.items():
        if halves != {"A", "B"}:
            raise AdapterError(f"{WEIGHTS}: layer {layer}'s {module} has lora_{''.join(halves)} without its pair")
    return tuple(m for m in MODULES if any(mod == m for _, mod in seen))


def adapter_tensors(base: BaseLinears, *, rank: int = 8, modules: Iterable[str] = ("q_proj", "v_proj"),
                    seed: int | None = None, std: float = 0.2) -> dict[str, Any]:
    """A LoRA adapter's matrices under PEFT's keys (float32 numpy arrays): A random (seeded), B
    zero when seed is None (an adapter that changes nothing: B @ A = 0), else B random too, both
    N(0, std)."""
    import numpy as np

    rng = np.random.default_rng(0 if seed is None else seed)
    tensors = {}
    for layer in range(base.layers):
        for module in modules:
            out, inp = base.shapes[module]
            key = f"{PREFIX}{layer}.{'mlp' if module in MLP else 'self_attn'}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, inp)) * std).astype(np.float32)
            b = np.zeros((out, rank)) if seed is None else rng.standard_normal((out, rank)) * std
            tensors[f"{key}.lora_B.weight"] = b.astype(np.float32)
    return tensors


def write_adapter(folder: str | Path, base: BaseLinears, *, rank: int = 8, alpha: float = 16.0,
                  modules: Iterable[str] = ("q_proj", "v_proj"), seed: int | None = None,
                  std: float = 0.2) -> Path:
    """Write a PEFT LoRA folder for `base` (`adapter_tensors`, and its config). Returns the folder."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    modules = tuple(modules)
    save_file(adapter_tensors(base, rank=rank, modules=modules, seed=seed, std=std), str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                             "target_modules": list(modules), "bias": "none"}))
    return folder
