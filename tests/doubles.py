"""Test doubles for policy tests: analytic iteration times with round numbers, so the
paper's worked examples can be checked by hand. (Real profiles are tested elsewhere.)"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearTimes:
    prefill_base: float = 0.0
    prefill_per_token: float = 0.001
    decode_base: float = 0.05
    decode_per_request: float = 0.0
    decode_per_context_token: float = 0.0  # per request, per token of average context

    def prefill_s(self, prompt_len: int) -> float:
        return self.prefill_base + self.prefill_per_token * prompt_len

    def decode_s(self, batch: int, avg_context: float) -> float:
        return self.decode_base + self.decode_per_request * batch + self.decode_per_context_token * batch * avg_context
