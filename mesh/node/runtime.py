"""The node runtime: one node's compute and memory subsystems driving its engine instances.

An asyncio task runs the token-level loop (LLM-Mesh 5.1): ask the compute subsystem which
instance is most urgent, run one iteration of its engine, apply what it produced, repeat.
The runtime holds two parts: its memory operations (6.3: instances started and stopped,
each operation a task the reservation station starts, mesh.node.memory_operations) and its
admission (shadow validation, 5.3, of a request against an instance before it joins,
mesh.node.shadow_admission); it owns the requests and their moves. Time comes only from the
event loop, so the same code runs live and, on mesh.replay.virtual_loop, in virtual time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from mesh.engines.engine_api import EngineError, EngineRequest, StepResult
from mesh.node.memory_operations import MemoryOperations
from mesh.node.node_instance import NodeInstance
from mesh.node.shadow_admission import ShadowAdmission
from mesh.policy.admission import Admission
from mesh.policy.batching import IterationKind
from mesh.policy.compute import ComputeSubsystem
from mesh.policy.kv_demand import DEFAULT_WATERMARK
from mesh.policy.memory import MemorySubsystem
from mesh.policy.node_spec import NodeSpec
from mesh.policy.shadow import DEFAULT_MARGIN
from mesh.policy.slo import DeadlineRule, Deadlines
from mesh.tasks import cancel_all
from mesh.wire.served_request import Outcome, ServedRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One iteration as it ran (the iteration log): what the engine did (`kind`,
    `batch_size`: requests that got a token) and how long it took, next to what the compute
    subsystem predicted before it ran (`predicted_kind`, `predicted_batch`, `tokens`: prompt
    tokens of a prefill or mean context of a decode, `predicted_s`)."""

    instance_id: str
    kind: IterationKind
    batch_size: int
    start_s: float
    duration_s: float
    predicted_s: float
    tokens: int = 0
    predicted_kind: IterationKind | None = None
    predicted_batch: int = 0


# The engine watchdog (node agents): an iteration that takes this long has hung (a stopped or
# wedged worker): far beyond any prediction, and beyond the pauses a shared machine causes.
HUNG_FACTOR = 20.0  # times the iteration's predicted time
HUNG_MIN_S = 30.0  # and never less than this (the default floor: `mesh serve --watchdog-min-s`)


def hung_bound_s(predicted_s: float, min_s: float = HUNG_MIN_S) -> float:
    """How long an iteration predicted to take `predicted_s` may run before it has hung."""
    return max(min_s, HUNG_FACTOR * predicted_s)


