"""What a placed request gives back to the HTTP layer: a stream of token and end events.

The cluster control pushes events as the node agent sends them; the route handler iterates.
A request that fails after it was placed (its node agent died, it was evicted) ends with
an ApiError raised from the iteration, so a stream never hangs.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from mesh.engines.engine_api import Sampling, TokenLogprob
from mesh.service.errors import ApiError
from mesh.service.registry import ModelRecord


@dataclass(frozen=True, slots=True)
class Job:
    """A generation request as the cluster control sees it (already validated)."""

    request_id: str
    model: ModelRecord
    arrival_s: float  # event-loop time when the HTTP request arrived
    sampling: Sampling  # max_tokens may be 0: "up to the context window", fixed after tokenizing
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    schema_param: str = "response_format"  # the field that asked for sampling.json_schema (or tool_choice)
    tenant: str = ""  # the requesting tenant, where not the model's (an adapter's requests run on a shared base)


@dataclass(frozen=True, slots=True)
class Tokens:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, where the request asked for them


@dataclass(frozen=True, slots=True)
class Finished:
    reason: str  # "stop" or "length"
    tokens_out: int


@dataclass(eq=False)
class RequestStream:
    request_id: str
    prompt_tokens: int
    prompt_token_ids: list[int] | None = None  # as tokenized (a request's other choices reuse them)
    node_id: str = ""
    instance_id: str = ""
    on_abort: Callable[[str], None] | None = None
    first_token_s: float | None = None
    finished: bool = False
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def push(self, event: Tokens | Finished | ApiError) -> None:
        if self.finished:
            return
        if isinstance(event, (Finished, ApiError)):
            self.finished = True
        if isinstance(event, Tokens) and self.first_token_s is None:
            self.first_token_s = asyncio.get_running_loop().time()
        self._queue.put_nowait(event)

    async def events(self) -> AsyncIterator[Tokens | Finished]:
        """Token events, then one Finished; an ApiError is raised instead if the request fails."""
        while True:
            event = await self._queue.get()
            if isinstance(event, ApiError):
                raise event
            yield event
            if isinstance(event, Finished):
                return

    async def batches(self) -> AsyncIterator[list[Tokens | Finished]]:
        """The same events as `events()`, each time as many as are waiting: a stream whose
        tokens arrive faster than the loop gets to it (several frames read in one turn) is
        written to its client in one write, not one per token. An ApiError is raised after
        the events before it."""
        queue = self._queue
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            for i, event in enumerate(batch):
                if isinstance(event, ApiError):
                    if i:
                        yield batch[:i]
                    raise event
                if isinstance(event, Finished):
                    yield batch[:i + 1]
                    return
            yield batch

    def abort(self) -> None:
        """The client went away: stop generating (idempotent)."""
        if not self.finished and self.on_abort is not None:
            self.on_abort(self.request_id)
        self.finished = True
