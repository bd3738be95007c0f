"""Read the metadata of a GGUF file (llama.cpp's model format) without third-party packages.

Only the header and the key-value section are read; tensors are never touched. Arrays
(the vocabulary, merges) are skipped unless asked for, because the engine needs only the
model shape (layers, KV heads, head size, context length) and the chat template.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"

# GGUF value type ids -> struct format of the scalar types.
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands."""


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFError("GGUF file ends early (truncated download?)")
    return data


def _unpack(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    return _read(f, _unpack(f, "<Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, vtype: int, keep_arrays: bool) -> Any:
    if vtype in _SCALARS:
        return _unpack(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        item_type, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if not keep_arrays and item_type in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item_type]), 1)  # skip in one seek
            return ArrayInfo(item_type, count)
        if not keep_arrays and item_type == _STRING:
            _skip_strings(f, count)
            return ArrayInfo(item_type, count)
        items = [_value(f, item_type, keep_arrays) for _ in range(count)]
        return items if keep_arrays else ArrayInfo(item_type, count)
    raise GGUFError(f"unknown GGUF value type {vtype}")


_U64 = struct.Struct("<Q")
_CHUNK = 1 << 20


def _skip_strings(f: BinaryIO, count: int) -> None:
    """Skip `count` strings (a vocabulary, its merges) without decoding them: their lengths
    are read from 1 MiB reads. Decoding the demo model's 196k strings one read at a time took
    0.5-0.9 s, holding the GIL (a registration's, a description's event loop stalled)."""
    buf, pos = b"", 0
    for _ in range(count):
        if pos + 8 > len(buf):
            if pos > len(buf):  # the last string ran past what was read
                f.seek(pos - len(buf), 1)
                buf, pos = b"", 0
            buf = buf[pos:] + f.read(_CHUNK)
            pos = 0
            if len(buf) < 8:
                raise GGUFError("GGUF file ends early (truncated download?)")
        pos += 8 + _U64.unpack_from(buf, pos)[0]
    f.seek(pos - len(buf), 1)  # to just past the last string


class ArrayInfo(tuple):
    """Stands in for a skipped array: (item type, length)."""

    def __new__(cls, item_type: int, count: int) -> "ArrayInfo":
        return super().__new__(cls, (item_type, count))

    @property
    def count(self) -> int:
        return self[1]


def read_gguf_metadata(path: str | Path, keep_arrays: bool = False) -> dict[str, Any]:
    """Return the key-value metadata of a GGUF file (arrays as ArrayInfo unless keep_arrays)."""
    with open(path, "rb") as f:
        return _metadata(f, path, keep_arrays)[0]


def _metadata(f: BinaryIO, path: str | Path, keep_arrays: bool) -> tuple[dict[str, Any], int]:
    """The metadata and the tensor count; `f` is left at the tensor index."""
    if f.read(4) != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (bad magic)")
    version = _unpack(f, "<I")
    if version < 2:
        raise GGUFError(f"{path}: GGUF version {version} is too old (need 2 or later)")
    n_tensors = _unpack(f, "<Q")
    n_kv = _unpack(f, "<Q")
    meta: dict[str, Any] = {"GGUF.version": version}
    for _ in range(n_kv):
        key = _string(f)
        meta[key] = _value(f, _unpack(f, "<I"), keep_arrays)
    return meta, n_tensors


def tokenizer_digest(path: str | Path) -> str:
    """A digest of the file's tokenizer: its `tokenizer.*` keys and their values' bytes (the
    vocabulary, merges, special tokens, chat template). Models of one family (copies, or
    fine-tunes of one base) share it, so a node builds their tokenizer once."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (bad magic)")
        f.seek(4 + 8, 1)  # the version (u32) and the tensor count (u64)
        for _ in range(_unpack(f, "<Q")):
            key = _string(f)
            vtype = _unpack(f, "<I")
            start = f.tell()
            _value(f, vtype, False)
            if key.startswith("tokenizer."):
                end = f.tell()
                f.seek(start)
                digest.update(f"{key}\0{vtype}\0".encode() + _read(f, end - start))
    return digest.hexdigest()


def read_tensor_names(path: str | Path) -> list[str]:
    """The names of a GGUF file's tensors, from its tensor index (no tensor data is read)."""
    with open(path, "rb") as f:
        _meta, n_tensors = _metadata(f, path, False)
        names = []
        for _ in range(n_tensors):
            names.append(_string(f))
            n_dims = _unpack(f, "<I")
            f.seek(8 * n_dims + 4 + 8, 1)  # dims (u64 each), type (u32), offset (u64)
        return names
