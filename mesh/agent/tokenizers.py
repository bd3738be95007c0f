"""Prompt tokenization for OpenVINO models, in a process of the agent's own.

Building an OpenVINO GenAI tokenizer holds the Python GIL for seconds (2.6 s for the demo
GGUF here; longer on a core shared with loading instances), and a thread does not help: the
agent's event loop would stop answering admissions, validations and pings meanwhile (in a
live replay a node agent with three models to tokenize missed its 10 s heartbeat and was
restarted). So the agent tokenizes OpenVINO prompts in one child process that builds each
model's tokenizer once and keeps it; the agent awaits the ids. vLLM models tokenize in
their engine's worker (engines.vllm_engine).
"""
from __future__ import annotations

import asyncio
import functools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Mapping, Sequence

from engines.protocol import EngineError


class TokenizerProcess:
    """One child process (started on first use) that tokenizes for the agent."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def encode(self, path: str, messages: Sequence[Mapping[str, Any]] | None, prompt: str | None) -> list[int]:
        """The prompt's token ids (chat `messages` with the model's template, else `prompt`);
        EngineError for what the model's tokenizer refuses."""
        return await self._call(path, _encode, path, None if messages is None else list(messages), prompt)

    async def prepare(self, path: str) -> None:
        """Build the model's tokenizer now (an instance of it is loading), so that its first
        request is not tokenized with the process's start and the tokenizer's build in its
        TTFT (several seconds: a first request was turned away for it)."""
        await self._call(path, _encode, path, None, "")

    async def _call(self, path: str, fn: Any, *args: Any) -> Any:
        if self._pool is None:  # spawned: a fork would copy the agent's threads and sockets
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            return await asyncio.wrap_future(self._pool.submit(fn, *args))
        except BrokenProcessPool as exc:  # it died (killed, out of memory): a fresh one next time
            self._pool = None
            raise EngineError(f"the tokenizer process died while tokenizing for {path}: {exc}; retry") from exc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


@functools.lru_cache(maxsize=32)
def _front(path: str) -> Any:
    from engines.openvino_engine import OpenVINOEngine

    return OpenVINOEngine(path)  # reads the shape; loads no weights; builds its tokenizer on first use


def _encode(path: str, messages: list[Mapping[str, Any]] | None, prompt: str | None) -> list[int]:
    engine = _front(path)
    return engine.encode_chat(messages) if messages is not None else engine.encode_prompt(prompt)
