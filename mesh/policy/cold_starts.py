"""Cold starts measured, not assumed (issue 23 item 3): each node's loads per model and source.

A new instance's cold start, which shadow validation counts in the TTFT of the request it
would serve (LLM-Mesh 4, 5.3), is

    wait for the loads under way on the node  (a node loads one instance at a time)
  + the weights transfer, when the node holds no copy of the model (BlitzScale 5.1 / lambdaScale 4.2)
  + the load itself: read, convert or import, compile, tokenizer, KV allocation, warm-up.

The load itself is what a prior (`ColdStart`, `--cold-start-s`) guessed before; here it is
measured. `ColdStartTable` keeps, per (node, model, source), the last few measured loads
("source": where the engine read the model from, e.g. OpenVINO's `gguf`, `prepared` (the
node's IR cache) or `ir`), and predicts a node's next load of a model from the source of its
latest load there (preparation only ever makes the next source faster, and one load is
enough to learn it), else from the same model's latest loads on the node's peers (nodes of
its kind), else nothing: the caller's prior. A load that adopted a parked worker (source
`parked`, mesh.engines.parking: a built, warm pipeline kept after its instance stopped) predicts
only the loads of a node that says it has the model parked now: a parked worker can be gone
by the next load. Transfers are measured likewise, as bytes per
second over every transfer to any node.

A table can be written to JSON and read back (`to_dict`, `from_dict`), so that a replay can
take its cold starts from what a service measured (`cold_start_times`).

No I/O and no clock: times are arguments.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

FORMAT = "mesh-cold-starts/1"
WINDOW = 5  # loads kept per (node, model, source): the median of the last few, robust to one slow load
RECORDS_KEPT = 1024  # the latest loads kept in order (views, export): a service that runs for months keeps no more
ANY_MODEL = "*"  # in a replay's table: the cold start of any model without its own entry
PARKED = "parked"  # the source of a load that adopted a parked worker (mesh.engines.parking)
# A load from the parked tier before any was measured: an adoption and the KV cache's resize
# (mesh bench coldstart's parked row: 0.6 ms to ready, median of 5; the resize allocates).
PARKED_PRIOR_S = 0.5


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """One measured load: from its issue (the node's turn, weights in place) to ready."""

    node_id: str
    kind: str  # "cpu" | "gpu"
    model: str
    source: str
    load_s: float
    at_s: float  # when it ended (the caller's clock)


@dataclass
class ColdStartTable:
    window: int = WINDOW
    _loads: dict[tuple[str, str, str], deque[float]] = field(default_factory=dict)  # (node, model, source)
    _latest: dict[tuple[str, str], LoadRecord] = field(default_factory=dict)  # (node, model) -> latest load
    _transfers: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # bytes/s
    records: deque[LoadRecord] = field(default_factory=lambda: deque(maxlen=RECORDS_KEPT))  # the latest loads, in order

    def record(self, rec: LoadRecord) -> None:
        if not rec.load_s >= 0:
            raise ValueError(f"a load takes >= 0 s, got {rec.load_s}")
        self._loads.setdefault((rec.node_id, rec.model, rec.source), deque(maxlen=self.window)).append(rec.load_s)
        if rec.source != PARKED:
            self._latest[(rec.node_id, rec.model)] = rec
        self.records.append(rec)

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        """A model's weights reached a node that held no copy: `nbytes` in `seconds`."""
        if nbytes > 0 and seconds > 0:
            self._transfers.append(nbytes / seconds)

    def node_load_s(self, node_id: str, model: str) -> float | None:
        """The node's next load of `model`: the median of its recent loads from the source
        of its latest load (parked ones aside); None if it never loaded the model."""
        latest = self._latest.get((node_id, model))
        if latest is None:
            return None
        return statistics.median(self._loads[(node_id, model, latest.source)])

    def expected_load_s(self, node_id: str, model: str, peers: Iterable[str] = (),
                        parked: bool = False) -> float | None:
        """The node's own measure, else the median over `peers` (nodes of its kind) that
        loaded the model; from the parked tier first if the node has the model `parked`
        (`PARKED_PRIOR_S` before any parked load was measured); None: never loaded on any of
        them (the caller's prior)."""
        if parked:  # a parked worker waits there (parked ahead: mesh.node.park_ahead); its build is done
            measured = self._median(self._parked_s, node_id, model, peers)
            return PARKED_PRIOR_S if measured is None else measured
        return self._median(self.node_load_s, node_id, model, peers)

    @staticmethod
    def _median(measure: Callable[[str, str], float | None], node_id: str, model: str,
                peers: Iterable[str]) -> float | None:
        """`measure` of the node, else the median of its peers' that have one."""
        own = measure(node_id, model)
        if own is not None:
            return own
        theirs = [s for s in (measure(p, model) for p in peers if p != node_id) if s is not None]
        return statistics.median(theirs) if theirs else None

    def _parked_s(self, node_id: str, model: str) -> float | None:
        """The median of the node's recent loads of `model` that adopted a parked worker."""
        loads = self._loads.get((node_id, model, PARKED))
        return statistics.median(loads) if loads else None

    def transfer_bytes_per_s(self) -> float | None:
        """The median of the recent transfers' throughput; None before the first."""
        return statistics.median(self._transfers) if self._transfers else None

    def forget_model(self, model: str) -> None:
        """A deleted model's loads leave the table."""
        for key in [k for k in self._loads if k[1] == model]:
            del self._loads[key]
        for key in [k for k in self._latest if k[1] == model]:
            del self._latest[key]
        kept = [r for r in self.records if r.model != model]
        self.records.clear()
        self.records.extend(kept)

    def forget_node(self, node_id: str) -> None:
        for key in [k for k in self._loads if k[0] == node_id]:
            del self._loads[key]
        for key in [k for k in self._latest if k[0] == node_id]:
            del self._latest[key]

    # -- export and replays ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """{format, loads: [per (node, model, source): kind, n, median_s, last_s], transfer_bytes_per_s}."""
        by_key: dict[tuple[str, str, str], LoadRecord] = {}
        for rec in self.records:
            by_key[(rec.node_id, rec.model, rec.source)] = rec
        loads = [{"node": n, "kind": r.kind, "model": m, "source": s, "n": len(self._loads[(n, m, s)]),
                  "median_s": statistics.median(self._loads[(n, m, s)]), "last_s": r.load_s}
                 for (n, m, s), r in sorted(by_key.items()) if (n, m, s) in self._loads]
        return {"format": FORMAT, "loads": loads, "transfer_bytes_per_s": self.transfer_bytes_per_s()}


def cold_start_times(table: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """A replay's cold starts from an exported table (`ColdStartTable.to_dict`): per (model,
    node kind) the median of its nodes' medians, and per kind under `ANY_MODEL` the median
    over all its models (for a replay whose models the service never loaded). Loads from the
    parked tier are left out: a replay's nodes park nothing (mesh.engines.parking)."""
    if table.get("format") != FORMAT:
        raise ValueError(f"not a cold-start table: format {table.get('format')!r}, expected {FORMAT!r}")
    by: dict[tuple[str, str], list[float]] = {}
    for row in table.get("loads") or ():
        if row.get("source") == PARKED:
            continue
        try:
            key, value = (str(row["model"]), str(row["kind"])), float(row["median_s"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad cold-start row {row!r}: {exc}") from None
        if not value >= 0:
            raise ValueError(f"bad cold-start row {row!r}: a load takes >= 0 s")
        by.setdefault(key, []).append(value)
    out = {key: statistics.median(v) for key, v in by.items()}
    for kind in {k for _, k in out}:
        named = [v for (m, k), v in out.items() if k == kind and m != ANY_MODEL]
        if named and (ANY_MODEL, kind) not in out:  # a table's own '*' row stands
            out[(ANY_MODEL, kind)] = statistics.median(named)
    return out
