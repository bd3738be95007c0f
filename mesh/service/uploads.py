"""Uploads: a request body streamed to disk, counted against a limit and hashed.

`receive_upload()` streams a request body to a temporary file in the data folder, counting
bytes against a limit and hashing with SHA-256; only a complete, verified GGUF file is
renamed into place.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import AsyncIterator

from mesh.modelfiles.gguf import GGUF_MAGIC
from mesh.service.errors import bad_request, too_large


async def receive_upload(chunks: AsyncIterator[bytes], target: Path, limit_bytes: int, sha256: str) -> int:
    """Stream `chunks` to `target` (via a temporary file beside it); return the size.

    ApiError 413 past `limit_bytes`, 400 when the SHA-256 differs from `sha256` (hex) or the
    file is not GGUF. Nothing is left behind on failure.
    """
    expected = sha256.strip().lower()
    if len(expected) != 64 or any(c not in "0123456789abcdef" for c in expected):
        raise bad_request("'sha256' must be the 64-character hex SHA-256 of the file", "sha256")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.part")
    digest = hashlib.sha256()
    size = 0
    try:
        with open(partial, "wb") as f:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit_bytes:
                    raise too_large(limit_bytes, "upload")
                digest.update(chunk)
                f.write(chunk)
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
    except BaseException:  # including a client that went away mid-upload
        partial.unlink(missing_ok=True)
        raise
    return size
