"""The vLLM worker process: one `VLLMCore` (one model instance), driven over two sockets.

    python -m mesh.engines.vllm_worker --fd N --sync-fd M

Started by `mesh.engines.vllm_engine.VLLMEngine` with the interpreter that has vLLM (Mesh's
own, or the separate `.venv-vllm`), with the two socket ends passed as inherited file
descriptors (mesh.engines.worker_process: the wire and the command loop).

- Main socket: commands executed one at a time, in order, by the main thread, each
  answered by one reply ({"ok": True, "value": ...} or {"ok": False, "error": message}):
  init, prepare, build, resize, add, abort, step, park (drop every request: mesh.engines.parking), info, shutdown. A
  reader thread moves commands into a queue as they arrive, so the parent never blocks on a full socket
  while an iteration runs.
- Sync socket: tokenizer calls (encode_prompt, encode_chat, decode) served by a thread
  with its own tokenizer, so the parent can tokenize while the main thread steps.

Everything vLLM prints goes to this process's stdout/stderr, which the parent points at
a log file. The process exits when told (shutdown: at once, with os._exit, since the process ending
frees all its memory), when the main socket closes (the parent died), or on a fatal error.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Any

from mesh.engines.worker_process import WorkerLoop


class VLLMWorker(WorkerLoop):
    """One VLLMCore: commands on the main socket, its tokenizer on the sync socket."""

    def __init__(self, main: socket.socket, sync: socket.socket) -> None:
        super().__init__(main, sync)
        self.core: Any = None
        self.settings: Any = None
        self._tokenizer: Any = None

    def serve_sync(self, msg: dict[str, Any]) -> Any:
        from mesh.engines.vllm_core import encode_chat, encode_prompt, load_tokenizer

        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(msg["model_path"])
        op = msg["op"]
        if op == "encode_prompt":
            return encode_prompt(self._tokenizer, msg["text"])
        if op == "encode_chat":
            return encode_chat(self._tokenizer, msg["messages"])
        if op == "decode":
            return self._tokenizer.decode(list(msg["ids"]), skip_special_tokens=True)
        raise ValueError(f"unknown tokenizer call {op!r}")

    def handle(self, op: str, msg: dict[str, Any]) -> Any:
        from mesh.engines.vllm_core import CoreSettings, VLLMCore

        if op == "init":
            self.settings = CoreSettings(**msg["settings"])
            self.core = VLLMCore(self.settings)
            return {"pid": os.getpid(), "python": sys.executable}
        core = self.core
        if core is None:
            raise RuntimeError("the worker got no init message")
        if op == "prepare":
            core.prepare()
            return core.facts()
        if op == "build":
            return core.build(int(msg["kv_bytes"]))
        if op == "resize":
            done = core.resize(int(msg["kv_bytes"]), msg.get("mode", "reinit"))
            return {**done, **core.facts()}
        if op == "add":
            core.add(msg["rid"], msg["ids"], msg["sampling"], msg.get("resumed", 0))
            return None
        if op == "abort":
            core.abort(msg["rid"])
            return None
        if op == "step":
            result = core.step()
            return result, core.kv_bytes_in_use()
        if op == "park":  # mesh.engines.parking: drop every request, keep the engine
            for rid in list(core.request_lengths()):
                core.abort(rid)
            return core.facts()
        if op == "info":
            return {**core.facts(), "kv_bytes_in_use": core.kv_bytes_in_use(),
                    "kv_bytes_in_use_estimate": core.kv_bytes_in_use_estimate(),
                    "requests": core.request_lengths(), "has_work": core.has_work()}
        raise ValueError(f"unknown command {op!r}")

    def on_parent_gone(self) -> None:
        if self.core is not None:
            self.core.shutdown()
            self.core = None

    def before_exit(self) -> None:
        # the process ending frees the weights and the KV cache (and a GPU's context) at
        # once; vLLM's own clean-up and the interpreter's teardown take seconds
        _remove_dist_file()


def _remove_dist_file() -> None:
    """vLLM's CPU worker rendezvous through a file in TMPDIR (named in VLLM_DIST_IDENT);
    remove it, as vLLM's clean-up would have."""
    import tempfile

    ident = os.environ.get("VLLM_DIST_IDENT", "")
    if ident.startswith("vllm_dist_") and os.sep not in ident:
        try:
            os.unlink(os.path.join(tempfile.gettempdir(), ident))
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mesh.engines.vllm_worker")
    parser.add_argument("--fd", type=int, required=True, help="main socket (inherited file descriptor)")
    parser.add_argument("--sync-fd", type=int, required=True, help="tokenizer socket (inherited file descriptor)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MESH_VLLM_WORKER_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from mesh.engines.vllm_core import vllm_environment

    for key, value in vllm_environment().items():  # before anything imports vllm
        os.environ.setdefault(key, value)
    main_sock = socket.socket(fileno=args.fd)
    sync_sock = socket.socket(fileno=args.sync_fd)
    return VLLMWorker(main_sock, sync_sock).run()


if __name__ == "__main__":
    raise SystemExit(main())
