"""Latency SLOs (LLM-Mesh 2.1 and 8.1): TTFT max(2, L/512) s, TPOT 0.25 s; and the rule that
turns them into per-token deadlines, the one place every scheduler and validator reads.

Deadline rules (`DeadlineRule`). A request that arrived at ST with a prompt of L tokens must
produce its first token by ST + TTFT_SLO(L) under both rules; token i >= 2 is due at

- `eq1` (LLM-Mesh 5.1, Eq. 1): ST + TTFT_SLO(L) + TPOT_SLO * (i - 1). A request whose first
  token came early carries that slack into its later tokens, so it may decode slower than
  TPOT_SLO per token afterwards;
- `pace`: FT + TPOT_SLO * (i - 1), FT the time its first token actually came. Its later
  deadlines run from the first token, so shadow validation protects the pace a client
  measures (mean TPOT from the first token, as OpenAI clients and benchmark tools do).

For a request that already produced tokens and is placed again (preempted, 7.1, or
evicted, 6.4), the next token's deadline is fixed by the same rule from its history; the
prefill that recomputes it on its new instance is not its first token.

`Deadlines` says where a request's deadlines run from (ST): its arrival, moved later when
it is served late or resumed after its node stalled.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_min_s: float = 2.0
    ttft_s_per_prompt_token: float = 1.0 / 512
    tpot_s: float = 0.25

    def __post_init__(self) -> None:
        if self.ttft_min_s <= 0 or self.tpot_s <= 0 or self.ttft_s_per_prompt_token < 0:
            raise ValueError(f"SLO times must be positive, got {self}")

    def ttft_s(self, prompt_len: int) -> float:
        """TTFT SLO for a prompt of `prompt_len` tokens."""
        return max(self.ttft_min_s, prompt_len * self.ttft_s_per_prompt_token)

    def met(self, prompt_len: int, ttft_s: float, tpot_s: float | None) -> bool:
        """TTFT and mean TPOT after the first token (None: fewer than two tokens) within this
        SLO: the strict reading, a request's `slo_met`. Eq. 1's reading, under which an early
        first token's slack may be spent later, is mesh.control.dispatcher.eq1_slo_met."""
        return ttft_s <= self.ttft_s(prompt_len) + 1e-9 and (tpot_s is None or tpot_s <= self.tpot_s + 1e-9)


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Where a request's deadlines run from: its arrival, moved `late_s` later when it is
    served late (its model cold, or it waited past its SLO under a queueing admission) or
    resumed after its node stalled. Its SLO is still judged from arrival. A value, so a
    scheduler tries moved deadlines by passing one rather than changing the request."""

    arrival_s: float
    late_s: float = 0.0

    @property
    def start_s(self) -> float:
        """ST of the deadline rules."""
        return self.arrival_s + self.late_s

    def from_at_least(self, t_s: float) -> "Deadlines":
        """These deadlines running from `t_s` where that is later than where they run now."""
        return Deadlines(self.arrival_s, max(self.late_s, t_s - self.arrival_s))


class DeadlineRule(StrEnum):
    """When a request's tokens after the first are due (module docstring)."""

    EQ1 = "eq1"
    PACE = "pace"

    @classmethod
    def parse(cls, value: "str | DeadlineRule") -> "DeadlineRule":
        """The rule named `value`; ValueError naming the valid ones otherwise."""
        if isinstance(value, DeadlineRule):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(
                f"unknown deadline rule {value!r}; valid: {', '.join(r.value for r in cls)} "
                "(eq1: the paper's Eq. 1, token i due at arrival + TTFT + TPOT (i-1); "
                "pace: token i >= 2 due at first token + TPOT (i-1))"
            ) from None

    def anchor_s(self, ttft_deadline_s: float, first_token_s: float | None) -> float:
        """A: token i >= 2 is due at A + TPOT_SLO * (i - 1). `ttft_deadline_s` is
        ST + TTFT_SLO(L); `first_token_s` the first token's actual time, or None when the
        token just produced is not the request's first (a resumed request: its deadlines
        were set from its history, which `ttft_deadline_s` then carries)."""
        if self is DeadlineRule.PACE and first_token_s is not None:
            return first_token_s
        return ttft_deadline_s

    def token_deadline_s(self, slo: SLO, start_s: float, prompt_len: int, i: int, first_token_s: float | None) -> float:
        """Deadline of token i (1-based) of a request that arrived at `start_s` with a
        prompt of `prompt_len` tokens; `first_token_s`: when its first token came (None:
        not yet, or unknown; only used for i >= 2 under `pace`)."""
        if i < 1:
            raise ValueError(f"tokens are numbered from 1, got {i}")
        ttft_deadline = start_s + slo.ttft_s(prompt_len)
        if i == 1:
            return ttft_deadline
        if self is DeadlineRule.PACE and first_token_s is None:
            raise ValueError("the pace rule needs the first token's time for the deadlines of later tokens")
        return self.anchor_s(ttft_deadline, first_token_s) + slo.tpot_s * (i - 1)

    def resumed(self, slo: SLO, start_s: float, prompt_len: int, done: int,
                first_token_s: float | None) -> tuple[int, float]:
        """(prompt length, ST) under which a request that already produced `done` tokens
        elsewhere is scheduled again (a move or a preemption, 7.1): its prompt plus those
        tokens is prefilled again, and that prefill must end by the deadline of its next
        token under this rule (ST + TTFT + TPOT * O under Eq. 1, FT + TPOT * O under pace).
        For a fresh request (done <= 0): its own prompt and arrival."""
        if done <= 0:
            return prompt_len, start_s
        deadline = self.token_deadline_s(slo, start_s, prompt_len, done + 1, first_token_s)
        prompt = prompt_len + done
        return prompt, deadline - slo.ttft_s(prompt)
