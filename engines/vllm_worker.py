"""The vLLM worker process: one `VLLMCore` (one model instance), driven over two sockets.

    python -m engines.vllm_worker --fd N --sync-fd M

Started by `engines.vllm_engine.VLLMEngine` with the interpreter that has vLLM (Mesh's
own, or the separate `.venv-vllm`), with the two socket ends passed as inherited file
descriptors. Messages are pickled dicts with a 4-byte big-endian length in front.

- Main socket: commands executed one at a time, in order, by the main thread, each
  answered by one reply ({"ok": True, "value": ...} or {"ok": False, "error": message}):
  init, prepare, build, resize, add, abort, step, info, shutdown. A reader thread moves
  commands into a queue as they arrive, so the parent never blocks on a full socket
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
import pickle
import queue
import socket
import struct
import sys
import threading
import traceback
from typing import Any

_LEN = struct.Struct("!I")


def send_msg(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_msg(sock: socket.socket) -> Any:
    """One message; EOFError when the other side closed the socket."""
    header = _recv_exact(sock, _LEN.size)
    return pickle.loads(_recv_exact(sock, _LEN.unpack(header)[0]))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("socket closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class Worker:
    def __init__(self, main: socket.socket, sync: socket.socket) -> None:
        self.main = main
        self.sync = sync
        self.core: Any = None
        self.settings: Any = None
        self.commands: queue.Queue = queue.Queue()

    # the reader thread: commands into the queue, None at EOF
    def _read_main(self) -> None:
        try:
            while True:
                self.commands.put(recv_msg(self.main))
        except (EOFError, OSError):
            self.commands.put(None)

    def _serve_sync(self) -> None:
        from engines.vllm_core import encode_chat, encode_prompt, load_tokenizer

        tokenizer = None
        try:
            while True:
                msg = recv_msg(self.sync)
                try:
                    if tokenizer is None:
                        tokenizer = load_tokenizer(msg["model_path"])
                    op = msg["op"]
                    if op == "encode_prompt":
                        value: Any = encode_prompt(tokenizer, msg["text"])
                    elif op == "encode_chat":
                        value = encode_chat(tokenizer, msg["messages"])
                    elif op == "decode":
                        value = tokenizer.decode(list(msg["ids"]), skip_special_tokens=True)
                    else:
                        raise ValueError(f"unknown tokenizer call {op!r}")
                    send_msg(self.sync, {"ok": True, "value": value})
                except Exception as exc:  # noqa: BLE001 - every failure goes back as a message
                    send_msg(self.sync, {"ok": False, "error": _describe(exc), "engine_error": _is_engine_error(exc)})
        except (EOFError, OSError):
            return

    def run(self) -> int:
        threading.Thread(target=self._read_main, name="vllm-worker-reader", daemon=True).start()
        threading.Thread(target=self._serve_sync, name="vllm-worker-tokenizer", daemon=True).start()
        while True:
            msg = self.commands.get()
            if msg is None:  # the parent is gone
                self._shutdown()
                return 0
            op = msg.get("op")
            try:
                value = self.handle(op, msg)
                reply = {"ok": True, "value": value}
            except Exception as exc:  # noqa: BLE001
                logging.getLogger("mesh.vllm_worker").debug("%s failed", op, exc_info=True)
                reply = {"ok": False, "error": _describe(exc), "engine_error": _is_engine_error(exc)}
            try:
                send_msg(self.main, reply)
            except OSError:
                self._shutdown()
                return 0
            if op == "shutdown":
                # the process ending frees the weights and the KV cache (and a GPU's context)
                # at once; vLLM's own clean-up and the interpreter's teardown take seconds
                _remove_dist_file()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)

    def handle(self, op: str, msg: dict[str, Any]) -> Any:
        from engines.vllm_core import CoreSettings, VLLMCore

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
            core.add(msg["rid"], msg["ids"], msg["sampling"])
            return None
        if op == "abort":
            core.abort(msg["rid"])
            return None
        if op == "step":
            result = core.step()
            return result, core.kv_bytes_in_use()
        if op == "info":
            return {**core.facts(), "kv_bytes_in_use": core.kv_bytes_in_use(),
                    "kv_bytes_in_use_estimate": core.kv_bytes_in_use_estimate(),
                    "requests": core.request_lengths(), "has_work": core.has_work()}
        if op == "shutdown":
            return None  # run() exits the process after the reply
        raise ValueError(f"unknown command {op!r}")

    def _shutdown(self) -> None:
        if self.core is not None:
            self.core.shutdown()
            self.core = None


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


def _describe(exc: BaseException) -> str:
    if _is_engine_error(exc):
        return str(exc)
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _is_engine_error(exc: BaseException) -> bool:
    from engines.protocol import EngineError

    return isinstance(exc, EngineError)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.vllm_worker")
    parser.add_argument("--fd", type=int, required=True, help="main socket (inherited file descriptor)")
    parser.add_argument("--sync-fd", type=int, required=True, help="tokenizer socket (inherited file descriptor)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MESH_VLLM_WORKER_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from engines.vllm_core import vllm_environment

    for key, value in vllm_environment().items():  # before anything imports vllm
        os.environ.setdefault(key, value)
    main_sock = socket.socket(fileno=args.fd)
    sync_sock = socket.socket(fileno=args.sync_fd)
    return Worker(main_sock, sync_sock).run()


if __name__ == "__main__":
    raise SystemExit(main())
