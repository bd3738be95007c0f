"""A model packed into contiguous blocks, and its manifest (sizes, offsets, sha256).

A block is a contiguous byte range of the model file. With `boundaries` (offsets where
layers start, e.g. from a GGUF tensor table) a block ends on a layer boundary so it holds
whole layers (the unit of live scaling, BlitzScale 5.2 / lambdaScale 4.3); without them the
file is cut every `block_bytes`. Every block is checked against its sha256 on receipt
(hashlib's sha256 runs at ~1.7 GB/s with SHA-NI and releases the GIL on large buffers).
Received blocks are reassembled into the file atomically (write to a temporary name in the
same folder, fsync, rename), so an engine never sees a partial file.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

READ_CHUNK = 8 << 20


class CorruptBlock(ValueError):
    """A block's bytes do not match the manifest. `public`: what is wrong without a path, a
    size or a hash (what a node tells its peers; its log keeps the whole message)."""

    def __init__(self, message: str, public: str = "it differs") -> None:
        super().__init__(message)
        self.public = public


@dataclass(frozen=True, slots=True)
class BlockInfo:
    index: int
    offset: int
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    model: str
    total_bytes: int
    blocks: tuple[BlockInfo, ...]

    @property
    def count(self) -> int:
        return len(self.blocks)

    def sizes(self) -> list[int]:
        return [b.size for b in self.blocks]

    def to_dict(self) -> dict:
        return {"model": self.model, "total_bytes": self.total_bytes,
                "blocks": [[b.offset, b.size, b.sha256] for b in self.blocks]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Manifest":
        blocks = tuple(BlockInfo(i, int(o), int(s), str(h)) for i, (o, s, h) in enumerate(d["blocks"]))
        m = cls(str(d["model"]), int(d["total_bytes"]), blocks)
        m.check()
        return m

    def check(self) -> None:
        """Blocks must tile the file: contiguous, in order, non-empty."""
        offset = 0
        for b in self.blocks:
            if b.offset != offset or b.size <= 0:
                raise ValueError(f"manifest of {self.model!r}: block {b.index} at {b.offset} (+{b.size} B) "
                                 f"does not follow the previous block (expected offset {offset})")
            offset += b.size
        if offset != self.total_bytes:
            raise ValueError(f"manifest of {self.model!r}: blocks cover {offset} B of {self.total_bytes} B")

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Manifest":
        return cls.from_dict(json.loads(Path(path).read_text()))


def cut(total_bytes: int, block_bytes: int, boundaries: Iterable[int] = ()) -> list[tuple[int, int]]:
    """(offset, size) of each block: at most `block_bytes` each, ending on the last layer
    boundary that fits when there is one (a layer larger than a block is cut anyway)."""
    if block_bytes <= 0:
        raise ValueError(f"block size must be > 0, got {block_bytes}")
    if total_bytes <= 0:
        raise ValueError(f"nothing to pack: {total_bytes} B")
    marks = sorted({b for b in boundaries if 0 < b < total_bytes})
    out, offset, i = [], 0, 0
    while offset < total_bytes:
        end = min(offset + block_bytes, total_bytes)
        while i < len(marks) and marks[i] <= offset:
            i += 1
        j, best = i, None
        while j < len(marks) and marks[j] <= end:
            best, j = marks[j], j + 1
        if best is not None and end < total_bytes:
            end = best
        out.append((offset, end - offset))
        offset = end
    return out


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(path: str | os.PathLike, block_bytes: int, model: str | None = None,
         boundaries: Iterable[int] = ()) -> Manifest:
    """Read the model file once and describe it as blocks with checksums."""
    p = Path(path)
    total = p.stat().st_size
    infos = []
    with p.open("rb") as f:
        for i, (offset, size) in enumerate(cut(total, block_bytes, boundaries)):
            f.seek(offset)
            infos.append(BlockInfo(i, offset, size, sha256(f.read(size))))
    return Manifest(model or p.name, total, tuple(infos))


def verify(manifest: Manifest, index: int, data: bytes | memoryview) -> None:
    """Raise CorruptBlock, naming the block, unless `data` is block `index`."""
    if not 0 <= index < manifest.count:
        raise CorruptBlock(f"{manifest.model}: no block {index} (the model has {manifest.count})")
    info = manifest.blocks[index]
    if len(data) != info.size:
        raise CorruptBlock(f"{manifest.model}: block {index} has {len(data)} B, expected {info.size} B",
                           f"block {index} has the wrong size")
    got = sha256(data)
    if got != info.sha256:
        raise CorruptBlock(f"{manifest.model}: block {index} checksum mismatch (sha256 {got[:12]}..., "
                           f"expected {info.sha256[:12]}...)", f"block {index} checksum mismatch")


def holds(path: str | os.PathLike, manifest: Manifest) -> bool:
    """Is the file at `path` exactly the model of `manifest` (size and every block's sha256)?
    Reads it once; a node uses it to skip a transfer of a model it already has."""
    p = Path(path)
    try:
        if not p.is_file() or p.stat().st_size != manifest.total_bytes:
            return False
        with p.open("rb") as f:
            for info in manifest.blocks:
                f.seek(info.offset)
                if sha256(f.read(info.size)) != info.sha256:
                    return False
    except OSError:
        return False
    return True


def load_blocks(path: str | os.PathLike, manifest: Manifest) -> list[bytes]:
    """Read a packed model into memory (a host copy), verifying every block."""
    p = Path(path)
    if p.stat().st_size != manifest.total_bytes:
        raise CorruptBlock(f"{p}: {p.stat().st_size} B on disk, the manifest of {manifest.model} says "
                           f"{manifest.total_bytes} B",
                           "its size differs")
    out = []
    with p.open("rb") as f:
        for info in manifest.blocks:
            data = f.read(info.size)
            verify(manifest, info.index, data)
            out.append(data)
    return out


def write_atomic(path: str | os.PathLike, manifest: Manifest, blocks: Mapping[int, bytes] | Sequence[bytes]) -> Path:
    """Reassemble the file from its blocks: written under a temporary name in the same
    folder, flushed to disk, then renamed over `path`."""
    p = Path(path)
    missing = [i for i in range(manifest.count) if (i not in blocks if isinstance(blocks,
                                                                                  Mapping) else i >= len(blocks))]
    if missing:
        raise ValueError(f"{manifest.model}: cannot write {p}, block {missing[0]} is missing ({len(missing)} in all)")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.part")
    try:
        with tmp.open("wb") as f:
            for i in range(manifest.count):
                f.write(blocks[i])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return p
