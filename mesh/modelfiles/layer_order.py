"""A Hugging Face Llama-family model as one safetensors file laid out in layer order.

Blocks travel in file order (mesh.weights.blocks), so a receiver can run the layers it has
only if the file holds them in the order they run (BlitzScale 5.2, lambdaScale 4.3): the
header (with config.json in its metadata), the token embedding, decoder layer 0, layer 1,
..., the final norm, the LM head (absent for tied embeddings: the last range then uses the
embedding, which arrives first). The safetensors library sorts tensors by dtype and name
when it saves ("layers.10" before "layers.2"), so the file is written here: an 8-byte
little-endian header length, the JSON header (padded with spaces to 8 bytes), the tensors'
bytes back to back in the order above. Any safetensors reader reads it; the bytes of each
tensor are copied as they are (no dtype change, no torch needed).

`write_layer_ordered` writes one and returns its layout; `read_layout` parses the layout
from the first bytes of such a file (block 0 holds the header), which is all a receiver
needs to know which bytes hold which layer (`LayerLayout.spans`, `.boundaries()` for
blocks.pack/cut).
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from mesh.policy.layer_prefix import LayerSpans

MARK = "mesh.layer_order"  # metadata key: the file is layer-ordered (value: format version)
CONFIG_KEY = "mesh.config"  # metadata key: the model's config.json
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_COPY_CHUNK = 8 << 20


class LayerFileError(ValueError):
    """A model folder or file is not what a layer-ordered file needs; says what to do."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the file: dtype as safetensors names it (BF16, F32, ...), shape, and
    its bytes [start, end) as absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class LayerLayout:
    """What the header of a layer-ordered file says: the config, every tensor, and where
    each part (embedding, layer i, head) ends."""

    config: dict
    tensors: dict[str, TensorEntry]
    spans: LayerSpans
    data_start: int

    def layer_tensors(self, layer: int) -> list[TensorEntry]:
        prefix = f"model.layers.{layer}."
        return [t for t in self.tensors.values() if t.name.startswith(prefix)]

    def boundaries(self) -> list[int]:
        return self.spans.boundaries()


def _read_header(path: Path) -> tuple[dict, int]:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise LayerFileError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise LayerFileError(f"{path} is not a safetensors file (header length {n})")
        return json.loads(f.read(n)), 8 + n


def _hf_tensors(folder: Path) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
    """name -> (file, dtype, shape, absolute start, absolute end) over a folder's safetensors files."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LayerFileError(f"{folder} holds no *.safetensors file; convert the model to a Hugging Face folder "
                             "first (python -m mesh.modelfiles.convert gguf-to-hf MODEL.gguf OUT_DIR)")
    out: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
    for path in files:
        header, base = _read_header(path)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            out[name] = (path, str(info["dtype"]), tuple(int(d) for d in info["shape"]), base + begin, base + end)
    return out


def _order(names: list[str], num_layers: int) -> list[str]:
    """Tensor names in layer order; refuses a folder that is not a Llama-family layout."""
    layers: dict[int, list[str]] = {i: [] for i in range(num_layers)}
    rest = []
    for name in names:
        m = _LAYER.match(name)
        if m:
            i = int(m.group(1))
            if i not in layers:
                raise LayerFileError(f"tensor {name} names layer {i}, but config.json says {num_layers} layers")
            layers[i].append(name)
        elif name not in (EMBED, FINAL_NORM, LM_HEAD):
            rest.append(name)
    if EMBED not in names or FINAL_NORM not in names:
        raise LayerFileError(f"the folder lacks {EMBED} or {FINAL_NORM}: not a Llama-family checkpoint")
    empty = [i for i, ts in layers.items() if not ts]
    if empty:
        raise LayerFileError(f"the folder has no tensors for layer {empty[0]} of {num_layers}")
    ordered = [EMBED]
    for i in range(num_layers):
        ordered += sorted(layers[i])
    ordered.append(FINAL_NORM)
    if LM_HEAD in names:
        ordered.append(LM_HEAD)
    return ordered + sorted(rest)


def write_layer_ordered(folder: str | os.PathLike, out: str | os.PathLike) -> LayerLayout:
    """Write the model of a Hugging Face folder (config.json, *.safetensors) as one
    layer-ordered safetensors file at `out` (written beside it, then renamed); return its layout."""
    src = Path(folder)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise LayerFileError(f"{src} has no config.json; give a Hugging Face model folder")
    config = json.loads(config_path.read_text())
    num_layers = int(config.get("num_hidden_layers", 0))
    if num_layers < 1:
        raise LayerFileError(f"{config_path} gives no num_hidden_layers; is it a decoder-only model?")
    tensors = _hf_tensors(src)
    order = _order(list(tensors), num_layers)
    header: dict = {"__metadata__": {"format": "pt", MARK: "1", CONFIG_KEY: json.dumps(config, sort_keys=True)}}
    offset = 0
    for name in order:
        _, dtype, shape, start, end = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + end - start]}
        offset += end - start
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    dst = Path(out)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.part")
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            handles: dict[Path, object] = {}
            try:
                for name in order:
                    path, _, _, start, end = tensors[name]
                    h = handles.get(path) or handles.setdefault(path, path.open("rb"))
                    h.seek(start)  # type: ignore[attr-defined]
                    left = end - start
                    while left:
                        chunk = h.read(min(left, _COPY_CHUNK))  # type: ignore[attr-defined]
                        if not chunk:
                            raise LayerFileError(f"{path} ends inside tensor {name}; the file is truncated")
                        f.write(chunk)
                        left -= len(chunk)
            finally:
                for h in handles.values():
                    h.close()  # type: ignore[attr-defined]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    with dst.open("rb") as f:
        return read_layout(f.read(8 + len(raw)))


def header_length(prefix: bytes) -> int:
    """Bytes the header takes (8 + its JSON), from the file's first 8 bytes."""
    if len(prefix) < 8:
        raise LayerFileError("need the file's first 8 bytes to know its header length")
    return 8 + struct.unpack("<Q", prefix[:8])[0]


def read_layout(prefix: bytes) -> LayerLayout:
    """The layout of a layer-ordered file from its first bytes (at least its header)."""
    need = header_length(prefix)
    if len(prefix) < need:
        raise LayerFileError(f"the header takes {need} B, only {len(prefix)} B are in; wait for block 0")
    header: Mapping = json.loads(prefix[8:need])
    meta = header.get("__metadata__") or {}
    if MARK not in meta or CONFIG_KEY not in meta:
        raise LayerFileError("the file is not layer-ordered (no mesh.layer_order metadata); write it with "
                             "mesh.modelfiles.layer_order.write_layer_ordered")
    config = json.loads(meta[CONFIG_KEY])
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        tensors[name] = TensorEntry(name, str(info["dtype"]), tuple(int(d) for d in info["shape"]),
                                    need + begin, need + end)
    num_layers = int(config["num_hidden_layers"])
    layer_ends = []
    for i in range(num_layers):
        prefix_name = f"model.layers.{i}."
        layer_ends.append(max(t.end for t in tensors.values() if t.name.startswith(prefix_name)))
    total = max(t.end for t in tensors.values())
    return LayerLayout(config, tensors, LayerSpans(tensors[EMBED].end, tuple(layer_ends), total), need)
