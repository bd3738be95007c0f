"""A request as the runtime serves it: what it asked for, and what happened to it.

The request record the control service hands a node (the object in process, an Admit entry
through the agent protocol) and whose Outcome comes back (a done event); both sides read it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from mesh.engines.engine_api import EngineRequest, FinishReason, TokenLogprob
from mesh.policy.slo import SLO, DeadlineRule, Deadlines


class Outcome(str, Enum):
    COMPLETED = "completed"
    REJECTED = "rejected"  # never placed: no node could meet its SLO in time
    FAILED = "failed"  # placed, then lost (engine or node failure)


# (request, new token ids, their text, their log probabilities: None where not asked for)
OutputCallback = Callable[["ServedRequest", Sequence[int] | None, Sequence[str] | None,
                           Sequence[TokenLogprob | None] | None], None]
DoneCallback = Callable[["ServedRequest"], None]
AdmittedCallback = Callable[["ServedRequest"], None]


@dataclass(eq=False, slots=True)
class ServedRequest:
    engine_request: EngineRequest
    model: str
    arrival_s: float  # ST in Eq. 1
    slo: SLO
    on_output: OutputCallback | None = None  # every new token (live streaming)
    on_done: DoneCallback | None = None  # once, when the request ends
    # each time a node agent admitted it (its node_id and instance_id say where): the service's
    # stream starts at the first (mesh.service.request_path); replays set none
    on_admitted: AdmittedCallback | None = None
    node_id: str | None = None
    instance_id: str | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    tokens_out: int = 0
    outcome: Outcome | None = None
    finish_reason: FinishReason | None = None
    detail: str = ""  # why it was rejected or failed
    evictions: int = 0  # times the memory subsystem evicted and rescheduled it (6.4)
    tenant: str = ""  # whose share of the waiting queue it counts against ("" : its model's)
    attempts: list[str] = field(default_factory=list)  # what happened to it, for the operator
    waited: bool = False  # it waited in the dispatcher's queue at least once
    # Served late because its model was cold (mesh.policy.dispatch_rules.SERVE_LATE): its deadlines
    # run from arrival + late_s, as if it had arrived when its instance is ready; its SLO is
    # still judged from its arrival (slo_met, ttft_s).
    late_s: float = 0.0
    # Taken off a node that failed (its engine hung, mesh.node.runtime's watchdog), not moved by
    # a decision: the stall was the node's, so when it is placed again its next token is due as
    # if it resumed now (the dispatcher shifts late_s); its SLO is still judged from arrival.
    fault: bool = False
    # Why a node lost it while it held it (its agent died, froze, was removed, lost its network:
    # mesh.control.cluster_node.LOSS_CAUSES), "" if none did.
    lost: str = ""
    # When (the loop's time) a node last handed it back, lost or evicted, None if none did: its
    # stream had started, so placed again with its progress it waits for a node up to the queue
    # timeout (longer while its model loads: dispatch_rules.lost_wait_until), whatever its model's
    # admission choice (the dispatcher).
    handed_back_s: float | None = None
    # Past its SLO and waiting on under a `queue`/`late` admission (a lost request, most often):
    # served late, as soon as it can be. Validation keeps everyone else's deadlines and never
    # refuses it for its own first token being late (mesh.policy.shadow: own_late_ok); else a
    # prefill slower than its TTFT SLO (a loaded machine) is refused everywhere, for good.
    best_effort: bool = False

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    @property
    def prompt_len(self) -> int:
        return self.engine_request.prompt_len

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s if self.first_token_s is not None else math.nan

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (nan with fewer than two tokens)."""
        if self.finish_s is None or self.first_token_s is None or self.tokens_out < 2:
            return math.nan
        return (self.finish_s - self.first_token_s) / (self.tokens_out - 1)

    @property
    def slo_met(self) -> bool:
        """Completed with TTFT and mean TPOT within their SLOs (SLO.met, the strict reading)."""
        return self.outcome is Outcome.COMPLETED and self.slo.met(
            self.prompt_len, self.ttft_s, self.tpot_s if self.tokens_out >= 2 else None)

    @property
    def deadlines(self) -> Deadlines:
        """Where its deadlines run from now."""
        return Deadlines(self.arrival_s, self.late_s)

    def resumed(self, done: int, rule: DeadlineRule, deadlines: Deadlines | None = None) -> tuple[int, float]:
        """(prompt length, ST) under which this request is scheduled after `done` tokens
        produced elsewhere (DeadlineRule.resumed); `deadlines`: tried in place of its own."""
        start_s = (self.deadlines if deadlines is None else deadlines).start_s
        return rule.resumed(self.slo, start_s, self.prompt_len, done, self.first_token_s)

    def end(self, outcome: Outcome, now: float, detail: str = "", reason: FinishReason | None = None) -> None:
        if self.outcome is not None:
            return
        self.outcome, self.finish_s, self.detail, self.finish_reason = outcome, now, detail, reason
        if self.on_done is not None:
            self.on_done(self)
