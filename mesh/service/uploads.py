"""Uploads: a request body streamed to disk, counted against a limit and hashed.

`receive_upload()` streams a request body to a temporary file (mode 0600) in the data
folder, counting bytes against a limit and hashing with SHA-256 in a worker thread (the
event loop keeps serving); only a complete, verified GGUF file is renamed into place. A full
disk is a 507 and the partial file is removed. `sweep_orphans()` removes, at start, the
partial files and the uploads no model row names (a crash between the rename and the row).
"""
from __future__ import annotations

import asyncio
import errno
import hashlib
import os
from pathlib import Path
from typing import AsyncIterator, Callable, Iterable

from mesh.modelfiles.gguf import GGUF_MAGIC
from mesh.service.errors import ApiError, bad_request, too_large

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def insufficient_storage(exc: OSError) -> ApiError:
    return ApiError(507, f"The server's disk has no room for this upload ({exc.strerror}); the partial file was "
                    "removed. Retry later or ask the operator to free space.", "server_error", None,
                    "insufficient_storage", {"Retry-After": "60"})


def _write_all(fd: int, digest: "hashlib._Hash", chunk: bytes) -> None:
    digest.update(chunk)  # sha256 releases the GIL on large buffers
    view = memoryview(chunk)
    while view:
        view = view[os.write(fd, view):]


async def receive_upload(chunks: AsyncIterator[bytes], target: Path, limit_bytes: int, sha256: str,
                         over_limit: Callable[[], ApiError] | None = None) -> int:
    """Stream `chunks` to `target` (via a temporary file beside it); return the size.

    Past `limit_bytes`: `over_limit()` (default a 413); 400 when the SHA-256 differs from
    `sha256` (hex) or the file is not GGUF; 507 on a full disk. Nothing is left behind on failure.
    """
    expected = sha256.strip().lower()
    if len(expected) != 64 or any(c not in "0123456789abcdef" for c in expected):
        raise bad_request("'sha256' must be the 64-character hex SHA-256 of the file", "sha256")
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.part")
    digest = hashlib.sha256()
    size = 0
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit_bytes:
                    raise over_limit() if over_limit is not None else too_large(limit_bytes, "upload")
                await asyncio.to_thread(_write_all, fd, digest, chunk)
        finally:
            os.close(fd)
        if size == 0:
            raise bad_request("the upload is empty; send the GGUF file as the request body", "body")
        if digest.hexdigest() != expected:
            raise bad_request(f"checksum mismatch: the upload's SHA-256 is {digest.hexdigest()}, not {expected}",
                              "sha256", "checksum_mismatch")
        with open(partial, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise bad_request("uploads must be GGUF files (no GGUF magic); register OpenVINO IR or Hugging "
                                  "Face folders by path", "body")
        os.replace(partial, target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        if exc.errno in FULL_DISK:
            raise insufficient_storage(exc) from exc
        raise
    except BaseException:  # including a client that went away mid-upload
        partial.unlink(missing_ok=True)
        raise
    return size


def sweep_orphans(uploads: Path, kept: Iterable[str]) -> list[Path]:
    """Remove partial uploads and uploaded files that no model row names (`kept`: the paths
    the registry holds); return what was removed."""
    keep = {os.path.realpath(p) for p in kept}
    removed = []
    if not uploads.is_dir():
        return removed
    for entry in uploads.iterdir():
        if entry.is_file() and (entry.name.endswith(".part") or os.path.realpath(entry) not in keep):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
