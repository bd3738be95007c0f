"""The reservation station (LLM-Mesh 6.3): memory operations on one node, out of order
but without hazards.

Every memory operation (model load, unload, KV scale-up, scale-down) changes one holder's
size (an instance: weights plus KV cache) from `old_bytes` to `new_bytes`, and takes time.

- Optimistic budget: the sum of every holder's size after all issued operations. A
  scale-up is admitted only if the budget stays within capacity; a scale-down lowers the
  budget at once, when issued.
- Pessimistic tracking: what may be physically in use. A holder being scaled down counts
  at its old size until the operation completes; a scale-up counts at its new size from
  the moment it starts. A scale-down starts at once; a scale-up starts only if the
  pessimistic total stays within capacity, else it waits here and is retried whenever an
  operation completes.
- Operations on one holder run one at a time, in issue order (a resize never overlaps the
  load it follows).

Invariants (tested with hypothesis): the pessimistic total, an upper bound of physical use,
never exceeds capacity; and no admitted operation waits while it could start.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from enum import Enum


class OpKind(str, Enum):
    LOAD = "load"
    UNLOAD = "unload"
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"


@dataclass(frozen=True, slots=True)
class MemoryOp:
    op_id: int
    holder: str
    old_bytes: int
    new_bytes: int

    @property
    def delta(self) -> int:
        return self.new_bytes - self.old_bytes

    @property
    def kind(self) -> OpKind:
        if self.old_bytes == 0:
            return OpKind.LOAD
        if self.new_bytes == 0:
            return OpKind.UNLOAD
        return OpKind.SCALE_UP if self.delta > 0 else OpKind.SCALE_DOWN


@dataclass(frozen=True, slots=True)
class Issued:
    """Result of issuing an operation."""

    op: MemoryOp | None  # None: refused, the budget has no room
    started: tuple[MemoryOp, ...] = ()  # operations to execute now (this one, if it could start)
    shortfall_bytes: int = 0  # when refused: how much the budget lacks

    @property
    def accepted(self) -> bool:
        return self.op is not None


class ReservationStation:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"node memory capacity must be positive, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self._target: dict[str, int] = {}  # size after all issued ops (optimistic)
        self._physical: dict[str, int] = {}  # size with completed ops only
        self._queues: dict[str, deque[MemoryOp]] = {}  # per holder, issue order; head may run
        self._running: dict[int, MemoryOp] = {}
        self._waiting: dict[int, MemoryOp] = {}  # admitted, not started (issue order)
        self._ids = itertools.count(1)

    # -- views ---------------------------------------------------------------------
    @property
    def budget(self) -> int:
        """Optimistic total: every holder at its size after all issued operations."""
        return sum(self._target.values())

    @property
    def pessimistic(self) -> int:
        """Upper bound of physical use: completed sizes plus running scale-ups."""
        return sum(self._physical.values()) + sum(op.delta for op in self._running.values() if op.delta > 0)

    def size(self, holder: str) -> int:
        """A holder's size after all issued operations."""
        return self._target.get(holder, 0)

    def physical(self, holder: str) -> int:
        return self._physical.get(holder, 0)

    def free(self) -> int:
        """Room left in the optimistic budget."""
        return self.capacity - self.budget

    def can_resize(self, holder: str, new_bytes: int, freed_bytes: int = 0) -> bool:
        """Shadow check (6.4): would resizing `holder` to `new_bytes` be admitted now?
        `freed_bytes`: as if other holders had first released that much (preemption, 7.1)."""
        return self.budget - freed_bytes + new_bytes - self.size(holder) <= self.capacity

    def running(self) -> list[MemoryOp]:
        return list(self._running.values())

    def waiting(self) -> list[MemoryOp]:
        return list(self._waiting.values())

    def busy(self, holder: str) -> bool:
        return bool(self._queues.get(holder))

    # -- operations ----------------------------------------------------------------
    def issue(self, holder: str, new_bytes: int) -> Issued:
        """Ask to resize `holder` to `new_bytes` (0 unloads; from 0 loads)."""
        if new_bytes < 0:
            raise ValueError(f"memory size must be >= 0, got {new_bytes} for {holder!r}")
        old = self.size(holder)
        if new_bytes > old and self.budget + new_bytes - old > self.capacity:
            return Issued(None, (), self.budget + new_bytes - old - self.capacity)
        op = MemoryOp(next(self._ids), holder, old, new_bytes)
        self._target[holder] = new_bytes
        self._physical.setdefault(holder, 0)
        self._queues.setdefault(holder, deque()).append(op)
        self._waiting[op.op_id] = op
        return Issued(op, tuple(self._start_ready()))

    def complete(self, op_id: int) -> tuple[MemoryOp, ...]:
        """An operation finished; returns the waiting operations that start now."""
        op = self._running.pop(op_id)
        self._physical[op.holder] = op.new_bytes
        queue = self._queues[op.holder]
        queue.popleft()
        if not queue:
            del self._queues[op.holder]
            if self._target[op.holder] == 0:
                del self._target[op.holder], self._physical[op.holder]
        return tuple(self._start_ready())

    def _start_ready(self) -> list[MemoryOp]:
        started = []
        for op in list(self._waiting.values()):
            if self._queues[op.holder][0] is not op:
                continue  # an earlier operation on the same holder goes first
            if op.delta > 0 and self.pessimistic + op.delta > self.capacity:
                continue
            del self._waiting[op.op_id]
            self._running[op.op_id] = op
            started.append(op)
        return started
