"""Hugging Face model folders written locally, for vLLM without downloads.

Two kinds, both with the same byte-level tokenizer built here (no tokenizer library, no
hub):
- `write_tiny_llama(out)`: a 2-layer Llama (hidden 128, 4 heads of 32, 2 KV heads) with
  random but fixed weights saved as safetensors (float32, seed 0). It loads in a second
  and decodes in milliseconds on a CPU: the engine tests run on it. Its text is noise,
  but greedy output is deterministic, which is what the tests compare.
- `write_shape_folder(name, out)`: a real model's config.json (mesh/modelfiles/shapes/NAME.json:
  llama-3.2-3b, llama-2-7b, llama-2-13b) with the tokenizer and no weights, for vLLM's
  `load_format="dummy"` (random weights of the real shape): calibration of real shapes.

The tokenizer: byte-level BPE without merges (one token per UTF-8 byte, ids 0-255 are
the bytes, GPT-2's byte-to-unicode alphabet), the special tokens <|endoftext|> (eos),
<|im_start|> and <|im_end|>, a ChatML chat template, and filler entries up to the model's
vocabulary size so every id the model can sample decodes to something. Only JSON and
numpy are needed, so the folders can be written from any Python (the test fixtures run in
Mesh's environment, which need not have vLLM, torch or transformers).

    python -m mesh.modelfiles.local tiny OUT_DIR
    python -m mesh.modelfiles.local shape llama-2-7b OUT_DIR
"""
from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any

from mesh.perf.roofline import llama_params

SHAPES_DIR = Path(__file__).with_name("shapes")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # the smallest head size vLLM's CPU attention supports
    "max_position_embeddings": 4096,
    "vocab_size": 264,  # 256 bytes + 3 special tokens + 5 fillers
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 256,
    "torch_dtype": "float32",
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_files(vocab_size: int) -> dict[str, dict[str, Any]]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json as dicts."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small for 256 bytes and {len(SPECIAL_TOKENS)} special tokens")
    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    for i in range(256 + len(SPECIAL_TOKENS), vocab_size):  # fillers: never produced by encode
        vocab[f"<r{i}>"] = i
    added = [{"id": 256 + i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, tok in enumerate(SPECIAL_TOKENS)]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
    }
    special = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config, "special_tokens_map.json": special}


def write_tokenizer(out: Path, vocab_size: int) -> None:
    for name, content in tokenizer_files(vocab_size).items():
        (out / name).write_text(json.dumps(content, ensure_ascii=False, indent=1) + "\n")


def llama_weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Llama checkpoint (HF naming)."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * hd, h),
            p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h),
            p + "self_attn.o_proj.weight": (h, heads * hd),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def llama_parameter_count(cfg: dict[str, Any]) -> int:
    """The parameters of a Llama checkpoint's config (mesh.perf.roofline.llama_params)."""
    heads = cfg["num_attention_heads"]
    return llama_params(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], heads,
                        cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads,
                        cfg["vocab_size"], cfg.get("tie_word_embeddings", False))


def write_safetensors(path: Path, tensors: dict[str, Any]) -> None:
    """Save float32 numpy arrays in the safetensors format (header JSON + raw little-endian data)."""
    import numpy as np

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def write_tiny_llama(out: str | Path, seed: int = 0) -> Path:
    """Write the tiny Llama (config, tokenizer, float32 safetensors weights) into `out`."""
    import numpy as np

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_LLAMA_CONFIG)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in llama_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shape, dtype=np.float32)
        else:  # std 0.1: large enough that greedy output varies from token to token
            tensors[name] = rng.normal(0.0, 0.1, size=shape).astype(np.float32)
    write_safetensors(out / "model.safetensors", tensors)
    write_tokenizer(out, cfg["vocab_size"])
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")  # last: marks the folder complete
    return out


def shape_names() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def shape_config(name: str) -> dict[str, Any]:
    path = SHAPES_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(shape_names())}")
    return json.loads(path.read_text())


def write_shape_folder(name: str, out: str | Path) -> Path:
    """Write config.json of shape `name` and the byte-level tokenizer, no weights (dummy load)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = shape_config(name)
    write_tokenizer(out, cfg["vocab_size"])
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mesh.modelfiles.local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    tiny = sub.add_parser("tiny", help="the tiny random Llama with weights")
    tiny.add_argument("out")
    tiny.add_argument("--seed", type=int, default=0)
    shape = sub.add_parser("shape", help="a real shape's config and tokenizer, no weights")
    shape.add_argument("name", choices=shape_names())
    shape.add_argument("out")
    args = parser.parse_args(argv)
    path = write_tiny_llama(args.out, args.seed) if args.what == "tiny" else write_shape_folder(args.name, args.out)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
