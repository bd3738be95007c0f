"""API keys and the admin token.

A tenant API key is "mesh-" + 32 random bytes (URL-safe base64, 43 characters). The
registry stores only its SHA-256 (hex) and a short display prefix; the key itself is shown
once, when it is issued. Lookups go by hash. The admin token comes from $MESH_ADMIN_TOKEN or
the config file and is compared in constant time.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_PREFIX = "mesh-"
DISPLAY_CHARS = 12  # "mesh-" + 7 characters: enough to tell keys apart in a listing


@dataclass(frozen=True, slots=True)
class NewKey:
    key: str  # shown once
    key_hash: str
    display: str


def new_api_key() -> NewKey:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return NewKey(key, hash_key(key), key[:DISPLAY_CHARS])


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def bearer_token(header: str | None) -> str | None:
    """The token of an 'Authorization: Bearer <token>' header, or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def admin_token_ok(given: str | None, expected: str | None) -> bool:
    """True only when an admin token is configured and `given` equals it."""
    if not expected or not given:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))
