"""Prompt tokenization for OpenVINO models, in a process of the agent's own.

Building an OpenVINO GenAI tokenizer holds the Python GIL for seconds (2.6 s for the demo
GGUF here; longer on a core shared with loading instances), and a thread does not help: the
agent's event loop would stop answering admissions, validations and pings meanwhile (in a
live replay a node agent with three models to tokenize missed its 10 s heartbeat and was
restarted). So the agent tokenizes OpenVINO prompts in one worker process
(`python -m mesh.agent.tokenizer_worker`) that builds each model's tokenizer once and keeps
it; the agent awaits the ids. vLLM models tokenize in their engine's worker (engines.vllm_engine).

Jobs wait in the agent, not in the worker's socket: the worker gets one job at a time, and
the waiting ones are taken one tenant at a time in turn (round robin over the tenants that
have jobs waiting), so one tenant's many prompts delay another tenant's by one job at most.
A job whose caller stops waiting (its client hung up: the service sends `abort`) is dropped
before it runs; one already running finishes in the worker and its ids are discarded
(issue 25: a tenant sending many large prompts and hanging up held the FIFO for everyone).

The worker is an engine worker like the others (engines.worker_process): it dies with the
agent (its socket's end, and PR_SET_PDEATHSIG), and gets no secret of the agent's. A
`ProcessPoolExecutor` worker did neither: it held its own queue's write end, so it never saw
the agent go, and outlived every agent killed.
"""
from __future__ import annotations

import asyncio
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from engines.protocol import EngineError
from engines.worker_process import WorkerConnection, wait, worker_env


@dataclass(eq=False)
class _Job:
    tenant: str
    fields: dict[str, Any]
    future: asyncio.Future
    started: bool = False


@dataclass
class TokenizerCounts:
    done: int = 0  # jobs the worker ran for a caller still waiting
    dropped: int = 0  # jobs whose caller left before they ran: never sent to the worker
    discarded: int = 0  # jobs whose caller left while they ran: their ids were thrown away

    def as_dict(self) -> dict[str, int]:
        return {"done": self.done, "dropped": self.dropped, "discarded": self.discarded}


class TokenizerProcess:
    """One worker process (started on first use) that tokenizes for the agent, one job at a
    time, taking the tenants' waiting jobs in turn."""

    def __init__(self) -> None:
        self._conn: WorkerConnection | None = None
        self._waiting: dict[str, deque[_Job]] = {}  # tenant -> its jobs; dict order is the turn order
        self._pump: asyncio.Task | None = None
        self._running: _Job | None = None
        self.counts = TokenizerCounts()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def encode(self, path: str, messages: Sequence[Mapping[str, Any]] | None, prompt: str | None,
                     tenant: str = "") -> list[int]:
        """The prompt's token ids (chat `messages` with the model's template, else `prompt`);
        EngineError for what the model's tokenizer refuses, or if the worker died. Cancelled
        (the caller left), the job is dropped if it has not started."""
        loop = asyncio.get_running_loop()
        job = _Job(tenant, {"path": path, "prompt": prompt, "messages": None if messages is None else list(messages)},
                   loop.create_future())
        self._waiting.setdefault(tenant, deque()).append(job)
        if self._pump is None or self._pump.done():
            self._pump = loop.create_task(self._run())
        try:
            return await job.future
        except asyncio.CancelledError:
            if not job.started:
                self._drop(job)
            raise

    def _drop(self, job: _Job) -> None:
        queue = self._waiting.get(job.tenant)
        if queue is not None and job in queue:
            queue.remove(job)  # its prompt is freed now, not when its turn comes
            if not queue:
                del self._waiting[job.tenant]
            self.counts.dropped += 1

    async def _run(self) -> None:
        """Send the waiting jobs to the worker one at a time, a tenant's next job after every
        other waiting tenant's."""
        while self._waiting:
            tenant = next(iter(self._waiting))
            queue = self._waiting.pop(tenant)
            job = queue.popleft()
            if queue:
                self._waiting[tenant] = queue  # back of the turn order
            if job.future.done():  # cancelled meanwhile
                self.counts.dropped += 1
                continue
            job.started = True
            self._running = job
            try:
                ids = await wait(self._connection().call("encode", **job.fields))
            except Exception as exc:  # noqa: BLE001 - EngineError, or the worker could not start: the caller's
                if not job.future.done():
                    job.future.set_exception(exc if isinstance(exc, EngineError) else EngineError(str(exc)))
                continue
            finally:
                self._running = None
            if job.future.done():
                self.counts.discarded += 1
            else:
                self.counts.done += 1
                job.future.set_result(ids)

    async def prepare(self, path: str) -> None:
        """Build the model's tokenizer now (an instance of it is loading), so that its first
        request is not tokenized with the process's start and the tokenizer's build in its
        TTFT (several seconds: a first request was turned away for it)."""
        await self.encode(path, None, "")

    def _connection(self) -> WorkerConnection:
        conn = self._conn
        if conn is not None and conn.dead is None:
            return conn
        if conn is not None:  # it died (killed, out of memory): a fresh one; the calls it had failed
            conn.close(timeout=1.0)
        self._conn = WorkerConnection("mesh.agent.tokenizer_worker", sys.executable, worker_env(), self._log_path(),
                                      name="tokenizer")
        return self._conn

    @staticmethod
    def _log_path() -> Path:
        """Where the worker's output goes: Mesh's data folder, logs/."""
        from mesh.paths import data_dir

        return data_dir() / "logs" / f"tokenizer-{os.getpid()}.log"

    async def close(self) -> None:
        """End the worker (the tokenizers it built go with it); waiting jobs fail."""
        if self._pump is not None:
            self._pump.cancel()
        jobs = [job for queue in self._waiting.values() for job in queue] + ([self._running] if self._running else [])
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(EngineError("the node agent is shutting down"))
        self._waiting.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.shutdown(5.0)

