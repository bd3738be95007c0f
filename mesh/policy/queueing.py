"""The bounded waiting queue of the dispatcher (LLM-Mesh 4; the same rule for every policy).

A request no instance can take waits here, in arrival order, and is retried as capacity
frees. It leaves the queue placed, or rejected with a reason: the queue is full, it waited
past the queue timeout, or (for a policy that validates, or with no timeout) it can no
longer meet its SLO (mesh.policy.dispatch_rules.wait_expiry_s). Requests of one
model are retried in order (FIFO per model): a later request never overtakes an earlier
one of the same model.

Fair between tenants (longest queue drop, Suter et al., "Design considerations for
supporting TCP with per-flow queueing", INFOCOM 1998): a tenant alone may fill the whole
queue, but when the queue is full a request of a tenant holding fewer entries than the
largest holder takes the place of that holder's newest entry (`make_room`), which is turned
away. So one tenant's burst cannot shut the others out, and no capacity is kept idle for
tenants that send nothing.

No clock: times are arguments.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

DEFAULT_QUEUE_CAPACITY = 1024
# A waiting request is dropped after this long (a client timeout), by every policy; see
# mesh.policy.dispatch_rules.wait_expiry_s. None there means: once it cannot meet its SLO.
DEFAULT_QUEUE_TIMEOUT_S = 30.0


@dataclass(slots=True)
class QueueEntry:
    request_id: str
    model: str
    enqueued_s: float
    expires_s: float
    seq: int = 0
    tenant: str = ""  # whose share it counts against ("" : its model's)


@dataclass(slots=True)
class WaitingQueue:
    capacity: int = DEFAULT_QUEUE_CAPACITY
    _entries: dict[str, QueueEntry] = field(default_factory=dict)  # insertion (arrival) order
    _by_model: dict[str, int] = field(default_factory=dict)
    _by_tenant: dict[str, dict[str, None]] = field(default_factory=dict)  # tenant -> its entries, oldest first
    _expiry: list[tuple[float, int, str]] = field(default_factory=list)  # heap
    _seq: int = 0
    peak: int = 0  # most entries held at once

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"queue capacity must be at least 1, got {self.capacity}")

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def full(self) -> bool:
        return len(self._entries) >= self.capacity

    def has_model(self, model: str) -> bool:
        return self._by_model.get(model, 0) > 0

    def held(self, tenant: str) -> int:
        """Entries of `tenant` waiting."""
        return len(self._by_tenant.get(tenant, ()))

    def make_room(self, tenant: str) -> QueueEntry | None:
        """In a full queue, remove and return the newest entry of the largest holder if it
        holds at least two more entries than `tenant` (the caller turns it away); None if
        `tenant` already has its fair share (its request is the one to turn away)."""
        if not self.full():
            return None
        largest = max(self._by_tenant, key=lambda t: len(self._by_tenant[t]))
        if len(self._by_tenant[largest]) < self.held(tenant) + 2:
            return None
        return self.remove(next(reversed(self._by_tenant[largest])))

    def push(self, request_id: str, model: str, now: float, expires_s: float, tenant: str = "") -> bool:
        """Enqueue; False if the queue is full (the caller rejects the request, or first
        asks `make_room`)."""
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} is already waiting")
        if self.full():
            return False
        self._seq += 1
        entry = QueueEntry(request_id, model, now, expires_s, self._seq, tenant or model)
        self._entries[request_id] = entry
        self._by_model[model] = self._by_model.get(model, 0) + 1
        self._by_tenant.setdefault(entry.tenant, {})[request_id] = None
        heapq.heappush(self._expiry, (expires_s, entry.seq, request_id))
        self.peak = max(self.peak, len(self._entries))
        return True

    def remove(self, request_id: str) -> QueueEntry:
        entry = self._entries.pop(request_id)
        self._by_model[entry.model] -= 1
        mine = self._by_tenant[entry.tenant]
        del mine[request_id]
        if not mine:
            del self._by_tenant[entry.tenant]
        return entry

    def in_order(self) -> list[QueueEntry]:
        """Entries in arrival order (a copy: the caller may remove while iterating)."""
        return list(self._entries.values())

    def next_expiry(self) -> float | None:
        """Earliest expiry among waiting entries (lazily drops removed ones)."""
        heap = self._expiry
        while heap and (heap[0][2] not in self._entries or self._entries[heap[0][2]].seq != heap[0][1]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_expired(self, now: float, extend: Callable[[QueueEntry], float | None] | None = None) -> list[QueueEntry]:
        """Remove and return the entries whose expiry is at or before `now`; an entry for
        which `extend` gives a later expiry keeps its place in the queue and waits on."""
        out: list[QueueEntry] = []
        while True:
            t = self.next_expiry()
            if t is None or t > now:
                return out
            _, seq, rid = heapq.heappop(self._expiry)
            later = extend(self._entries[rid]) if extend is not None else None
            if later is not None and later > now:
                self._entries[rid].expires_s = later
                heapq.heappush(self._expiry, (later, seq, rid))
                continue
            out.append(self.remove(rid))
