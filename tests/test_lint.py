"""The code passes its linters, and says why wherever it silences one.

ruff (configured in pyproject.toml: pycodestyle, pyflakes, import sorting, 120-character
lines) runs over mesh/ and tests/, and mypy over the packages pyproject.toml names, as the
suite's Python runs them; both are in the test extra, so scripts/setup.sh installs them.
A `noqa` marker names its codes and then, after " - ", why. Code and its comments carry no
issue numbers: history belongs to commits and docs.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("mesh", "tests")


def python_files() -> list[Path]:
    return sorted(p for d in CHECKED for p in (ROOT / d).rglob("*.py"))


def installed(tool: str) -> None:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed: it is in the test extra (make setup, or pip install -e '.[test]')")


def test_ruff_finds_nothing():
    installed("ruff")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *CHECKED], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_finds_nothing(tmp_path):
    installed("mypy")
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


NOQA = re.compile(r"#\s*noqa\b(?P<rest>.*)$")
REASONED = re.compile(r":\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*\s+-\s+\S")


def test_every_noqa_says_why():
    bare = []
    for path in python_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = NOQA.search(line)
            if m and not REASONED.match(m.group("rest")):
                bare.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bare, "noqa without its codes and ' - why':\n" + "\n".join(bare)


def test_the_code_names_no_issue_numbers():
    found = []
    for path in sorted((ROOT / "mesh").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bissues? \d", line, re.IGNORECASE):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "say what the code does and why, not which issue it came from:\n" + "\n".join(found)