class NodeRuntime:
    """One node: the requests' moves on and off it and the token-level loop, with its memory
    part (`memory_ops`: instances and their memory operations) and its admission part
    (`admission`: shadow validation)."""

    def __init__(
        self,
        spec: NodeSpec,
        *,
        margin: float = DEFAULT_MARGIN,
        watermark: float = DEFAULT_WATERMARK,
        on_evict: Callable[[ServedRequest], None] | None = None,
        record_iterations: bool = False,
        deadlines: DeadlineRule = DeadlineRule.EQ1,
        watchdog: bool = False,
        hung_min_s: float = HUNG_MIN_S,
    ) -> None:
        """`deadlines`: when a request's tokens after the first are due (mesh.policy.slo):
        the paper's Eq. 1, or `pace` (from the first token), which the service runs.
        `watchdog`: an iteration running past hung_bound_s (at least `hung_min_s`) fails its
        instance, whose requests are evicted with their progress (a node agent's real engines;
        simulated ones never hang)."""
        self.spec = spec
        self.compute = ComputeSubsystem(deadlines)
        self.memory = MemorySubsystem(spec.memory_bytes, watermark)
        self.instances: dict[str, NodeInstance] = {}
        self.on_evict = on_evict
        self.on_loaded: Callable[[str], None] | None = None  # an instance's load completed (its id)
        self.watchdog = watchdog
        self.hung_min_s = hung_min_s
        self.on_hung: Callable[[str, str], None] | None = None  # an instance hung (its id, why): it is gone
        self.iterations: list[IterationRecord] | None = [] if record_iterations else None
        self.on_iteration: Callable[[IterationRecord], None] | None = None  # each record, as it is made
        self.iteration_count = 0
        self.busy_s = 0.0
        self.decode_tokens = 0  # tokens produced by decode iterations (throughput per node)
        self.prefill_tokens = 0  # prompt tokens prefilled
        # Tokens a request produced before this node took it (preempted or evicted
        # elsewhere and rescheduled here, LLM-Mesh 6.4, 7.1); absent for fresh requests.
        self._carried: dict[str, int] = {}
        # Token ids produced here by requests that carry prompt token ids (real engines), so
        # a request taken back can resume elsewhere with prompt + produced ids (recompute).
        self._produced: dict[str, list[int]] = {}
        self.stepping: str | None = None  # the instance whose iteration is in flight
        # Called when an iteration starts (its instance) and ends (None): a node agent tells
        # the control service, whose preemption skips the stepping instance as a replay's does.
        self.on_stepping: Callable[[str | None], None] | None = None
        self._wake = asyncio.Event()
        self._step_ended: list[asyncio.Future] = []  # waiting for the iteration in flight to end
        self._loop_task: asyncio.Task | None = None
        self.crash: BaseException | None = None  # the first exception that ended the token-level loop
        self.memory_ops = MemoryOperations(spec.node_id, self.compute, self.memory, self.instances, self._now,
                                           loaded=self._instance_loaded, failed=self._fail_instance)
        self.admission = ShadowAdmission(self.compute, self.memory, self.instances, self._carried, self._now, margin)

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name=f"node {self.node_id}")
        self._loop_task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The token-level loop ended by an exception (a bug): without this its requests'
        streams would wait for good while the node still answered pings. It is logged, the
        node's requests are evicted as a fault (placed again elsewhere, 6.4), and the loop
        starts again; `failure()` keeps the first crash, which a replay raises."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self.crash = self.crash or exc
        log.error("node %s: its token-level loop crashed; its requests are placed again", self.node_id, exc_info=exc)
        why = f"node {self.node_id}'s token-level loop failed: {exc!r}"
        try:
            self._end_step()
            for inst in list(self.instances.values()):
                for rid in list(inst.requests):
                    try:
                        self.evict(rid, why, fault=True)
                    except Exception:  # noqa: BLE001 - the state is suspect: fail it rather than leave it waiting
                        log.exception("node %s: evicting %s failed", self.node_id, rid)
                        self.abort(rid, Outcome.FAILED, why)
        finally:
            self.start()

    async def stop(self) -> None:
        await cancel_all([self._loop_task, *self.memory_ops.tasks])

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    @property
    def deadlines(self) -> DeadlineRule:  # when a request's tokens after the first are due (mesh.policy.slo)
        return self.compute.deadlines

    def failure(self) -> BaseException | None:
        """The first exception that ended the token-level loop (restarted since), if any."""
        return self.crash

    # -- requests ------------------------------------------------------------------
    def admit(self, instance_id: str, req: ServedRequest, admission: Admission) -> None:
        """Add a validated request to the instance (engine, compute and memory state). A
        request that already produced `req.tokens_out` tokens elsewhere resumes here."""
        inst = self.instances[instance_id]
        done = req.tokens_out
        prompt, start = req.resumed(done, self.deadlines)
        er = _resumed_engine_request(req, done)
        if inst.loaded:
            inst.engine.add_request(er)  # raises EngineError before any state changes
        else:
            inst.deferred[req.request_id] = er
        if admission.memory is not None and admission.memory.kv_bytes is not None:
            issued = self.memory.resize_kv(instance_id, admission.memory.kv_bytes)
            self.memory_ops.launch(issued.started)
        self.compute.add_request(instance_id, req.request_id, prompt, start, resumed=done > 0)
        if done > 0:
            self._carried[req.request_id] = done
        inst.requests[req.request_id] = req
        req.node_id, req.instance_id = self.node_id, instance_id
        self._wake.set()

    def try_admit(self, instance_id: str, req: ServedRequest, *, compute: bool = True,
                  deadlines: Deadlines | None = None) -> Admission:
        """Validate and admit in one step; `deadlines`: validated with these in place of the
        request's own, which it keeps if admitted (served late)."""
        admission = self.admission.validate(instance_id, req, compute=compute, deadlines=deadlines)
        if admission.ok:
            if deadlines is not None:
                req.late_s = deadlines.late_s
            self.admit(instance_id, req, admission)
        return admission

    def abort(self, request_id: str, outcome: Outcome, detail: str) -> ServedRequest | None:
        """Take a request off this node (client gone, eviction, failure)."""
        req = self._detach(request_id)
        if req is not None:
            req.end(outcome, self._now(), detail)
        return req

    def _detach(self, request_id: str) -> ServedRequest | None:
        r = self.compute.requests.get(request_id)
        if r is None:
            return None
        inst = self.instances[r.instance_id]
        if inst.deferred.pop(request_id, None) is None:
            inst.engine.abort(request_id)
        self.compute.remove_request(request_id)
        self._carried.pop(request_id, None)
        self._produced.pop(request_id, None)
        req = inst.requests.pop(request_id)
        if not inst.requests:
            inst.idle_since = self._now()
        return req

    def progress(self, request_id: str) -> int:
        """Tokens the request has produced so far (on this node and before)."""
        return self._carried.get(request_id, 0) + self.compute.tokens_out(request_id)

    def can_take_back(self, instance_id: str) -> bool:
        """Requests can leave an instance at any time but during its prefill iteration (the
        engine has taken them into a batch whose result is still to be applied)."""
        flight = self.compute.in_flight
        return not (flight is not None and flight.instance_id == instance_id and flight.kind is IterationKind.PREFILL)

    def _tell_stepping(self, instance_id: str | None) -> None:
        """on_stepping, which must never stop the token-level loop (a node agent's report)."""
        if self.on_stepping is not None:
            try:
                self.on_stepping(instance_id)
            except Exception:  # noqa: BLE001 - a report failed; the node goes on
                log.exception("node %s: the stepping report failed", self.node_id)

    def _end_step(self) -> None:
        self.stepping = self.compute.in_flight = None
        self._tell_stepping(None)
        waiters, self._step_ended = self._step_ended, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def take_back_after_prefill(self, request_id: str, why: str) -> ServedRequest | None:
        """take_back, once the request's instance is not in the middle of a prefill (it waits
        for that iteration to end, milliseconds to a second, rather than refuse): a node
        agent's take-back cannot be atomic with the dispatcher's choice of victims, as it is
        in a replay, which never picks the stepping instance (7.1). None: the request is not
        here (any more)."""
        while True:
            r = self.compute.requests.get(request_id)
            if r is None:
                return None
            if self.can_take_back(r.instance_id):
                return self.take_back(request_id, why)
            waiter = asyncio.get_running_loop().create_future()
            self._step_ended.append(waiter)
            await waiter

    def take_back(self, request_id: str, why: str) -> ServedRequest | None:
        """Take a request off this node to be rescheduled elsewhere (preemption 7.1,
        eviction 6.4), keeping its progress: `tokens_out` becomes the tokens it produced so
        far, and its first-token time stays. It is not ended; the caller places it."""
        r = self.compute.requests.get(request_id)
        if r is None:
            return None
        if not self.can_take_back(r.instance_id):
            raise ValueError(f"request {request_id!r}: its instance {r.instance_id} is in the middle of a prefill")
        done = self.progress(request_id)
        produced = self._produced.get(request_id)
        carried = self._carried.get(request_id, 0)
        req = self._detach(request_id)
        er = req.engine_request
        if produced is not None and er.prompt_token_ids is not None:
            kept = list(er.prompt_token_ids[: er.prompt_len + carried]) + produced
            req.engine_request = dataclasses.replace(er, prompt_token_ids=kept)
        req.tokens_out = done
        req.attempts.append(f"taken from {self.node_id}/{req.instance_id} after {done} tokens: {why}")
        req.node_id = req.instance_id = None
        return req

    def lose_all(self, why: str) -> list[ServedRequest]:
        """The node is lost (the simulated twin of a node agent that died): the iteration in
        flight gives nothing, every request leaves with the tokens it produced before it
        (`take_back`), and every instance goes. Returns the requests, not ended, for the
        dispatcher to place again."""
        if self.stepping is not None:
            self._end_step()
        taken = [self.take_back(rid, f"lost: {why}") for inst in list(self.instances.values())
                 for rid in list(inst.requests)]
        for instance_id in list(self.instances):
            self.memory_ops.stop_instance(instance_id)
        return [req for req in taken if req is not None]

    def evict(self, request_id: str, why: str, fault: bool = False) -> None:
        """Evict and reschedule (6.4); without a dispatcher to take it, the request fails.
        The request keeps its progress (see take_back). `fault`: the node failed it (a hung
        engine), so its deadlines restart where it is placed again (ServedRequest.fault)."""
        req = self.take_back(request_id, f"evicted: {why}")
        if req is None:
            return
        req.evictions += 1
        req.fault = fault
        if self.on_evict is not None:
            self.on_evict(req)
        else:
            req.end(Outcome.FAILED, self._now(), why)

    def _hung(self, inst: NodeInstance, why: str) -> None:
        """The watchdog fired: the instance's requests are evicted with their progress, to be
        placed again (6.4), and the instance goes: its engine's worker is killed at once (a
        stopped process answers no shutdown), and a new instance starts where one is needed."""
        log.error("instance %s: %s", inst.instance_id, why)
        for rid in list(inst.requests):
            self.evict(rid, why, fault=True)
        if self.on_hung is not None:
            self.on_hung(inst.instance_id, why)
        kill = getattr(inst.engine, "kill_worker", None)
        if kill is not None:  # a stopped worker would not answer the unload's shutdown: killed now
            try:
                kill()
            except Exception:  # noqa: BLE001 - the unload below still ends it
                log.exception("instance %s: killing its hung worker failed", inst.instance_id)
        self.memory_ops.stop_instance(inst.instance_id)

    def worker_stuck(self, instance_id: str, why: str) -> bool:
        """The instance's worker is stuck outside an iteration (its tokenizer answered no call
        by the job's deadline: mesh.node.tokenizers): the watchdog's path (`_hung`), now.
        Mid-iteration, the iteration is given up first (its result, if one comes, is dropped:
        the instance is gone), so that its requests, even in a prefill, leave with their
        progress. False: no such instance (it stopped meanwhile)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return False
        if self.stepping == instance_id:
            self._end_step()
        self._hung(inst, why)
        return True

    def _instance_loaded(self, inst: NodeInstance) -> None:
        """Its load ended: the requests admitted meanwhile go to its engine, in order."""
        deferred, inst.deferred = inst.deferred, {}
        for rid, er in deferred.items():
            try:
                inst.engine.add_request(er)
            except EngineError as exc:  # its prompt, checked by the engine only now
                self.abort(rid, Outcome.FAILED, f"{exc}")
        if not inst.requests:
            inst.idle_since = self._now()  # keep-alive counts from when it can serve (LLM-Mesh 4)
        if self.on_loaded is not None:
            self.on_loaded(inst.instance_id)
        self._wake.set()

    def _fail_instance(self, inst: NodeInstance, why: str) -> None:
        for rid in list(inst.requests):
            self.abort(rid, Outcome.FAILED, why)

    # -- the token-level loop ------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        compute = self.compute
        while True:
            it = compute.next_iteration(loop.time())
            if it is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            inst = self.instances[it.instance_id]
            start = loop.time()
            compute.busy_until = start + it.predicted_s
            compute.in_flight = it
            self.stepping = it.instance_id
            self._tell_stepping(it.instance_id)
            try:
                # asyncio.timeout, not wait_for: the step runs in this task, at once (a task of
                # its own would start a loop turn later, after an abort could empty its batch)
                async with asyncio.timeout(hung_bound_s(it.predicted_s, self.hung_min_s) if self.watchdog else None):
                    result = await inst.engine.step()
            except TimeoutError:
                self._end_step()
                self._hung(inst,
                           f"an iteration on node {self.node_id} ran over "
                                 f"{hung_bound_s(it.predicted_s, self.hung_min_s):.0f} s (predicted "
                                 f"{it.predicted_s:.3f} s): its engine hung")
                continue
            except EngineError as exc:
                self._end_step()
                self._fail_instance(inst, f"engine step failed on node {self.node_id}: {exc}")
                continue
            self._end_step()
            now = loop.time()
            self.busy_s += now - start
            self.iteration_count += 1
            if result.kind is IterationKind.DECODE:
                self.decode_tokens += len(result.request_ids)
            else:
                self.prefill_tokens += it.tokens
            if self.iterations is not None or self.on_iteration is not None:
                record = IterationRecord(it.instance_id, result.kind, len(result.request_ids), start, now - start,
                                         it.predicted_s, it.tokens, it.kind, it.batch_size)
                if self.iterations is not None:
                    self.iterations.append(record)
                if self.on_iteration is not None:
                    self.on_iteration(record)
            if self.instances.get(it.instance_id) is not inst:
                continue  # stopped during the iteration (its requests were taken elsewhere)
            self._apply(inst, result, now)
            if getattr(inst.engine, "blocks_event_loop", False):
                # The iteration held the loop (a real engine computes in step() itself):
                # let arrivals, aborts and agent messages in before the next decision.
                # Twice: asyncio's loop appends the timers that fell due during the step to
                # its ready queue after this task's wake-up, so after one yield the node
                # would decide before they ran, and a request that arrived during an
                # iteration would join one iteration later than on the virtual clock
                # (where it arrives during the simulated engine's sleep).
                await asyncio.sleep(0)
                await asyncio.sleep(0)

    def _apply(self, inst: NodeInstance, result: StepResult, now: float) -> None:
        requests = inst.requests
        if result.kind is IterationKind.PREFILL:
            for rid in result.request_ids:
                req = requests.get(rid)
                if req is not None and req.first_token_s is None:
                    req.first_token_s = now
        if result.token_ids is not None or result.texts is not None:
            _stream_tokens(requests, result, self._produced)
        done = []
        for rid, reason in result.finished.items():
            req = requests.pop(rid, None)
            if req is not None:
                req.tokens_out = self._carried.pop(rid, 0) + self.compute.tokens_out(rid) + 1
                self._produced.pop(rid, None)
                done.append((req, reason))
        self.compute.complete_iteration(inst.instance_id, result.kind, result.request_ids, result.finished, now)
        if done:
            for req, reason in done:
                inst.memory.mean_output.add(req.tokens_out)
                req.end(Outcome.COMPLETED, now, reason=reason)
            if requests:
                scale_down = self.memory.lazy_scale_down(inst.instance_id, self.admission.demand(inst.instance_id))
                if scale_down is not None:
                    self.memory_ops.launch(scale_down.started)
            else:
                inst.idle_since = now
        if result.kind is IterationKind.DECODE and requests:
            victim = self.memory_ops.fit_kv(inst)
            if victim is not None:
                self.evict(victim, f"KV cache of {inst.instance_id} outgrew its estimate and node memory is short")

    # -- views ---------------------------------------------------------------------
    def idle(self) -> bool:
        """No instance loading and none holding a request: cycles a background build may use
        (mesh.node.park_ahead, and the twin's, mesh.replay.local_node), until this changes."""
        return all(i.loaded and not i.requests for i in self.instances.values())

    def kv_bytes_in_use(self) -> int:
        return sum(i.engine.kv_bytes_in_use() for i in self.instances.values())

    def queue_length(self) -> int:
        return sum(len(s.pending) for s in self.compute.instances.values())


def _resumed_engine_request(req: ServedRequest, done: int) -> EngineRequest:
    """What the engine is given: the request itself, or, for a resumed request, its
    prompt plus the tokens already produced (recomputed) and the rest to produce.
    Simulated engines need only the lengths; a real engine gets the prompt's token ids
    followed by those the request produced (kept by take_back)."""
    er = req.engine_request
    if done <= 0:
        return er
    sampling = dataclasses.replace(er.sampling, max_tokens=max(1, er.sampling.max_tokens - done))
    out = None if er.output_len is None else max(1, er.output_len - done)
    ids = er.prompt_token_ids  # after take_back: the prompt's ids then the produced ones
    ids = list(ids[: er.prompt_len + done]) if ids is not None and len(ids) >= er.prompt_len + done else None
    return EngineRequest(er.request_id, er.prompt_len + done, sampling, ids, out, done if ids is not None else 0)


def _stream_tokens(requests: dict[str, ServedRequest], result: StepResult, produced: dict[str, list[int]]) -> None:
    """Each token of the iteration to its request's `on_output`; the ids kept in `produced`
    for requests that carry prompt token ids (a real engine's: NodeRuntime.take_back)."""
    for i, rid in enumerate(result.request_ids):
        req = requests.get(rid)
        if req is not None and result.token_ids is not None and req.engine_request.prompt_token_ids is not None:
            produced.setdefault(rid, []).append(result.token_ids[i])
        if req is not None and req.on_output is not None:
            tokens = None if result.token_ids is None else result.token_ids[i : i + 1]
            texts = None if result.texts is None else result.texts[i : i + 1]
            logprobs = None if result.logprobs is None else result.logprobs[i : i + 1]
            req.on_output(req, tokens, texts, logprobs)
