"""Latency SLOs (LLM-Mesh 2.1 and 8.1): TTFT max(2, L/512) s, TPOT 0.25 s."""
from __future__ import annotations

from dataclasses import dataclass


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
