"""Where Mesh keeps its files: the data folder (models, registry, calibration state)."""
from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """Mesh's data folder: $MESH_DATA_DIR, else ~/.local/share/mesh. Created on first use."""
    path = Path(os.environ.get("MESH_DATA_DIR") or Path.home() / ".local" / "share" / "mesh")
    path.mkdir(parents=True, exist_ok=True)
    return path
