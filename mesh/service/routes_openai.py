"""OpenAI-compatible serving: POST /v1/chat/completions and POST /v1/completions.

Streaming answers are server-sent events: `data: {chunk}` per token, `data: [DONE]` at the
end. A request that fails after its stream started (its node agent died) gets one
`data: {"error": {...}}` event and the stream ends without [DONE], which the official
clients raise as an error. A client that goes away aborts its request on the node.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
from dataclasses import replace
from json.decoder import scanstring
from json.encoder import encode_basestring
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from mesh.engines.engine_api import Sampling, TokenLogprob
from mesh.framing import bounded_int, not_a_number
from mesh.modelfiles.sampling import resolve as resolve_sampling
from mesh.service import errors
from mesh.service.adapters import with_adapter
from mesh.service.errors import ApiError
from mesh.service.limits import THREAD_PARSE_BYTES, read_body
from mesh.service.registry import AdapterRecord, ModelRecord
from mesh.service.schema import GenerationRequest, parse_chat, parse_completion, parse_json
from mesh.service.service_state import ARRIVAL, Service, service_of
from mesh.service.streams import Finished, Job, RequestStream, Tokens
from mesh.service.tool_calls import CallFilter, ToolCall, parse_calls

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion)


async def _generate(request: web.Request, parse: Callable[[dict[str, Any]], GenerationRequest]) -> web.StreamResponse:
    svc = service_of(request)
    tenant = svc.tenant_of(request)
    body = await read_body(request, svc.limits, _body_cap(svc, tenant))
    if len(body) <= THREAD_PARSE_BYTES:
        req, model, adapter = _checked(svc, tenant, parse(parse_json(body)))
        _acquire(svc, tenant, req.model, req.n)
    else:  # a large body: the tenant's quota and the prompt's size first, the parse (CPU) last
        _acquire(svc, tenant, _named_model(svc, tenant, body))
        try:
            _check_token_ids(body, svc.registry.max_context_length(tenant))
            parsed = parse(await asyncio.to_thread(parse_json, body))  # off the loop
            req, model, adapter = _checked(svc, tenant, parsed)
            if req.n > 1:
                _acquire(svc, tenant, req.model, req.n - 1)
        except BaseException:
            svc.quotas.release(tenant)
            raise
    try:
        return await _placed(svc, request, req, tenant, model, adapter)
    finally:
        svc.quotas.release(tenant, req.n)


def _checked(svc: Service, tenant: str,
             req: GenerationRequest) -> tuple[GenerationRequest, ModelRecord, AdapterRecord | None]:
    """The request with the tenant's model it names (an adapter's: its base, and the adapter);
    404 for none, 400 for a prompt too long."""
    adapter = None
    model = svc.registry.model(tenant, req.model)
    if model is None:
        adapter = svc.registry.adapter(tenant, req.model)
        model = svc.registry.model_by_uid(adapter.base_uid) if adapter is not None else None
    if model is None:
        raise errors.model_not_found(req.model)
    _check_prompt_bytes(req, model)  # before any tokenizer sees it
    return req, model, adapter


def _acquire(svc: Service, tenant: str, model_name: str | None, count: int = 1) -> None:
    """Open `count` generation requests for the tenant (a request's n choices are n
    requests): 429 over its quota, counted under the model it names (if it is one of the
    tenant's)."""
    try:
        svc.quotas.acquire(tenant, asyncio.get_running_loop().time(), count)
    except ApiError:
        if model_name is not None:
            svc.metrics.request_done(tenant, model_name, "over_quota")
        raise


_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
TOKEN_ID_BYTES = 12  # a token id's JSON text at most, with its comma and a space (vocabularies < 10^10)


def _named_model(svc: Service, tenant: str, body: bytes) -> str | None:
    """The tenant's model a large body names, found without parsing it (for the over-quota
    metric; None if it names none of the tenant's models: no series for unknown names)."""
    found = _MODEL_FIELD.search(body)
    if found is None:
        return None
    name = found.group(1).decode("utf-8", "replace")
    return name if svc.registry.model(tenant, name) is not None else None


def _check_token_ids(body: bytes, window: int) -> None:
    """Before a large body is parsed: a token-id prompt (the body's own `"prompt": [ids]`)
    longer than the tenant's largest context window is a 400 and one whose array's text is
    larger than that many ids can take a 413, both counted at C speed (its commas), not
    parsed (a 5.7 MiB token-id prompt takes about 1 s to parse).
    The exact checks follow the parse."""
    if b'"prompt"' not in body:
        return
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return  # the parser says so
    span = _top_level_ids(text)
    if span is None:
        return
    start, end = span
    ids = text.count(",", start, end) + 1
    if ids + 1 > window:
        raise errors.context_too_long(ids, window, "prompt")
    limit = window * TOKEN_ID_BYTES
    if end - start > limit:
        raise ApiError(413, f"The prompt's token ids take {end - start} bytes of JSON, more than {window} token "
                       f"ids (your models' largest context window) can need ({limit} bytes at {TOKEN_ID_BYTES} "
                       "bytes per id). Send the ids without padding.", "invalid_request_error", "prompt",
                       "request_too_large")


_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder(parse_int=bounded_int, parse_constant=not_a_number)


def _top_level_ids(text: str) -> tuple[int, int] | None:
    """Where the array of the body's own top-level `"prompt"` key (the last one, as the parse
    keeps) lies between its brackets, if it is a flat array (token ids); None if there is
    none or the body is malformed (the parser says so). A walk of the top-level object at C
    speed, in one pass: keys by json's string scanner, other fields' values by its decoder
    (no more than the parse does with them), a flat array by its closing bracket. A `prompt`
    key nested in another field, or text that reads `"prompt": [`, is not the prompt."""
    found = None
    try:
        i = _SPACE.match(text).end()
        if text[i:i + 1] != "{":
            return None
        i = _SPACE.match(text, i + 1).end()
        if text[i:i + 1] == "}":
            return None
        while text[i:i + 1] == '"':
            key, i = scanstring(text, i + 1)
            i = _SPACE.match(text, i).end()
            if text[i:i + 1] != ":":
                return None
            i = _SPACE.match(text, i + 1).end()
            end = text.find("]", i) if key == "prompt" and text[i:i + 1] == "[" else -1
            if end >= 0 and all(text.find(c, i + 1, end) < 0 for c in '[{"'):
                found, i = (i + 1, end), end + 1
            else:
                found = None if key == "prompt" else found
                i = _DECODER.raw_decode(text, i)[1]
            i = _SPACE.match(text, i).end()
            if text[i:i + 1] == "}":
                return found
            if text[i:i + 1] != ",":
                return None
            i = _SPACE.match(text, i + 1).end()
    except (ValueError, RecursionError):  # malformed, a long integer, NaN, too deep: the parser says so
        return None
    return None


MAX_TOKEN_BYTES = 256  # no token of a GGUF or Hugging Face vocabulary is longer (Llama/Qwen: 16-128 bytes)


JSON_ESCAPE = 6  # JSON text bytes per UTF-8 byte of a string at most ("\u0001" for one byte)
BODY_SLACK = 64 * 1024  # the request's other fields


def _body_cap(svc: Service, tenant: str) -> tuple[int, ApiError] | None:
    """413 before reading a body that no prompt for the tenant's models could need: the
    largest window's bytes (_check_prompt_bytes) escaped in JSON at worst, plus the other
    fields. An 8 MiB prompt for a 4096-token model is refused from its Content-Length (or
    while a chunked one arrives), not read and parsed first."""
    limit = svc.registry.max_context_length(tenant) * MAX_TOKEN_BYTES * JSON_ESCAPE + BODY_SLACK
    if limit >= svc.config.max_body_bytes:
        return None
    return limit, ApiError(413, f"The request body exceeds {limit} bytes, more than a prompt for any of your models "
                           f"can need (their largest context window at {MAX_TOKEN_BYTES} bytes per token, escaped "
                           "in JSON). Shorten the prompt.", "invalid_request_error", None, "request_too_large")


def _check_prompt_bytes(req: GenerationRequest, model: ModelRecord) -> None:
    """400 for a prompt whose text could not fit the context window even at the longest
    token's bytes per token: refused before tokenizing, which costs CPU on the node."""
    limit = model.context_length * MAX_TOKEN_BYTES
    size = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in req.messages or ()) + len(
        (req.prompt or "").encode("utf-8", "surrogatepass"))
    if size > limit:  # token ids are counted exactly later, without a tokenizer
        raise ApiError(400,
                       f"The prompt is {size} bytes of text; this model's context window of {model.context_length} "
                       f"tokens holds at most {model.context_length} tokens (about {limit} bytes at {MAX_TOKEN_BYTES} "
                       "bytes per token at most). Shorten the prompt.", "invalid_request_error",
                       "messages" if req.kind == "chat" else "prompt", "context_length_exceeded")


