"""A model file of random bytes: what the weights benchmarks move (mesh bench multicast, with
or without --ray)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_random_model(path: Path, size_bytes: int, seed: int = 0) -> None:
    """Write `size_bytes` random bytes (numpy's generator, seeded) to `path`, 64 MiB at a time."""
    rng = np.random.default_rng(seed)
    with path.open("wb") as f:
        left = size_bytes
        while left:
            n = min(left, 64 << 20)
            f.write(rng.bytes(n))
            left -= n
