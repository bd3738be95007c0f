"""KV-cache demand and watermark scaling (LLM-Mesh 6.1, 6.2).

Eq. 2:  M_require = C * max( sum_r (I_r + max(O_r, O_avg)), L_min )

with C the KV bytes per token, I_r and O_r a request's input and produced output lengths,
O_avg the historical mean output length, L_min the model's maximum sequence length.

Watermark w: M_recommend = M_require * (1 + w). Scale up to M_recommend as soon as
M_cur < M_require (early); scale down to M_recommend only when
M_recommend * (1 + w) < M_cur (lazy), to avoid ping-pong under fluctuating load.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

DEFAULT_WATERMARK = 0.2


def kv_require_bytes(bytes_per_token: int, requests: Iterable[tuple[int, int]], mean_output: float, l_min: int) -> int:
    """Eq. 2; `requests` holds (I_r, O_r) pairs."""
    tokens = sum(i + max(o, mean_output) for i, o in requests)
    return int(math.ceil(bytes_per_token * max(tokens, l_min)))


def recommend_bytes(require: int, watermark: float) -> int:
    return int(math.ceil(require * (1.0 + watermark)))


def watermark_target(current: int, require: int, watermark: float) -> int | None:
    """New KV size per 6.2, or None to keep `current`."""
    recommend = recommend_bytes(require, watermark)
    if current < require:
        return recommend
    if recommend * (1.0 + watermark) < current:
        return recommend
    return None


@dataclass(slots=True)
class RunningMean:
    """O_avg: the mean output length seen so far, starting from a prior."""

    prior: float
    count: int = 0
    total: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value

    @property
    def value(self) -> float:
        return self.total / self.count if self.count else self.prior
