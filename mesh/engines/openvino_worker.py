"""The OpenVINO worker process: one `OpenVINOEngine` (one model instance) driven over a
socket by `mesh.engines.openvino_process.OpenVINOProcessEngine`.

    python -m mesh.engines.openvino_worker --fd N

Commands (mesh.engines.worker_process: the wire and the loop), executed in order: init (the
engine's arguments), load, resize, add, abort, step, park (drop every request, keep the
pipeline: mesh.engines.parking), facts, shutdown. `step` answers the
iteration's StepResult with the KV bytes allocated after it; a step with
nothing to run (its requests were aborted in flight) answers an empty DECODE result.
"""
from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from mesh.engines.engine_api import StepResult
from mesh.engines.worker_process import WorkerLoop, worker_main
from mesh.policy.batching import IterationKind


class OpenVINOWorker(WorkerLoop):
    """One OpenVINOEngine in its own process: the commands above, in order."""

    def __init__(self, main: socket.socket) -> None:
        super().__init__(main)
        self.engine: Any = None

    def facts(self) -> dict[str, Any]:
        e = self.engine
        return {"kv_bytes_per_token": e.kv_bytes_per_token, "kv_bytes_allocated": e.kv_bytes_allocated(),
                "pid": os.getpid(), "loaded_from": e.loaded_from}

    def handle(self, op: str, msg: dict[str, Any]) -> Any:
        from mesh.engines.openvino_engine import OpenVINOEngine

        if op == "init":
            self.engine = OpenVINOEngine(**msg["kwargs"])
            return self.facts()
        engine = self.engine
        if engine is None:
            raise RuntimeError("the worker got no init message")
        if op == "load":
            asyncio.run(engine.load())
            return self.facts()
        if op == "park":
            engine.drop_requests()
            return self.facts()
        if op == "facts":
            return self.facts()
        if op == "resize":
            asyncio.run(engine.resize_kv(int(msg["kv_bytes"])))
            return self.facts()
        if op == "add":
            engine.add_request(msg["request"])
            return None
        if op == "abort":
            engine.abort(msg["rid"])
            return None
        if op == "step":
            if not engine.has_work():
                result = StepResult(IterationKind.DECODE, [], [], [], {})
            else:
                result = engine.step_blocking()
            return result, engine.kv_bytes_allocated()
        raise ValueError(f"unknown command {op!r}")


def main(argv: list[str] | None = None) -> int:
    return worker_main("python -m mesh.engines.openvino_worker", OpenVINOWorker, argv)


if __name__ == "__main__":
    raise SystemExit(main())
