"""The service's request path: a request placed, streamed and cancelled.

`RequestPath.submit`

1. tokenizes the prompt on a node agent (one with a loaded instance of the model, else the
   one that described it: mesh.service.model_catalogue), so the prompt length is known
   before placement: over the context window is a 400;
2. submits the request to the cluster dispatcher (mesh.control.dispatcher): placed on an
   instance whose shadow validation passes (a new instance's cold start counted in its TTFT,
   LLM-Mesh 4, 5.3), with preemption and bin-packing under Mesh (7.1, 7.2), or waiting in
   the bounded queue with the replay's expiry rules and its per-tenant fair share
   (mesh.policy.queueing);
3. streams its tokens back (`RequestStream`). A request turned away before its first token
   raises a 429 with the reason and a Retry-After (the time left of a cold start under way
   for its model, else 1 s); one that fails after it started ends its stream with an error
   event. A request moved to another node (preemption, eviction, 6.4) keeps its stream:
   it resumes where it stopped.

The dispatcher and its policy decide; this module turns their outcome into the HTTP
layer's stream and errors (mesh.service.errors, mesh.service.streams).
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import replace
from typing import Any

from mesh.control.agent_client import AgentCallError, AgentDown
from mesh.control.cluster_node import LOSS_CAUSES
from mesh.control.dispatcher import Dispatcher
from mesh.control.fleet import Fleet
from mesh.control.supervisor import AgentHandle
from mesh.engines.engine_api import EngineRequest
from mesh.modelfiles.formats import ENGINE_FEATURES, engine_for, unhonoured
from mesh.service.errors import bad_request, context_too_long, max_tokens_too_large, node_unavailable, overloaded
from mesh.service.model_catalogue import DescribedModel, ModelCatalogue
from mesh.service.preparation import FormatPreparer
from mesh.service.streams import Finished, Job, RequestStream, Tokens
from mesh.wire.agent_protocol import Abort, Code, Tokenize
from mesh.wire.served_request import Outcome, ServedRequest

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0


class RequestPath:
    def __init__(self, cluster: Fleet, dispatcher: Dispatcher, catalogue: ModelCatalogue,
                 agents: dict[str, AgentHandle], formats: FormatPreparer | None) -> None:
        self.cluster = cluster
        self.dispatcher = dispatcher
        self.catalogue = catalogue
        self.agents = agents  # node id -> its agent (the node pool's)
        self.formats = formats
        self.placed_by_kind: Counter[str] = Counter()  # requests by the kind of node that first admitted them

    async def submit(self, job: Job) -> RequestStream:
        with self.catalogue.arriving(job.model.uid):
            return await self._submit(job)

    async def _submit(self, job: Job) -> RequestStream:
        if self.formats is not None:
            self.formats.ensure(job.model)  # a model that lacks a format gets it prepared on first use
        self.catalogue.check_servable(job.model)  # none up: a 503 now rather than a wait
        self._check_features(job)
        model, ids = await self._described_and_tokenized(job)
        if job.prompt_token_ids is not None and model.vocab_size is not None:  # the caller's ids, checked here
            bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
            if bad is not None:
                raise bad_request(f"Token id {bad} in 'prompt' is outside the vocabulary of {job.model.name} "
                                  f"(ids 0 to {model.vocab_size - 1}).", "prompt", "invalid_token_id")
        window = job.model.context_length
        if len(ids) + 1 > window:
            raise context_too_long(len(ids), window, "messages" if job.messages is not None else "prompt")
        sampling = job.sampling
        if sampling.max_tokens <= 0:  # not given: up to the context window
            sampling = replace(sampling, max_tokens=window - len(ids))
        elif sampling.max_tokens > window - len(ids):
            raise max_tokens_too_large(sampling.max_tokens, len(ids), window)
        loop = asyncio.get_running_loop()
        stream = RequestStream(job.request_id, len(ids), list(ids), on_abort=self.abort)
        started: asyncio.Future = loop.create_future()  # admitted on a node, or ended before

        def begin(req: ServedRequest) -> None:
            """Admitted (its one admitted event), or ended: the HTTP response starts at the first."""
            if not started.done():
                node = self.cluster.node(req.node_id) if req.node_id in self.cluster.node_seq else None
                self.placed_by_kind[node.kind if node is not None else "unknown"] += 1
                stream.node_id, stream.instance_id = req.node_id or "", req.instance_id or ""
                started.set_result(True)

        def output(req: ServedRequest, token_ids: Any, texts: Any, logprobs: Any) -> None:
            if req.outcome is not None:  # ended (aborted) while it was being placed: stop it there
                if req.node_id is not None:
                    self.cluster.node(req.node_id).abort(req.request_id, "the client went away")
                return
            chosen = None if logprobs is None else list(logprobs)
            stream.push(Tokens("".join(texts or ()), list(token_ids or ()), chosen))

        def done(req: ServedRequest) -> None:
            if req.outcome is Outcome.COMPLETED:
                begin(req)
                stream.push(Finished(req.finish_reason.value if req.finish_reason else "stop", req.tokens_out))
                return
            error = (overloaded(_reason(req.detail), retry_after_s(self.cluster, req.model),
                                self.dispatcher.admission(req))
                     if req.outcome is Outcome.REJECTED else node_unavailable(_reason(req.detail)))
            if started.done():
                stream.push(error)
            else:
                started.set_exception(error)

        req = ServedRequest(EngineRequest(job.request_id, len(ids), sampling, list(ids)), job.model.uid,
                            job.arrival_s, job.model.slo, on_output=output, on_done=done, on_admitted=begin,
                            tenant=job.tenant or job.model.tenant)
        self.dispatcher.submit(req)  # the one record of the request: the dispatcher's, until it ends
        try:
            await asyncio.shield(started)
        except asyncio.CancelledError:
            self.abort(job.request_id)
            raise
        return stream

    def _check_features(self, job: Job) -> None:
        """400 naming the field when no engine of the node kinds that can run the model here
        (the cluster's, where the model has a format for them) honours a field the request uses
        (mesh.modelfiles.formats.ENGINE_FEATURES); the dispatcher places it only on nodes whose
        engine does (Fleet.unable)."""
        features = job.sampling.features()
        if not features:
            return
        runnable = self.catalogue.runnable_kinds(job.model)
        engines = sorted({engine_for(job.model.kind, n.kind) for n in self.cluster.nodes
                          if n.kind in self.dispatcher.policy.kinds and n.kind in runnable})
        left = [unhonoured(e, features) for e in engines]
        if engines and any(not missing for missing in left):
            return
        field = sorted(min(left, key=len) if left else features)[0]
        able = sorted(e for e, honoured in ENGINE_FEATURES.items() if field in honoured)
        param = job.schema_param if field == "response_format" else field  # structured output, asked by this field
        hint = f"Omit '{param}'."
        if field == "top_logprobs":  # alternatives: a chat's `top_logprobs` count, a completion's `logprobs` count
            param = "top_logprobs" if job.messages is not None else "logprobs"
            hint = f"Send '{param}': 0 for each chosen token's log probability alone."
        raise bad_request(f"'{param}' is not supported for model {job.model.name}: the engines that serve it here "
                          f"({', '.join(engines) or 'none'}) do not honour it (only {', '.join(able)} does). "
                          f"{hint}", param, "unsupported_parameter")

    async def _described_and_tokenized(self, job: Job, again: bool = True) -> tuple[DescribedModel, list[int]]:
        """The model as the cluster knows it, and the prompt's ids. An agent that goes down
        while it tokenizes costs a second description on an agent that is up (the catalogue's
        rule: `front_up`) and a second tokenize, not the request."""
        model = await self.catalogue.described(job.model)
        if job.prompt_token_ids is not None:
            return model, job.prompt_token_ids
        try:
            return model, await self._tokenize(model, job)
        except AgentDown as exc:
            # up and silent past the call's timeout (no other agent would answer sooner), or down twice
            if not again or self.catalogue.front_up(model):
                raise node_unavailable(str(exc)) from exc
            log.info("request %s: %s went down while tokenizing for %s; described again on an agent that is up",
                     job.request_id, model.front, job.model.name)
        return await self._described_and_tokenized(job, again=False)

    async def _tokenize(self, model: DescribedModel, job: Job) -> list[int]:
        """On an agent with a loaded instance of the model (its engine's tokenizer is built),
        else on the describing agent, which builds the tokenizer alone (once, seconds)."""
        # an abort of the request cancels its tokenize (its client left); the tenant takes its turn there
        text = Tokenize(messages=job.messages, prompt=job.prompt if job.messages is None else None,
                        request_id=job.request_id, tenant=job.model.tenant)
        front = replace(text, model=model.record.uid, path=model.path,
                                    engine=engine_for(model.record.kind, self.cluster.node(model.front).kind),
                                    context_window=model.record.context_length)
        ready = [r for r in self.cluster.instances_of(model.record.uid) if r.node.up and r.inst.loaded]
        tries = [(r.node.node_id, replace(text, instance_id=r.instance_id)) for r in ready[:1]]
        for node_id, message in [*tries, (model.front, front)]:
            agent = self.agents.get(node_id)
            try:
                if agent is None or agent.client is None:
                    raise AgentDown(f"node {node_id} is not connected")
                try:
                    reply = await agent.client.call(message, CALL_TIMEOUT_S)
                except (asyncio.CancelledError, AgentDown):  # the client left (or no answer in time):
                    agent.client.send(Abort(job.request_id))  # its job leaves the queue
                    raise
            except AgentCallError as exc:
                if exc.code in (Code.NO_INSTANCE.value, Code.NOT_READY.value):
                    continue  # the instance left meanwhile: the describing agent tokenizes
                # the agent's text may name server paths: logged, and the tenant told what to do
                log.warning("request %s: tokenizing for %s/%s on %s failed: %s", job.request_id, job.model.tenant,
                            job.model.name, node_id, exc)
                raise bad_request(f"Model {job.model.name} cannot tokenize this "
                                  f"{'conversation' if job.messages is not None else 'prompt'}: its tokenizer or chat "
                                  f"template refused it. Check the input; the operator's log has the detail under "
                                  f"request {job.request_id}.", "messages" if job.messages is not None else "prompt",
                                  "tokenization_failed") from exc
            except AgentDown:
                if node_id != model.front:
                    continue
                raise
            return reply.ids
        raise node_unavailable(f"node {model.front} cannot tokenize for {job.model.name}")

    def abort(self, request_id: str) -> None:
        """The client went away: stop the request wherever it is (waiting, or on a node)."""
        req = self.dispatcher.requests.get(request_id)
        if req is None or req.outcome is not None:
            return
        if req.node_id is not None and req.node_id in self.cluster.node_seq:
            self.cluster.node(req.node_id).abort(request_id, "the client went away")
        else:  # waiting in the dispatcher's queue (it leaves it) or being placed
            req.end(Outcome.FAILED, asyncio.get_running_loop().time(), "aborted: the client went away")

    def waiting(self) -> int:
        """Requests waiting in the dispatcher's queue."""
        return len(self.dispatcher.queue)

    def view(self) -> dict[str, Any]:
        """The dispatcher: its queue, its decisions and their times, what it placed where."""
        d = self.dispatcher
        tenants = Counter(r.tenant for r in d.waiting_requests())
        return {
            "policy": d.policy.name, "waiting": len(d.queue), "in_flight": len(d.requests),
            "waiting_by_tenant": dict(tenants),
            "queue_capacity": d.queue.capacity, "queue_timeout_s": d.queue_timeout_s,
            "admission": self.cluster.config.admission, "placed_by_kind": dict(self.placed_by_kind),
            "placed_at_arrival": d.stats.placed_at_arrival, "placed_from_queue": d.stats.placed_from_queue,
            "preemptions": d.policy.stats.preemptions, "moved_requests": d.policy.stats.preempted_requests,
            "evictions_rescheduled": d.stats.rescheduled, "new_instances": d.policy.stats.new_instances,
            "warm_ups": d.policy.stats.warm_ups, "instances_recycled": self.cluster.instances_recycled,
            "rejected": dict(d.stats.rejected), "failed": dict(d.stats.failed),
            # requests of nodes that were lost, by cause: handed back, placed again, turned away
            "lost": _by_cause(d.stats.lost), "resumed": _by_cause(d.stats.resumed),
            "lost_failed": _by_cause(d.stats.lost_failed),
            "decisions": d.stats.decisions, "decision_s_mean": d.stats.decision_s / max(1, d.stats.decisions),
            "decision_s_max": d.stats.decision_max_s,
            "decision_wait_s_mean": d.stats.decision_wait_s / max(1, d.stats.decisions),
            "decision_times": d.stats.decision_times.snapshot(),  # seconds, log buckets (mesh.control.latency)
        }


def _by_cause(counts: Counter) -> dict[str, int]:
    """Counts by loss cause, every cause listed (mesh.control.cluster_node.LOSS_CAUSES)."""
    return {cause: int(counts[cause]) for cause in LOSS_CAUSES}


def retry_after_s(cluster: Fleet, model_uid: str) -> float:
    """When a turned-away request of this model may do better: once the cold start of an
    instance of it under way ends (the time left of its predicted load), else in a second.
    The header rounds it up to whole seconds, at least 1."""
    left = cluster.cold_start_left_s(model_uid)
    return 1.0 if left is None else left


def _reason(detail: str) -> str:
    """A request's end detail without its outcome prefix ("rejected: queue full: ...")."""
    for prefix in ("rejected: ", "failed: "):
        if detail.startswith(prefix):
            return detail[len(prefix):]
    return detail or "no reason given"
