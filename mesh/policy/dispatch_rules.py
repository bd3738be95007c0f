"""The cluster dispatcher's rules: pure choices on views of the cluster (where a request
goes, what a preemption may take, where a new instance starts, warm-ups, keep-alive, admission).

Mesh (LLM-Mesh 4, 7):
- candidate instances of a request's model: CPU nodes first (4), and among a model's
  instances the one with the highest batch size first (reactive defragmentation by
  bin-packing, 7.2); without defragmentation, the lowest batch first (the spread order of
  existing systems, 7.2 last paragraph);
- proactive defragmentation (7.1): an instance may preempt neighbour instances on its node
  only if their batch size is lower than its own, the lowest first;
- a new instance: CPU nodes first, and within a kind the nodes already in use first (so
  idle nodes stay idle), the fullest first; without sharing, only empty nodes;
- a warm-up: a new instance for a request whose only obstacle is the cold start (longer
  than its TTFT SLO), at most one unvalidated load per model (`warm_up_allowed`).

ServerlessLLM baselines (8.1): a whole node per instance, first-fit (CPU nodes first when
they may be used), scale out when in-flight requests exceed the concurrency target.

Common to every policy: keep-alive recycling and the deadline after which a queued request
can no longer meet its SLO. How long a new instance's cold start takes is mesh.perf.load_times'.

No I/O and no clock: times are arguments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Sequence

CPU, GPU = "cpu", "gpu"
NODE_KINDS = (CPU, GPU)
DEFAULT_KEEP_ALIVE_S = 1.0  # LLM-Mesh 8.1

# ServerlessLLM concurrency targets tailored by the paper (8.1): in-flight requests per
# instance before scaling out, for Llama-3.2-3B, Llama-2-7B, Llama-2-13B.
CONCURRENCY_TARGETS: dict[str, dict[str, int]] = {
    CPU: {"llama-3.2-3b": 59, "llama-2-7b": 15, "llama-2-13b": 6},
    GPU: {"llama-3.2-3b": 160, "llama-2-7b": 32, "llama-2-13b": 16},
}


@dataclass(frozen=True, slots=True)
class InstanceView:
    """What placement needs to know of one instance."""

    instance_id: str
    node_id: str
    node_kind: str  # "cpu" | "gpu"
    model: str
    batch_size: int  # requests it holds (waiting for prefill or decoding)
    seq: int = 0  # creation order (first-fit)


@dataclass(frozen=True, slots=True)
class NodeView:
    node_id: str
    kind: str
    instances: int  # instances it hosts (loading ones included)
    used_bytes: int  # memory budget in use (reservation station, 6.3)
    capacity_bytes: int
    seq: int = 0  # position in the cluster (first-fit)


def kind_rank(kind: str) -> int:
    """CPU nodes first (LLM-Mesh 4; the baselines too, 8.1 "all systems prioritize the CPU")."""
    return 0 if kind == CPU else 1


def candidate_order(instances: Iterable[InstanceView], *, defrag: bool = True) -> list[InstanceView]:
    """Order in which a request tries its model's instances: CPU first; then the highest
    batch first (7.2), or the lowest first without defragmentation (spread)."""
    sign = -1 if defrag else 1
    return sorted(instances, key=lambda v: (kind_rank(v.node_kind), sign * v.batch_size, v.seq))


def victim_order(target: InstanceView, neighbours: Iterable[InstanceView]) -> list[InstanceView]:
    """Neighbours `target` may preempt (7.1): same node, lower batch size, lowest first."""
    lower = [
        v for v in neighbours
        if v.node_id == target.node_id and v.instance_id != target.instance_id and v.batch_size < target.batch_size
    ]
    return sorted(lower, key=lambda v: (v.batch_size, v.seq))


def new_instance_order(
    nodes: Iterable[NodeView], kinds: Collection[str], *, exclusive: bool = False, exclude: Collection[str] = (),
    holding: Collection[str] | None = None,
) -> list[NodeView]:
    """Nodes to try for a new instance: only of `kinds`; CPU first; nodes in use before
    empty ones and the fullest first (bin-packing, so whole nodes stay free); with
    `exclusive` (no sharing, the baselines) only empty nodes, in cluster order. `holding`:
    the nodes that hold a copy of the model's weights (None: all, LLM-Mesh 8.1); among nodes
    otherwise equal in use (in use or empty), those go first: their cold start needs no
    transfer (BlitzScale 5.3: load from the parameter pool's host copy before multicasting)."""
    out = [n for n in nodes if n.kind in kinds and n.node_id not in exclude and (not exclusive or n.instances == 0)]
    lacks = (lambda n: False) if holding is None else (lambda n: n.node_id not in holding)
    if exclusive:
        return sorted(out, key=lambda n: (kind_rank(n.kind), lacks(n), n.seq))
    return sorted(out, key=lambda n: (kind_rank(n.kind), n.instances == 0, lacks(n), -n.used_bytes, n.seq))


def concurrency_target(base_model: str, kind: str) -> int:
    """In-flight requests per ServerlessLLM instance before scaling out (8.1)."""
    table = CONCURRENCY_TARGETS.get(kind)
    if table is None:
        raise ValueError(f"unknown node kind {kind!r}; valid: {', '.join(NODE_KINDS)}")
    if base_model not in table:
        raise ValueError(
            f"no ServerlessLLM concurrency target for model {base_model!r} on {kind}; "
            f"the paper gives them for {', '.join(table)}"
        )
    return table[base_model]


def tailored_concurrency_target(decode_s: Callable[[int], float], tpot_s: float, limit: int = 512) -> int:
    """A ServerlessLLM target for a model the paper gives none for, tailored as the paper's
    were to the model and node: the largest batch (at most `limit`) whose decode step
    `decode_s(batch)` fits the TPOT SLO; at least 1."""
    low, high = 1, limit
    if decode_s(low) > tpot_s:
        return 1
    while low < high:  # decode time grows with the batch
        mid = (low + high + 1) // 2
        if decode_s(mid) <= tpot_s:
            low = mid
        else:
            high = mid - 1
    return low


def sllm_pick(instances: Sequence[InstanceView], targets: dict[str, int]) -> InstanceView | None:
    """ServerlessLLM routing: the first instance (CPU first, then creation order) whose
    in-flight requests are below its concurrency target (`targets` by node kind; an instance
    on a kind without one, which the policy does not use, is never picked); None means
    every instance is at its target: scale out (or wait)."""
    for v in sorted(instances, key=lambda v: (kind_rank(v.node_kind), v.seq)):
        if v.batch_size < targets.get(v.node_kind, 0):
            return v
    return None


# What a request gets when its model is cold and no instance can make its TTFT, per model: SERVE_LATE (default) admits
# it on the instance loading for it, its deadlines running from that instance's predicted ready time, if shadow
# validation shows every other request on the node still on time (no one else is hurt); REJECT turns it away
# (429 with Retry-After, the time left of the load). Why serve late by default: a
# client would retry the 429 after Retry-After and be served at about the same time, so the
# 429 only adds a round trip, an error a client without retries (curl, most scripts) sees,
# and a request lost for one that does not retry; a client with somewhere else to go (a
# router with a fallback) sets REJECT. docs/service.md, "Cold starts".
SERVE_LATE, REJECT = "serve_late", "reject"
COLD_START_CHOICES = (SERVE_LATE, REJECT)


MAX_WARMING_PER_MODEL = 1  # instances of one model loading at once, for a warm-up to start


def warm_up_node_allowed(node_kind: str, node_holds_instances: bool, model_has_instances: bool) -> bool:
    """May a warm-up (warm_up_allowed) start on a node of `node_kind`? Not one that scales a
    model out (the model has instances already) on a CPU node that holds an instance: the
    build runs on that node's cores beside what it serves, and a warm-up, which no request
    waits for, must not compete with serving (unlike a build ahead, mesh.node.park_ahead, it
    cannot be paused while the node serves). A model's first instance may start anywhere
    (else the model is never served), and a GPU's load is a copy over PCIe."""
    return node_kind != CPU or not node_holds_instances or not model_has_instances


def warm_up_allowed(
    cold_start_s: float, fresh_slack_s: float, validates_without_cold_start: bool, warming: int,
    limit: int = MAX_WARMING_PER_MODEL,
) -> bool:
    """May Mesh start a new instance (a warm-up) for a request that no instance, new ones
    included, can serve within its SLO? Only when the cold start exceeds `fresh_slack_s`
    (the TTFT SLO of the request's prompt less its prefill: no such request could ever
    validate on a new instance), a new instance already loaded would validate (5.3 with no
    load time), and fewer than `limit` instances of the model are loading.

    Why: LLM-Mesh starts an instance only for a request that validates on it (5.3, 4),
    assuming loads that fit in the TTFT SLO (8.1); a longer cold start would never be
    issued and the model never served (an autoscaler scales anyway, BlitzScale 2.3). The
    request itself is still turned away by wait_expiry_s. One warm-up per model at a time:
    a second would be ready later and take the cores the first load needs."""
    return cold_start_s > fresh_slack_s and validates_without_cold_start and warming < limit


def keep_alive_expired(idle_since: float, now: float, keep_alive_s: float) -> bool:
    """LLM-Mesh 4: an instance idle (no requests) for keep-alive is recycled."""
    return now - idle_since >= keep_alive_s - 1e-9


# Admission: what a fresh request gets once it can no longer meet its SLO, chosen
# per model (its registration's `admission`), else the service's default (`mesh serve
# --admission`, `mesh replay --admission`):
# - ADMIT_REJECT turns it away at once (429 with the reason and a Retry-After): the paper's
#   rule (LLM-Mesh 5.3: no validation can pass after that), the default of `mesh replay`;
# - ADMIT_QUEUE keeps it waiting, in arrival order, up to the queue timeout (the bound), and
#   places it as soon as shadow validation shows everyone else still on time, its own deadlines
#   running from then (served late; still counted as missing its SLO). vLLM, SGLang and Ollama
#   queue, and a benchmark user expects it: the default of `mesh serve --demo`;
# - ADMIT_LATE is the same with no time bound (only the queue's capacity, and the client
#   going away, end its wait): best effort.
# A request that had started (evicted, 6.4) follows ADMIT_REJECT's rule under every choice.
ADMIT_REJECT, ADMIT_QUEUE, ADMIT_LATE = "reject", "queue", "late"
ADMISSIONS = (ADMIT_REJECT, ADMIT_QUEUE, ADMIT_LATE)


# A request its node lost (mesh.control.cluster_node.LOSS_CAUSES) had been accepted, and
# streams to a client still waiting: failing it as soon as the queue timeout passes makes
# the client send it again, to wait for the same recovery from the back of the queue. So
# while the cluster recovers for it (an instance of its model loading, or a lost node's agent
# not back yet: under load both took longer than the 30 s timeout in the soak), its timeout
# counts from the last moment it was seen recovering, up to this many timeouts from its loss.
LOST_WAIT_LIMIT = 4.0


def lost_wait_until(now: float, handed_back_s: float, timeout_s: float | None, recovery_left_s: float | None,
                    recovering_s: float) -> float | None:
    """When a lost (or otherwise handed-back) request past its queue timeout is looked at
    again (it waits on), or None: it fails now. `handed_back_s`: when its node lost it or
    handed it back; `recovery_left_s`: the predicted time left of a recovery under way now
    (its model's load: 0 once overdue, or for a node not back yet), None if none is;
    `recovering_s`: when a recovery was last seen under way (`handed_back_s` if never)."""
    if timeout_s is None:
        return None
    limit = handed_back_s + LOST_WAIT_LIMIT * timeout_s
    if recovery_left_s is not None:
        until = now + max(recovery_left_s, 1.0)  # overdue, or unknown: looked at each second
    else:
        until = recovering_s + timeout_s  # a whole timeout after the recovery ended, to be placed
    if now >= limit or until <= now:
        return None
    return min(limit, until)


def wait_expiry_s(now: float, slo_expiry_s: float, timeout_s: float | None, validates: bool,
                  admission: str = ADMIT_REJECT) -> tuple[float, str]:
    """When a request that starts waiting now is turned away, and why ("slo" or "timeout").

    The queue's rule, the same for every policy: a waiting request is dropped after
    `timeout_s` seconds (a client timeout; the default of `mesh replay`), or, with
    timeout_s None, once it can no longer meet its SLO. A policy that validates (Mesh,
    5.3) also turns a request away as soon as it can no longer meet its SLO, since no
    validation can pass after that; the baselines do not know and keep it waiting, as
    ServerlessLLM queues (LLM-Mesh 8.2: "long queuing under high load").

    `admission` (ADMISSIONS) other than ADMIT_REJECT keeps a request that can no longer meet
    its SLO waiting: up to `timeout_s` under ADMIT_QUEUE, without a time bound under ADMIT_LATE."""
    if timeout_s is not None and not timeout_s >= 0:
        raise ValueError(f"queue timeout must be >= 0 s, got {timeout_s}")
    if admission not in ADMISSIONS:
        raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
    timeout_at = math.inf if timeout_s is None else now + timeout_s
    if admission == ADMIT_LATE:
        return math.inf, "timeout"
    if admission == ADMIT_QUEUE:
        return timeout_at, "timeout"
    if (validates or timeout_s is None) and slo_expiry_s <= timeout_at:
        return slo_expiry_s, "slo"
    return timeout_at, "timeout"


def queue_expiry_s(deadline_s: float, fastest_first_token_s: float) -> float:
    """When a waiting request can no longer meet its SLO: its next-token deadline (the
    TTFT deadline for a fresh request, Eq. 1) minus the fastest its prefill could run
    anywhere it may go. Past this time it is rejected (or, if it was already running,
    failed)."""
    if not math.isfinite(deadline_s):
        raise ValueError(f"deadline must be finite, got {deadline_s}")
    return deadline_s - max(0.0, fastest_first_token_s)
