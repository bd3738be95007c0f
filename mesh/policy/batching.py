"""The batching vocabulary that the policy core and every engine share (LLM-Mesh 5.1).

An iteration is a prefill or a decode, never both (`IterationKind`). Every engine follows
the same batching rule, so the compute subsystem can predict it: `prefill_take` is that
rule, the one implementation the simulated engine and the compute subsystem share (the
rule in words: mesh.engines.engine_api). `IterationTimes` is what the policy core needs of an
iteration-time model (the models themselves: mesh.perf), and `extra_s` the one rule for
what an iteration costs beyond its grid time.
"""
from __future__ import annotations

from enum import Enum
from typing import Iterable, Protocol


class IterationKind(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


def prefill_take(prompt_lens: Iterable[int], budget: int, room: float) -> int:
    """How many of the waiting prompts (lengths in arrival order) the next iteration
    prefills: while their tokens fit `budget` (the first always does) and at most `room`
    (max_batch minus the running requests). 0: the next iteration decodes."""
    taken, tokens = 0, 0
    for n in prompt_lens:
        if taken >= room or (taken and tokens + n > budget):
            break
        taken += 1
        tokens += n
    return taken


class IterationTimes(Protocol):
    """Predicted iteration times (a mesh.perf.model.PerformanceModel)."""

    def prefill_s(self, prompt_len: int) -> float: ...

    def decode_s(self, batch: int, avg_context: float) -> float: ...


def extra_s(times: IterationTimes, kind: IterationKind, batch: int, last: tuple[IterationKind, int] | None,
            switched: bool, new_shape: bool = False) -> float:
    """What an iteration costs beyond its grid time (the profile's overheads, mesh-profile/2;
    0 for models without them): every step's overhead; a prefill of a token count the
    instance never prefilled (`new_shape`); a decode right after a prefill of the same
    instance (a new input shape), or whose batch differs from the instance's last decode;
    an iteration of another instance than the node's previous one (`switched`).
    `last`: the instance's previous iteration (kind, batch), None if it has none. The one
    rule the compute subsystem's predictions and the simulated engine share."""
    extra = getattr(times, "step_overhead_s", 0.0)
    if switched:
        extra += getattr(times, "instance_switch_s", 0.0)
    if kind is IterationKind.PREFILL and new_shape:
        extra += getattr(times, "prefill_new_shape_s", 0.0)
    if kind is IterationKind.DECODE and last is not None:
        if last[0] is IterationKind.PREFILL:
            extra += getattr(times, "decode_after_prefill_s", 0.0)
        elif last[1] != batch:
            extra += getattr(times, "decode_batch_change_s", 0.0)
    return extra