async def _placed(svc: Service, request: web.Request, req: GenerationRequest, tenant: str,
                  model: ModelRecord, adapter: AdapterRecord | None) -> web.StreamResponse:
    prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
    temperature, top_p = resolve_sampling(req.temperature, req.top_p, model.sampling_defaults)
    sampling = Sampling(max_tokens=req.max_tokens or 0, temperature=temperature, top_p=top_p, stop=req.stop,
                        seed=req.seed, ignore_eos=req.ignore_eos, logprobs=req.logprobs,
                        top_logprobs=req.top_logprobs,
                        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                        repetition_penalty=req.repetition_penalty, json_schema=req.json_schema)
    sampling = with_adapter(sampling, adapter)
    request_id = prefix + secrets.token_hex(12)
    schema_param = "tool_choice" if req.tools is not None and req.tools.constrained else "response_format"
    jobs = [Job(request_id=request_id if req.n == 1 else f"{request_id}-{i}", model=model,
                arrival_s=request[ARRIVAL], sampling=_sibling(sampling, i), messages=req.messages, prompt=req.prompt,
                prompt_token_ids=req.prompt_token_ids, schema_param=schema_param, tenant=tenant) for i in range(req.n)]
    svc.begin_generation()
    try:
        try:
            streams = await _submit(svc, jobs)
        except ApiError as exc:
            outcome = "rejected" if exc.status == 429 else ("failed" if exc.status >= 500 else "invalid")
            svc.metrics.request_done(tenant, req.model, outcome, placed=exc.status == 429)
            raise
        except asyncio.CancelledError:
            svc.metrics.request_done(tenant, req.model, "aborted")
            raise
        answer = _Answer(svc, request, req, model, jobs[0], streams, request_id)
        try:
            if req.stream:
                return await answer.sse()
            return await answer.whole()
        finally:
            for stream in streams:
                stream.abort()  # no-op once finished; stops generation if the client went away
            answer.record()
    finally:
        svc.end_generation()


