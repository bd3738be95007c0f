"""The agent's tokenizer worker (mesh.node.tokenizers): builds each OpenVINO model's
tokenizer once and keeps it, and answers `encode` commands in order.

    python -m mesh.node.tokenizer_worker --fd N

Commands (mesh.engines.worker_process: the wire and the loop): encode (path, messages or
prompt) -> token ids; forget (path): a deleted model's tokenizer goes; stats -> the cache's
entries and bytes; shutdown.

The tokenizers it keeps are bounded by bytes, not by count ($MESH_TOKENIZER_CACHE_BYTES,
set by the agent, which reserves that much of the node's memory for them): each one is
charged what the process's resident memory grew by while it was built and first used, and
the least recently used ones go when a new one takes the cache over its bytes (the newest
is always kept, however large). A node serving many models then rebuilds the coldest
tokenizer rather than holding every one it ever built.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from mesh.engines.worker_process import WorkerLoop, worker_main
from mesh.modelfiles.gguf import GGUFError, tokenizer_digest

CACHE_BYTES_ENV = "MESH_TOKENIZER_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 256 * 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class TokenizerCache:
    """Model fronts (their tokenizers), least recently used first, bounded by bytes. Models
    whose GGUF files hold the same tokenizer (mesh.modelfiles.gguf.tokenizer_digest: copies, or
    fine-tunes of one base) share one front, built once: a node serving many tenants' models
    of one family builds one tokenizer, not one per model (each build takes seconds)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (front, bytes charged)
        self._keys: dict[str, str] = {}  # path -> its tokenizer's key
        self.evicted = 0

    @property
    def held_bytes(self) -> int:
        return sum(n for _, n in self._entries.values())

    def _key(self, path: str) -> str:
        key = self._keys.get(path)
        if key is None:
            try:
                key = "gguf-tokenizer:" + tokenizer_digest(path)
            except (OSError, GGUFError):  # an IR folder (its own tokenizer files), or unreadable: its path
                key = path
            self._keys[path] = key
        return key

    def encode(self, path: str, messages: Any, prompt: Any) -> list[int]:
        key = self._key(path)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return _encode(entry[0], messages, prompt)
        from mesh.engines.openvino_engine import OpenVINOEngine

        before = _rss_bytes()
        front = OpenVINOEngine(path)  # reads the shape; loads no weights; builds its tokenizer on first use
        ids = _encode(front, messages, prompt)
        self._entries[key] = (front, max(0, _rss_bytes() - before))
        while len(self._entries) > 1 and self.held_bytes > self.budget_bytes:
            self._entries.popitem(last=False)
            self.evicted += 1
        return ids

    def forget(self, path: str) -> bool:
        """A deleted model's path goes; its tokenizer goes with the last model that shares it."""
        key = self._keys.pop(path, path)
        if key in self._keys.values():
            return False
        return self._entries.pop(key, None) is not None

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._entries), "held_bytes": self.held_bytes, "budget_bytes": self.budget_bytes,
                "evicted": self.evicted}


def _encode(front: Any, messages: Any, prompt: Any) -> list[int]:
    return front.encode_chat(messages) if messages is not None else front.encode_prompt(prompt)


class TokenizerWorker(WorkerLoop):
    """The agent's tokenizers in their own process: encode, forget and stats, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache = TokenizerCache(int(os.environ.get(CACHE_BYTES_ENV) or DEFAULT_CACHE_BYTES))

    def handle(self, op: str, msg: dict[str, Any]) -> Any:
        if op == "encode":
            return self.cache.encode(str(msg["path"]), msg.get("messages"), msg.get("prompt"))
        if op == "forget":
            return self.cache.forget(str(msg["path"]))
        if op == "stats":
            return self.cache.stats()
        raise ValueError(f"unknown command {op!r}")


def main(argv: list[str] | None = None) -> int:
    return worker_main("python -m mesh.node.tokenizer_worker", TokenizerWorker, argv)


if __name__ == "__main__":
    raise SystemExit(main())
