"""The requests a node agent serves, between its control connection and its token-level
loop: admission (validate + admit in one step of the loop, so it is atomic with respect to
the node's state), shadow validation for the cluster dispatcher, taking a request back
with its progress, aborts, and the events a request's life sends (tokens, done, evicted).

Times cross the connection as ages (seconds ago): the two processes' clocks are never
compared.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from mesh.engines.engine_api import EngineError, EngineRequest, Sampling
from mesh.node.control_connection import Refused
from mesh.node.instance_host import InstanceHost
from mesh.node.runtime import NodeRuntime
from mesh.policy.admission import InstancePlan
from mesh.policy.shadow import FailureCase
from mesh.wire.agent_protocol import (
    Admit,
    AdmitEntry,
    AdmitReply,
    AdmitResult,
    Code,
    DoneEvent,
    Event,
    EvictedEvent,
    InstanceSpec,
    Probe,
    Progress,
    TakeBack,
    TokensEvent,
    Validate,
    ValidateGroup,
    ValidateNew,
    ValidationReply,
    tokens_item,
)
from mesh.wire.served_request import Outcome, ServedRequest


class NodeRequests:
    """The requests running on one node, as the control service placed them."""

    def __init__(self, node: NodeRuntime, host: InstanceHost, send: Callable[[Event], None]) -> None:
        self.node = node
        self.host = host
        self.send = send
        self.requests: dict[str, ServedRequest] = {}
        node.on_evict = self._on_evict

    # ---- admission -----------------------------------------------------------------------
    def admit(self, m: Admit) -> AdmitReply:
        refused: dict[str, str] = {}  # instance -> why an earlier request was refused this round
        return AdmitReply([self._admit_one(entry, refused) for entry in m.requests])

    def _admit_one(self, entry: AdmitEntry, refused: dict[str, str]) -> AdmitResult:
        rid, iid, done, prompt_len = entry.request_id, entry.instance_id, entry.done, entry.prompt_len
        node_id = self.host.spec.node_id
        inst = self.node.instances.get(iid)
        if inst is None:
            return AdmitResult(False, Code.NO_INSTANCE.value, f"no instance {iid} on {node_id}")
        if rid in self.requests:
            return AdmitResult(False, Code.BAD_REQUEST.value, f"request {rid} is already running")
        if iid in refused:  # an earlier request of this round was refused: keep arrival order
            return AdmitResult(False, Code.REFUSED.value, refused[iid])
        if inst.batch_size >= getattr(inst.engine, "max_batch", 1 << 30):
            refused[iid] = f"instance {iid} runs its maximum batch of {inst.batch_size}"
            return AdmitResult(False, Code.BATCH_FULL.value, refused[iid])
        req = ServedRequest(EngineRequest(rid, prompt_len, entry.sampling, entry.prompt_token_ids), inst.model,
                            _since(entry.age_s), inst.slo, on_output=self._on_output, on_done=self._on_done,
                            tokens_out=done, first_token_s=_since(entry.first_token_age_s), late_s=entry.late_s,
                            best_effort=entry.best_effort)
        if prompt_len + done + 1 > inst.engine.context_window:
            return AdmitResult(False, Code.BAD_REQUEST.value, f"prompt of {prompt_len + done} tokens exceeds the "
                               f"context window of {inst.engine.context_window}")
        admission = self.node.admission.validate(iid, req, compute=entry.compute)
        if not admission.ok:
            reason = admission.reason()
            if not _only_own_prefill_late(admission):
                # The node is full for this instance: later requests wait behind this one.
                # A request refused only because its own first token would be late does not
                # block the rest: one with more slack may still fit.
                refused[iid] = reason
            return AdmitResult(False, Code.REFUSED.value, reason)
        try:
            self.node.admit(iid, req, admission)
        except EngineError as exc:
            return AdmitResult(False, Code.BAD_REQUEST.value, str(exc))
        self.requests[rid] = req
        return AdmitResult(True)

    # ---- the cluster dispatcher's verbs (mesh.control.cluster_node) -------------------------
    @staticmethod
    def _probe(probe: Probe, slo: Any) -> ServedRequest:
        """A request as validation sees it: its prompt length, output limit, age (time since
        it arrived, the ST of Eq. 1) and the tokens it already produced elsewhere."""
        req = ServedRequest(EngineRequest(probe.request_id, probe.prompt_len, Sampling(max_tokens=probe.max_tokens)),
                            "", _since(probe.age_s), slo, late_s=probe.late_s, best_effort=probe.best_effort)
        req.tokens_out = probe.done
        req.first_token_s = _since(probe.first_token_age_s)
        return req

    def validate(self, m: Validate) -> ValidationReply:
        """Would the request meet its SLO on the instance, with the instances in `exclude`
        preempted first (shadow validation, 5.3, 6.4, 7.1)? Changes nothing."""
        inst = self.host.instance(m.instance_id)
        exclude = [i for i in m.exclude if i in self.node.instances]
        req = self._probe(m.request, inst.slo)
        return _validation_reply(self.node.admission.validate(inst.instance_id, req, exclude=exclude))

    def validate_group(self, m: ValidateGroup) -> ValidationReply:
        inst = self.host.instance(m.instance_id)
        reqs = [self._probe(r, inst.slo) for r in m.requests]
        return _validation_reply(self.node.admission.validate_group(inst.instance_id, reqs,
                                                                    [r.tokens_out for r in reqs]))

    def validate_new(self, m: ValidateNew) -> ValidationReply:
        """Would a new instance of the planned model, started now with its cold start, serve
        all of `requests`? Times: the plan's profile, else the default for its weights."""
        p = m.plan
        try:
            times = self.host.times_for(InstanceSpec(p.instance_id, p.model, "", p.context_window, profile=p.profile),
                                         p.weight_bytes)
        except EngineError as exc:
            raise Refused(Code.BAD_REQUEST, str(exc)) from exc
        plan = InstancePlan(p.instance_id, p.model, times, p.slo, p.kv_bytes_per_token, p.weight_bytes,
                            p.context_window, p.context_window, p.max_batch,
                            self.host.mean_output(p.model, p.mean_output, keep=False), p.expected_load_s)
        reqs = [self._probe(r, p.slo) for r in m.requests]
        return _validation_reply(self.node.admission.validate_new(plan, reqs, [r.tokens_out for r in reqs]))

    async def take_back(self, m: TakeBack) -> Progress:
        """Take a running request off this node, not ended, with its progress: the tokens
        it produced (all of them, also those it brought here) go back in the reply, so the
        dispatcher can resume it elsewhere (preemption 7.1). No `done` event follows. A
        request whose instance is in the middle of a prefill leaves when that iteration ends."""
        rid, node_id = m.request_id, self.host.spec.node_id
        if rid not in self.requests:
            raise Refused(Code.NO_INSTANCE, f"request {rid} is not on {node_id}")
        req = await self.node.take_back_after_prefill(rid, m.why)
        if req is None:  # it ended while its instance finished the prefill
            raise Refused(Code.NO_INSTANCE, f"request {rid} ended on {node_id} before it could be taken back")
        self.requests.pop(rid, None)
        return _progress(req)

    def abort(self, request_id: str) -> None:
        if request_id in self.requests:
            self.node.abort(request_id, Outcome.FAILED, "aborted by the control service")

    def abort_all(self, why: str) -> None:
        for rid in list(self.requests):
            self.node.abort(rid, Outcome.FAILED, why)

    # ---- request callbacks (called by the node runtime) ------------------------------------
    def _on_output(self, req: ServedRequest, tokens: Any, texts: Any, logprobs: Any) -> None:
        self.send(TokensEvent([tokens_item(req.request_id, list(tokens or ()), "".join(texts or ()), logprobs)]))

    def _on_done(self, req: ServedRequest) -> None:
        self.requests.pop(req.request_id, None)
        inst = self.node.instances.get(req.instance_id or "")
        if inst is not None and req.outcome is Outcome.COMPLETED:
            self.host.live.completed(inst.engine, req)
        self.send(DoneEvent(req.request_id, req.outcome.value if req.outcome else "failed",
                            req.finish_reason.value if req.finish_reason else None, req.detail, req.tokens_out,
                            _finite(req.ttft_s), _finite(req.tpot_s)))

    def _on_evict(self, req: ServedRequest) -> None:
        """The memory subsystem evicted a request (6.4), progress kept: it goes back to the
        control service, whose dispatcher places it on another node (an `evicted` event
        with the tokens it produced; no `done` follows)."""
        self.requests.pop(req.request_id, None)
        self.send(EvictedEvent(req.attempts[-1] if req.attempts else "evicted", _progress(req), req.fault))


def _validation_reply(admission: Any) -> ValidationReply:
    return ValidationReply(admission.ok, admission.reason())


def _progress(req: ServedRequest) -> Progress:
    ids = req.engine_request.prompt_token_ids or []
    produced = list(ids[req.prompt_len:req.prompt_len + req.tokens_out])
    first = req.first_token_s
    return Progress(req.request_id, req.tokens_out, produced,
                    None if first is None else asyncio.get_running_loop().time() - first)


def _only_own_prefill_late(admission: Any) -> bool:
    verdict = admission.compute
    if verdict is None or admission.memory is None or not admission.memory.ok or not verdict.failures:
        return False
    return all(f.case is FailureCase.OWN_PREFILL_LATE for f in verdict.failures)


def _since(age_s: float | None) -> float | None:
    """A time given as an age (seconds ago): the two processes' clocks are never compared."""
    return None if age_s is None else asyncio.get_running_loop().time() - max(0.0, float(age_s))


def _finite(x: float) -> float | None:
    return x if x == x and x not in (float("inf"), float("-inf")) else None
