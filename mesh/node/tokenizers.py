"""Prompt tokenization for OpenVINO models, in a process of the agent's own.

Building an OpenVINO GenAI tokenizer holds the Python GIL for seconds (2.6 s for the demo
GGUF here; longer on a core shared with loading instances), and a thread does not help: the
agent's event loop would stop answering admissions, validations and pings meanwhile (in a
live replay a node agent with three models to tokenize missed its 10 s heartbeat and was
restarted). So the agent tokenizes OpenVINO prompts in one worker process
(`python -m mesh.node.tokenizer_worker`) that builds each model's tokenizer once and keeps
it; the agent awaits the ids. vLLM models tokenize in their engine's worker (mesh.engines.vllm_engine).

Tokenizing is admitted work, on every engine kind:
- Jobs wait in the agent, not in the worker's socket: one job runs at a time, and the
  waiting ones are shared fairly between tenants by the worker time they take (start-time
  fair queueing, charged after the fact: a tenant's next job starts at virtual time
  max(v, the end of its last job), where a job's end is its start plus the seconds it held
  the worker; the smallest start runs next, and v is the start of the job running). So a
  tenant takes the tokenizer in proportion to the time its jobs cost, whatever makes them
  costly: a 1 MB prompt, or a new model's first tokenize, which also builds its tokenizer
  (seconds). Weighed by prompt size, six churning tenants' first tokenizes (short prompts,
  seconds each) all ran ahead of a streaming tenant's, which waited past 30 s (the soak).
- A tokenizer built ahead (a model just described: `prepare`) is background work: it runs
  only when no caller's job waits, and a deleted model's leaves the queue unbuilt.
- A job whose caller stops waiting (its client hung up: the service sends `abort`) is
  dropped before it runs; one already running finishes and its ids are discarded (else a
  tenant sending many large prompts and hanging up would hold the queue for everyone).
- Every job has a deadline (`JOB_TIMEOUT_S` from when it starts): a worker that runs past
  it is stuck, and is killed (counted in `restarts`); the job fails with a clear error and
  the next job starts a fresh worker.
- vLLM models tokenize in their engine's worker (mesh.engines.vllm_engine, a blocking call on
  its sync socket): they take their turn in the same queue (`run`), and the call runs in a
  thread, never on the agent's event loop. The call is given the job's deadline: a worker
  that answers nothing by then frees the thread (its sync socket is closed for good:
  `WorkerStuck`, mesh.engines.worker_process), and the job's `on_stuck` kills that worker:
  an instance's goes the node watchdog's way (its requests are evicted with their progress
  and placed again, the instance fails, a new one starts where needed: mesh.node.runtime
  `worker_stuck`); an unloaded front's is killed and the front dropped, so the next
  describe or tokenize builds a fresh one (mesh.node.model_fronts).

The worker is an engine worker like the others (mesh.engines.worker_process): it dies with the
agent (its socket's end, and PR_SET_PDEATHSIG), and gets no secret of the agent's. A
`ProcessPoolExecutor` worker did neither: it held its own queue's write end, so it never saw
the agent go, and outlived every agent killed.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

from mesh.engines.engine_api import EngineError
from mesh.engines.worker_process import SYNC_CALL_DEADLINE_S, WorkerConnection, WorkerStuck, wait, worker_env
from mesh.node.tokenizer_worker import CACHE_BYTES_ENV, DEFAULT_CACHE_BYTES

log = logging.getLogger(__name__)

# A job's deadline once it runs: the deadline of a worker's sync call, by default (one number,
# kept where both the engines and this queue read it: mesh.engines.worker_process).
JOB_TIMEOUT_S = SYNC_CALL_DEADLINE_S

# What a job past its deadline calls (why): kill the worker it waits on; True if it killed one.
OnStuck = Callable[[str], Awaitable[bool]]


@dataclass(eq=False)
class _Job:
    tenant: str
    seq: int  # arrival order (ties between tenants' starts)
    work: Callable[[], Awaitable[list[int]]]
    future: asyncio.Future
    on_stuck: OnStuck
    background: bool = False  # a tokenizer built ahead: runs only when no caller's job waits
    started: bool = False


async def _dropped() -> list[int]:
    return []


@dataclass
class TokenizerCounts:
    done: int = 0  # jobs the worker ran for a caller still waiting
    dropped: int = 0  # jobs whose caller left before they ran: never sent to the worker
    discarded: int = 0  # jobs whose caller left while they ran: their ids were thrown away
    timed_out: int = 0  # jobs that ran past their deadline (their worker was killed)
    restarts: int = 0  # workers killed as stuck

    def as_dict(self) -> dict[str, int]:
        return {"done": self.done, "dropped": self.dropped, "discarded": self.discarded,
                "timed_out": self.timed_out, "restarts": self.restarts}


class TokenizerProcess:
    """One worker process (started on first use) that tokenizes for the agent, and the queue
    of every tokenize job on the node: one at a time, shared fairly between tenants by the
    worker time their jobs take, each with a deadline (module docstring)."""

    def __init__(self, cache_bytes: int = DEFAULT_CACHE_BYTES, job_timeout_s: float = JOB_TIMEOUT_S) -> None:
        self.cache_bytes = cache_bytes  # the worker's tokenizers at most (the agent reserves it)
        self.job_timeout_s = job_timeout_s
        self._conn: WorkerConnection | None = None
        self._queues: dict[str, deque[_Job]] = {}  # tenant -> its callers' jobs waiting, in order
        self._background: deque[_Job] = deque()  # tokenizers built ahead: after every caller's job
        self._finish: dict[str, float] = {}  # tenant -> the virtual end of its last job (this busy period)
        self._vtime = 0.0  # the virtual start of the job that started last
        self._seq = itertools.count()
        self._pump: asyncio.Task | None = None
        self._running: _Job | None = None
        self.counts = TokenizerCounts()

    @property
    def waiting(self) -> int:
        return sum(1 for job in self._jobs() if not job.future.done())

    def _jobs(self) -> list[_Job]:
        return [job for queue in self._queues.values() for job in queue] + list(self._background)

    async def encode(self, path: str, messages: Sequence[Mapping[str, Any]] | None, prompt: str | None,
                     tenant: str = "") -> list[int]:
        """The prompt's token ids (chat `messages` with the model's template, else `prompt`),
        in the worker; EngineError for what the model's tokenizer refuses, if the worker
        died, or ran past the job's deadline. Cancelled (the caller left), the job is
        dropped if it has not started."""
        fields = {"path": path, "prompt": prompt, "messages": None if messages is None else list(messages)}
        return await self._queued(tenant, lambda: wait(self._connection().call("encode", **fields)),
                                  self._kill_worker)

    async def run(self, tenant: str, call: Callable[[float], list[int]], on_stuck: OnStuck) -> list[int]:
        """`call(deadline_s)` (a blocking tokenize: a vLLM engine's, bounded by `deadline_s`, the
        job's deadline), in a thread when its turn comes. Past the deadline (or WorkerStuck
        from the call) `on_stuck(why)` kills the worker it waited on (module docstring)."""
        return await self._queued(tenant, lambda: asyncio.to_thread(call, self.job_timeout_s), on_stuck)

    async def _queued(self, tenant: str, work: Callable[[], Awaitable[list[int]]],
                      on_stuck: OnStuck, background: bool = False) -> list[int]:
        loop = asyncio.get_running_loop()
        job = _Job(tenant, next(self._seq), work, loop.create_future(), on_stuck, background)
        if background:  # no tenant's share: it waits for every caller's job
            self._background.append(job)
        else:
            self._queues.setdefault(tenant, deque()).append(job)
        if self._pump is None or self._pump.done():
            self._pump = loop.create_task(self._run())
        try:
            return await job.future
        except asyncio.CancelledError:
            if not job.started:  # its future is cancelled with it: skipped when its turn comes, never run
                job.future.cancel()
                job.work = _dropped  # its prompt is freed now, not when its turn comes
                self.counts.dropped += 1
            raise

    def _next(self) -> _Job | None:
        """The waiting job to run next: of the tenants with a caller's job waiting, the one
        whose next job starts first in virtual time (its last job's end, or v if it has been
        idle), then the earliest arrival; else a build ahead. Cancelled jobs are skipped."""
        for queue in self._queues.values():
            while queue and queue[0].future.done():  # cancelled meanwhile (counted then)
                queue.popleft()
        for tenant in [t for t, queue in self._queues.items() if not queue]:
            del self._queues[tenant]
        if self._queues:
            tenant = min(self._queues, key=lambda t: (max(self._vtime, self._finish.get(t, 0.0)),
                                                      self._queues[t][0].seq))
            self._vtime = max(self._vtime, self._finish.get(tenant, 0.0))
            return self._queues[tenant].popleft()
        while self._background:
            job = self._background.popleft()
            if not job.future.done():
                return job
        return None

    async def _run(self) -> None:
        """Run the waiting jobs one at a time, the earliest virtual start first; charge each
        caller's job to its tenant by the seconds it held the worker."""
        loop = asyncio.get_running_loop()
        while (job := self._next()) is not None:
            job.started = True
            self._running = job
            start_s, start_v = loop.time(), self._vtime
            try:
                ids = await asyncio.wait_for(job.work(), self.job_timeout_s)
            except (asyncio.TimeoutError, WorkerStuck):  # past the deadline here, or by the call's own
                self.counts.timed_out += 1
                try:
                    if await job.on_stuck(f"a tokenize job ran past its {self.job_timeout_s:g} s deadline"):
                        self.counts.restarts += 1
                except Exception:  # noqa: BLE001 - the job fails below either way
                    log.exception("killing a stuck tokenizer failed")
                if not job.future.done():
                    job.future.set_exception(EngineError(
                        f"tokenizing took over {self.job_timeout_s:g} s and was stopped; try again, or send a "
                        "shorter prompt"))
                continue
            except Exception as exc:  # noqa: BLE001 - EngineError, or the worker could not start: the caller's
                if not job.future.done():
                    job.future.set_exception(exc if isinstance(exc, EngineError) else EngineError(str(exc)))
                continue
            finally:
                self._running = None
                if not job.background:
                    self._finish[job.tenant] = start_v + (loop.time() - start_s)
                if not any(self._queues.values()):  # the busy period ended: every tenant starts even
                    self._finish.clear()
                    self._vtime = 0.0
            if job.future.done():
                self.counts.discarded += 1
            else:
                self.counts.done += 1
                job.future.set_result(ids)

    async def _kill_worker(self, why: str) -> bool:
        """A stuck worker is killed; the next job starts a fresh one."""
        conn, self._conn = self._conn, None
        if conn is None:
            return False
        log.warning("the tokenizer worker is stuck (%s): killed; the next job starts a new one", why)
        await asyncio.to_thread(conn.kill)
        return True

    async def forget(self, path: str) -> None:
        """A deleted model's tokenizer leaves the worker (if one runs)."""
        conn = self._conn
        if conn is not None and conn.dead is None:
            try:
                await asyncio.wait_for(wait(conn.call("forget", path=path)), self.job_timeout_s)
            except (EngineError, asyncio.TimeoutError) as exc:
                log.warning("the tokenizer worker could not forget %s: %s", path, exc)

    async def cache_stats(self) -> dict[str, Any] | None:
        """The worker's tokenizers (entries, bytes); None if no worker runs."""
        conn = self._conn
        if conn is None or conn.dead is not None:
            return None
        try:
            return await asyncio.wait_for(wait(conn.call("stats")), 5.0)
        except (EngineError, asyncio.TimeoutError):
            return None

    async def prepare(self, path: str) -> None:
        """Build the model's tokenizer ahead (the model was just described here), so that its
        first request is not tokenized with the process's start and the tokenizer's build in
        its TTFT (several seconds: a first request was turned away for it). In the background:
        it runs only when no caller's job waits, since a build holds the worker for seconds
        and a burst of new models' builds ahead of them timed callers out (the soak: tokenizes
        unanswered for 30 s). A model whose first request comes first builds it in that job."""
        fields = {"path": path, "prompt": "", "messages": None}
        await self._queued("", lambda: wait(self._connection().call("encode", **fields)), self._kill_worker,
                           background=True)

    def _connection(self) -> WorkerConnection:
        conn = self._conn
        if conn is not None and conn.dead is None:
            return conn
        if conn is not None:  # it died (killed, out of memory): a fresh one; the calls it had failed
            conn.close(timeout=1.0)
        env = {**worker_env(), CACHE_BYTES_ENV: str(self.cache_bytes)}
        self._conn = WorkerConnection("mesh.node.tokenizer_worker", sys.executable, env, self._log_path(),
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
        jobs = self._jobs() + ([self._running] if self._running else [])
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(EngineError("the node agent is shutting down"))
        self._queues.clear()
        self._background.clear()
        self._finish.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.shutdown(5.0)

