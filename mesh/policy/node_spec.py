"""A node as the cluster knows it: its id, its kind and its memory.

The control side places on it and a node runtime runs as it; both read it from here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeSpec:
    node_id: str
    kind: str  # "cpu" or "gpu"
    memory_bytes: int
