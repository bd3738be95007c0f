"""The agent's tokenizer worker (mesh.agent.tokenizers): builds each OpenVINO model's
tokenizer once and keeps it, and answers `encode` commands in order.

    python -m mesh.agent.tokenizer_worker --fd N

Commands (engines.worker_process: the wire and the loop): encode (path, messages or
prompt) -> token ids; shutdown.
"""
from __future__ import annotations

import functools
from typing import Any

from engines.worker_process import WorkerLoop, worker_main


@functools.lru_cache(maxsize=32)
def _front(path: str) -> Any:
    from engines.openvino_engine import OpenVINOEngine

    return OpenVINOEngine(path)  # reads the shape; loads no weights; builds its tokenizer on first use


class Worker(WorkerLoop):
    log_name = "mesh.tokenizer_worker"

    def handle(self, op: str, msg: dict[str, Any]) -> Any:
        if op == "encode":
            engine = _front(str(msg["path"]))
            messages = msg.get("messages")
            return engine.encode_chat(messages) if messages is not None else engine.encode_prompt(msg.get("prompt"))
        raise ValueError(f"unknown command {op!r}")


def main(argv: list[str] | None = None) -> int:
    return worker_main("python -m mesh.agent.tokenizer_worker", Worker, argv)


if __name__ == "__main__":
    raise SystemExit(main())
