"""Prompt tokenization for OpenVINO models, in a process of the agent's own.

Building an OpenVINO GenAI tokenizer holds the Python GIL for seconds (2.6 s for the demo
GGUF here; longer on a core shared with loading instances), and a thread does not help: the
agent's event loop would stop answering admissions, validations and pings meanwhile (in a
live replay a node agent with three models to tokenize missed its 10 s heartbeat and was
restarted). So the agent tokenizes OpenVINO prompts in one worker process
(`python -m mesh.agent.tokenizer_worker`) that builds each model's tokenizer once and keeps
it; the agent awaits the ids. vLLM models tokenize in their engine's worker (engines.vllm_engine).

The worker is an engine worker like the others (engines.worker_process): it dies with the
agent (its socket's end, and PR_SET_PDEATHSIG), and gets no secret of the agent's. A
`ProcessPoolExecutor` worker did neither: it held its own queue's write end, so it never saw
the agent go, and outlived every agent killed.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from engines.worker_process import WorkerConnection, wait, worker_env


class TokenizerProcess:
    """One worker process (started on first use) that tokenizes for the agent, in order."""

    def __init__(self) -> None:
        self._conn: WorkerConnection | None = None

    async def encode(self, path: str, messages: Sequence[Mapping[str, Any]] | None, prompt: str | None) -> list[int]:
        """The prompt's token ids (chat `messages` with the model's template, else `prompt`);
        EngineError for what the model's tokenizer refuses, or if the worker died."""
        return await wait(self._connection().call("encode", path=path, prompt=prompt,
                                                   messages=None if messages is None else list(messages)))

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
        """End the worker (the tokenizers it built go with it)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.shutdown(5.0)

