"""The agent's tokenizer worker (mesh.agent.tokenizers): builds each OpenVINO model's
tokenizer once and keeps it, and answers `encode` commands in order.

    python -m mesh.agent.tokenizer_worker --fd N

Commands (engines.worker_process: the wire and the loop): encode (path, messages or
prompt) -> token ids; shutdown.
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import socket
from typing import Any

from engines.worker_process import WorkerLoop


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
        if op == "shutdown":
            return None  # run() exits the process after the reply
        raise ValueError(f"unknown command {op!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mesh.agent.tokenizer_worker")
    parser.add_argument("--fd", type=int, required=True, help="main socket (inherited file descriptor)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MESH_WORKER_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return Worker(socket.socket(fileno=args.fd)).run()


if __name__ == "__main__":
    raise SystemExit(main())