def _sibling(sampling: Sampling, index: int) -> Sampling:
    """The sampling of choice `index` of a request with n > 1: its own seed where the request
    gives one (seed + index), so seeded choices differ and repeat."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + index) % 2**63)


async def _submit(svc: Service, jobs: list[Job]) -> list[RequestStream]:
    """Place every choice's request (n > 1: n sibling requests, each placed, validated and
    counted on its own; the first is tokenized, the others carry its token ids); if one cannot
    be placed, the others are stopped and its error is raised."""
    first = await svc.control.submit(jobs[0])
    if len(jobs) == 1:
        return [first]
    ids = first.prompt_token_ids  # tokenized once: the other choices carry its ids
    tasks = [asyncio.ensure_future(svc.control.submit(replace(job, prompt_token_ids=ids) if ids else job))
             for job in jobs[1:]]
    try:
        return [first, *await asyncio.gather(*tasks)]
    except BaseException:
        first.abort()
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                task.result().abort()
        raise


class _Answer:
    """One placed request's response (its n choices), and its metrics once it ends."""

    def __init__(self, svc: Service, request: web.Request, req: GenerationRequest, model: ModelRecord, job: Job,
                 streams: list[RequestStream], request_id: str | None = None) -> None:
        self.svc, self.request, self.req, self.model, self.job, self.streams = svc, request, req, model, job, streams
        self.request_id = request_id or job.request_id
        self.created = svc.unix_now()
        self.tokens_out = [0] * len(streams)  # per choice
        self.finishes: list[Finished | None] = [None] * len(streams)
        self.outcome = "aborted"
        self.end_s: float | None = None
        # per choice: a token chunk's bytes before and after its text
        self._templates: dict[int, tuple[bytes, bytes]] = {}
        self._offsets = [0] * len(streams)  # per choice: the text sent so far (completions' text_offset)
        self._first = [True] * len(streams)  # per choice: no chunk streamed yet
        # per choice: the streamed text through the tool parser (chat with tools)
        self._filters = [CallFilter(req.tools) for _ in streams] if req.tools is not None else None

    @property
    def finish(self) -> Finished | None:
        return self.finishes[0]

    async def _events(self) -> AsyncIterator[list[tuple[int, Tokens | Finished]]]:
        """The choices' events as they arrive, each time as many as wait, tagged with their
        choice's index; an ApiError of any choice is raised (the others are stopped by the caller)."""
        if len(self.streams) == 1:
            async for batch in self.streams[0].batches():
                yield [(0, event) for event in batch]
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for batch in stream.batches():
                    queue.put_nowait((index, batch, None))
            except ApiError as exc:
                queue.put_nowait((index, None, exc))

        pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(self.streams)]
        try:
            left = len(pumps)
            while left:
                index, batch, error = await queue.get()
                if error is not None:
                    raise error
                left -= sum(1 for event in batch if isinstance(event, Finished))
                yield [(index, event) for event in batch]
        finally:
            for task in pumps:
                task.cancel()

    # ---- whole response ---------------------------------------------------------------------
    async def whole(self) -> web.Response:
        parts: list[list[str]] = [[] for _ in self.streams]
        logprobs: list[list[tuple[str, TokenLogprob]]] = [[] for _ in self.streams]
        try:
            async for batch in self._events():
                for index, event in batch:
                    if isinstance(event, Tokens):
                        parts[index].append(event.text)
                        logprobs[index] += _entries(event)
                        self.tokens_out[index] += max(1, len(event.token_ids))
                    else:
                        self._finished(index, event)
        except ApiError:
            self.outcome = "failed"
            raise
        choices = []
        for index, finish in enumerate(self.finishes):
            text = "".join(parts[index])
            lp = self._logprobs(index, logprobs[index]) if self.req.logprobs else None
            if self.req.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                reason = finish.reason
                if self.req.tools is not None:
                    content, calls = parse_calls(text, self.req.tools)
                    if calls:
                        message = {"role": "assistant", "content": content,
                                   "tool_calls": [c.message() for c in calls]}
                        reason = "tool_calls"
                choices.append({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": finish.reason})
        obj = "chat.completion" if self.req.kind == "chat" else "text_completion"
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.req.model,
                "system_fingerprint": None, "choices": choices, "usage": self._usage()}
        return web.json_response(body)

    def _logprobs(self, index: int, entries: list[tuple[str, TokenLogprob]]) -> dict[str, Any]:
        """A choice's `logprobs` object for `entries` (token text, its log probabilities), as
        OpenAI shapes it: chat's `content` list (each entry's `top_logprobs` the alternatives,
        most likely first); completions' parallel lists, offsets into the choice's text, and
        `top_logprobs` one {text: log probability} per token where alternatives were asked for.
        A token's text is what it added to the output (empty where a character spans tokens or
        a possible stop string is held back, the text then comes with a later token); an
        alternative's text is that token's own, decoded alone."""
        if self.req.kind == "chat":
            return {"content": [{"token": t, "logprob": lp.logprob, "bytes": _bytes(t),
                                 "top_logprobs": [{"token": a, "logprob": v, "bytes": _bytes(a)} for a, v in lp.top]}
                                for t, lp in entries]}
        offsets = []
        for t, _ in entries:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(t)
        tops = [dict(lp.top) for _, lp in entries] if self.req.top_logprobs else None
        return {"tokens": [t for t, _ in entries], "token_logprobs": [lp.logprob for _, lp in entries],
                "top_logprobs": tops, "text_offset": offsets}

    # ---- streaming --------------------------------------------------------------------------
    async def sse(self) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(self.request)
        try:
            async for batch in self._events():  # what arrived together goes out in one write
                out = [chunk for index, event in batch for chunk in self._sse_chunks(index, event)]
                if out:
                    await response.write(b"".join(out))
        except ApiError as exc:
            self.outcome = "failed"
            try:
                await response.write(exc.sse())
            except (ConnectionError, RuntimeError):
                pass
        except (ConnectionError, RuntimeError):  # the client went away mid-stream
            self.outcome = "aborted"
            return response
        try:
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return response

    def _sse_chunks(self, index: int, event: Tokens | Finished) -> list[bytes]:
        """What one event of choice `index` sends: its text (chat with tools: what the tool
        parser lets out, mesh.service.tool_calls), and at its end the rest, the tool calls, its
        finish_reason, and after the last choice's end the usage and [DONE]."""
        out = []
        first = self._first[index]
        if isinstance(event, Tokens):
            self.tokens_out[index] += max(1, len(event.token_ids))
            entries = _entries(event) if self.req.logprobs else []
            text = self._filters[index].feed(event.text) if self._filters else event.text
            if entries or first:
                out.append(self._chunk(text, None, first, index, entries))
            elif text:
                out.append(self._text_chunk(text, index))
            self._first[index] = False
            return out
        self._finished(index, event)
        reason = event.reason
        if self._filters:
            rest, calls = self._filters[index].end()
            if rest or calls:
                out.append(self._chunk(rest, None, first, index, calls=calls))
                first = self._first[index] = False
            reason = "tool_calls" if calls else reason
        out.append(self._chunk("", reason, first, index))
        if all(f is not None for f in self.finishes):
            if self.req.include_usage:
                out.append(self._usage_chunk())
            out.append(b"data: [DONE]\n\n")
        return out

    def _text_chunk(self, text: str, index: int = 0) -> bytes:
        """`_chunk(text, None, False, index)`, from a template made once per choice: only the
        text is encoded per token (json.dumps of the whole chunk was about a tenth of the
        service's CPU under load)."""
        template = self._templates.get(index)
        if template is None:
            marker = "\ue000mesh-text\ue000"  # a private-use character: no token text is this
            whole = self._chunk(marker, None, False, index)
            quoted = json.dumps(marker, ensure_ascii=False).encode()
            if whole.count(quoted) != 1:  # cannot happen (ids and names are plain); be safe
                return self._chunk(text, None, False, index)
            template = self._templates[index] = tuple(whole.split(quoted))
        head, tail = template
        return head + encode_basestring(text).encode() + tail

    def _chunk(self, text: str, finish_reason: str | None, first: bool, index: int = 0,
               entries: list[tuple[str, TokenLogprob]] | None = None, calls: list[ToolCall] | None = None) -> bytes:
        """One chunk of choice `index`: its text (chat: the first carries the role), log
        probabilities, tool calls (each whole, as OpenAI's SDK accumulates them by index), or
        its finish_reason (chat: an empty delta)."""
        logprobs = self._logprobs(index, entries) if entries else None
        if self.req.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not first:
                delta = {}
            if calls:
                delta["tool_calls"] = [call.delta(i) for i, call in enumerate(calls)]
                if not text:
                    delta["content"] = None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "text_completion"
        chunk: dict[str, Any] = {"id": self.request_id, "object": obj, "created": self.created,
                                 "model": self.req.model, "system_fingerprint": None, "choices": [choice]}
        if self.req.include_usage:
            chunk["usage"] = None
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()

    def _usage_chunk(self) -> bytes:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        chunk = {"id": self.request_id, "object": obj, "created": self.created, "model": self.req.model,
                 "system_fingerprint": None, "choices": [], "usage": self._usage()}
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def _choice_tokens(self, index: int) -> int:
        finish = self.finishes[index]
        return finish.tokens_out if finish is not None and finish.tokens_out else self.tokens_out[index]

    def _usage(self) -> dict[str, int]:
        """The prompt once, the completion tokens of every choice (as OpenAI counts n)."""
        prompt = self.streams[0].prompt_tokens
        done = sum(self._choice_tokens(i) for i in range(len(self.streams)))
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _finished(self, index: int, event: Finished) -> None:
        self.finishes[index] = event
        if all(f is not None for f in self.finishes):
            self.outcome = "completed"
            self.end_s = asyncio.get_running_loop().time()

    # ---- metrics ----------------------------------------------------------------------------------
    def record(self) -> None:
        firsts = [s.first_token_s for s in self.streams if s.first_token_s is not None]
        first = min(firsts) if firsts else None
        ttft = first - self.job.arrival_s if first is not None else None
        out = sum(self._choice_tokens(i) for i in range(len(self.streams)))
        longest = max(self._choice_tokens(i) for i in range(len(self.streams)))
        tpot = None
        if self.end_s is not None and first is not None and longest >= 2:
            tpot = (self.end_s - first) / (longest - 1)
        slo = self.model.slo
        met = self.outcome == "completed" and ttft is not None and slo.met(self.streams[0].prompt_tokens, ttft, tpot)
        self.svc.metrics.request_done(
            self.job.tenant, self.req.model, self.outcome, prompt_tokens=self.streams[0].prompt_tokens,
            tokens_out=out, ttft_s=ttft, tpot_s=tpot if tpot is not None and math.isfinite(tpot) else None,
            slo_met=met, placed=True)


def _bytes(text: str) -> list[int]:
    """A token text's UTF-8 bytes, as OpenAI's logprobs entries give them."""
    return list(text.encode("utf-8", "surrogatepass"))


def _entries(event: Tokens) -> list[tuple[str, TokenLogprob]]:
    """(token text, log probabilities) of an event's tokens: its text goes with its first token."""
    if not event.logprobs:
        return []
    return [(event.text if i == 0 else "", lp) for i, lp in enumerate(event.logprobs)]
