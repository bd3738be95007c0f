"""The shape of a decoder-only model as far as KV memory is concerned (its KV bytes per token:
mesh.perf.roofline.kv_bytes_per_token).

Read from GGUF metadata (`<arch>.block_count`, `<arch>.attention.head_count_kv`, ...) or an
HF-style `config.json` (which optimum-intel copies into OpenVINO IR folders).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.modelfiles.gguf import read_gguf_metadata

if TYPE_CHECKING:
    from mesh.perf.roofline import Architecture


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    context_length: int  # the window the model was trained for
    architecture: str = ""
    chat_template: str | None = None


def shape_from_gguf(path: str | Path) -> ModelShape:
    meta = read_gguf_metadata(path)
    arch = str(meta.get("general.architecture", "llama"))

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks '{arch}.{key}'")
        return value

    heads = int(get("attention.head_count"))
    head_dim = meta.get(f"{arch}.attention.key_length") or int(get("embedding_length")) // heads
    return ModelShape(
        layers=int(get("block_count")),
        attention_heads=heads,
        kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        context_length=int(get("context_length")),
        architecture=arch,
        chat_template=meta.get("tokenizer.chat_template"),
    )


def shape_from_config(config_json: str | Path) -> ModelShape:
    cfg = json.loads(Path(config_json).read_text())
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model
    heads = int(cfg["num_attention_heads"])
    return ModelShape(
        layers=int(cfg["num_hidden_layers"]),
        attention_heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        context_length=int(cfg.get("max_position_embeddings") or 2048),
        architecture=str(cfg.get("model_type", "")),
    )


def architecture_of(path: str | Path, name: str = "") -> Architecture:
    """The roofline's Llama-style architecture of the model at `path` (a GGUF file, or a folder
    with a config.json): what an emulated node needs to emulate a real model from its shape
    (mesh.engines.emulation; the mixed rig of `mesh serve --cpu-nodes N --emulate DEVICE:M`).
    ValueError says what the file lacks."""
    from mesh.perf.roofline import Architecture

    p = Path(path)
    if p.is_dir():
        cfg = json.loads((p / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        shape = shape_from_config(p / "config.json")
        try:
            hidden, intermediate, vocab = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"{p / 'config.json'} lacks {exc.args[0]}") from None
        tied = bool(cfg.get("tie_word_embeddings", False))
    else:
        meta = read_gguf_metadata(p)
        arch = str(meta.get("general.architecture", "llama"))
        shape = shape_from_gguf(p)
        hidden = int(meta.get(f"{arch}.embedding_length") or shape.attention_heads * shape.head_dim)
        intermediate = meta.get(f"{arch}.feed_forward_length")
        tokens = meta.get("tokenizer.ggml.tokens")  # a skipped array: (type, count)
        vocab = meta.get(f"{arch}.vocab_size") or (tokens[1] if isinstance(tokens, tuple) else None)
        if intermediate is None or vocab is None:
            raise ValueError(f"{p}: GGUF metadata lacks {arch}.feed_forward_length or the vocabulary size")
        intermediate, vocab = int(intermediate), int(vocab)
        tied = "output.weight" not in _tensor_names(p)
    return Architecture(name or p.stem, shape.layers, hidden, intermediate, shape.attention_heads, shape.kv_heads,
                        vocab, min(shape.context_length, 8192), tied_embeddings=tied)


def _tensor_names(path: Path) -> set[str]:
    """The names of a GGUF file's tensors (its tensor index, after the metadata)."""
    from mesh.modelfiles.gguf import read_tensor_names

    return set(read_tensor_names(path))


def layers_and_hidden(model: str, default_layers: int = 32, default_hidden: int = 4096) -> tuple[int, int]:
    """(decoder layers, hidden size) of a catalog model ("base" or "base/function") from its
    config in mesh/modelfiles/shapes, else the defaults (Llama-2-7B's)."""
    path = Path(__file__).with_name("shapes") / f"{model.split('/')[0]}.json"
    if not path.is_file():
        return default_layers, default_hidden
    cfg = json.loads(path.read_text())
    return int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])

