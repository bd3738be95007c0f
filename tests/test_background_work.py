"""Background work never competes with serving (issue 31 item 2): it runs at idle CPU
priority with one compute thread, in the order its models are expected to be needed."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.engines.worker_process import REPO_ROOT, background_env

PROBE = """
import json, os, threading
from mesh.background import run_as_background
got = run_as_background()
seen = {}
t = threading.Thread(target=lambda: seen.update(policy=os.sched_getscheduler(0)))
t.start(); t.join()
import ctypes, platform
io = ctypes.CDLL(None).syscall({"x86_64": 252, "aarch64": 31}.get(platform.machine(), -1), 1, 0)  # ioprio_get
print(json.dumps({"got": got, "io_class": io >> 13, "policy": os.sched_getscheduler(0), "thread": seen["policy"],
                  "nice": os.nice(0), "omp": os.environ.get("OMP_NUM_THREADS")}))
"""


def _autogroups_on() -> bool:
    """Whether this kernel groups tasks by session (sched(7), autogroup)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def test_a_background_process_and_the_threads_it_starts_run_at_idle_priority():
    out = subprocess.run([sys.executable, "-c", PROBE], env=background_env(), cwd=str(REPO_ROOT),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    facts = json.loads(out)
    assert facts["policy"] == os.SCHED_IDLE and facts["thread"] == os.SCHED_IDLE, facts
    assert facts["nice"] == 19 and facts["got"] == "SCHED_IDLE, nice 19, idle I/O" and facts["omp"] == "1"
    assert facts["io_class"] == 3  # IOPRIO_CLASS_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # only the child


def test_a_background_session_leader_lowers_its_autogroup():
    """With autogroups on, CFS shares the CPU between sessions before priorities count: a job
    in a session of its own (as Mesh starts its workers) also sets its session's autogroup to
    nice 19, else it takes half of a serving core whatever its policy. A job in its parent's
    session leaves the autogroup alone (it would lower the parent too): the test above."""
    if not _autogroups_on():
        pytest.skip("this kernel does not group tasks by session (no /proc/sys/kernel/sched_autogroup_enabled = 1)")
    probe = PROBE + "\nprint(open('/proc/self/autogroup').read().strip())"
    out = subprocess.run([sys.executable, "-c", probe], env=background_env(), cwd=str(REPO_ROOT), capture_output=True,
                         text=True, timeout=60, check=True, start_new_session=True).stdout.splitlines()
    facts = json.loads(out[0])
    assert facts["got"] == "SCHED_IDLE, nice 19, idle I/O, autogroup nice 19", facts
    assert out[1].endswith("nice 19"), out[1]
    assert not Path("/proc/self/autogroup").read_text().strip().endswith("nice 19")  # the test's own: untouched


def test_preparations_run_at_idle_priority_in_order_of_expected_need(tmp_path: Path):
    """Three files that are GGUFs by their magic only (each preparation fails fast, which is
    all this needs): the one needed first is prepared first, whatever order they came in,
    each in a child at SCHED_IDLE; a wait for one model does not wait for the others."""
    from mesh.engines.background_prepare import BackgroundPreparer

    files = {}
    for name in ("late", "now", "soon"):
        files[name] = tmp_path / f"{name}.gguf"
        files[name].write_bytes(b"GGUF" + os.urandom(64))

    async def main() -> None:
        preparer = BackgroundPreparer(tmp_path / "root")
        now = asyncio.get_running_loop().time()
        assert preparer.schedule(files["late"], now + 100)
        assert preparer.schedule(files["now"])
        assert preparer.schedule(files["soon"], now + 50)
        assert not preparer.schedule(files["late"], now + 10)  # queued once; it moves up to the earlier need
        policies = set()
        waited = asyncio.ensure_future(preparer.wait(files["now"]))
        while not waited.done():
            proc = preparer._proc
            if proc is not None and proc.returncode is None:
                try:
                    policies.add(os.sched_getscheduler(proc.pid))
                except OSError:
                    pass
            await asyncio.sleep(0.01)
        assert str(files["late"].resolve()) not in preparer.done  # its own wait is over before the others run
        await preparer.wait()
        assert list(preparer.done) == [str(files[n].resolve()) for n in ("now", "late", "soon")]
        assert os.SCHED_IDLE in policies
        await preparer.close()

    asyncio.run(main())


@pytest.mark.slow
def test_a_file_removed_before_its_preparation_is_neither_recorded_nor_a_warning(tmp_path: Path, caplog):
    """A deleted model's copy can go before the agent is told to forget it: its queued
    preparation then fails on a missing file, which is no error (no traceback in the log)."""
    from mesh.engines.background_prepare import BackgroundPreparer

    kept, gone = tmp_path / "kept.gguf", tmp_path / "gone.gguf"
    for f in (kept, gone):
        f.write_bytes(b"GGUF" + os.urandom(64))

    async def main() -> None:
        preparer = BackgroundPreparer(tmp_path / "root")
        assert preparer.schedule(kept) and preparer.schedule(gone)
        gone.unlink()  # before its turn
        await preparer.wait()
        assert list(preparer.done) == [str(kept.resolve())]  # the kept one ran (and failed: not a model)
        await preparer.close()

    with caplog.at_level("INFO", logger="mesh.engines.background_prepare"):
        asyncio.run(main())
    assert any("its file was removed" in r.message for r in caplog.records)
    assert not any(r.levelname == "WARNING" and "gone.gguf" in r.message for r in caplog.records)


def test_the_interference_benchmark_times_a_real_node_with_and_without_a_preparation_beside_it(demo_gguf, tmp_path):
    """`mesh bench interference` in small: a real OpenVINO node decodes in every phase, the
    background job really ran during its windows, and nothing it started outlives it."""

    pytest.importorskip("openvino_genai")
    from mesh.bench.interference import run

    cores = sorted(os.sched_getaffinity(0))
    fig = asyncio.run(run(demo_gguf, "prepare", cores, batch=2, tokens=24, repeats=1, normal=True,
                          work=tmp_path, settle_s=1.0))
    assert [w.phase for w in fig.windows] == ["alone", "background", "normal"]
    assert all(w.steps >= 10 and w.tpot_p50_ms > 0 for w in fig.windows)
    assert fig.windows[0].jobs_started == 0 and all(w.jobs_started >= 1 for w in fig.windows[1:])
    assert set(fig.rise_pct) == {"background", "normal"}
    left = subprocess.run(["pgrep", "-f", f"mesh.engines.background_prepare .* --root {tmp_path}"], capture_output=True)
    assert left.returncode == 1, left.stdout  # every job process group was killed


def test_a_worker_reply_whose_waiter_was_cancelled_leaves_the_connection_serving(tmp_path):
    """mesh.engines.worker_process: a command whose asyncio waiter was cancelled (a cancelled build
    ahead, a watchdog's step) had its future cancelled; its reply then raised in the reader
    thread, which died, and every later reply of that worker was lost."""
    from mesh.engines.engine_api import EngineError
    from mesh.engines.worker_process import WorkerConnection, wait, worker_env

    async def main() -> None:
        conn = WorkerConnection("mesh.engines.openvino_worker", sys.executable, worker_env(), tmp_path / "w.log",
                                name="OpenVINO")
        try:
            first = conn.call("no-such-command")
            assert first.cancel()  # what asyncio.wrap_future does when its waiter is cancelled
            with pytest.raises(EngineError, match="no init message"):
                await asyncio.wait_for(wait(conn.call("still-listening")), 60)  # answered: the reader lives on
            assert first.cancelled() and conn.dead is None
        finally:
            await conn.shutdown(10)

    asyncio.run(main())


@pytest.mark.slow
def test_the_services_conversion_runs_in_an_idle_session_of_its_own(demo_gguf, tmp_path):
    """The service's GGUF-to-HF conversion (mesh.service.preparation.ConvertTool, as the
    service runs it) leads a session of its own at SCHED_IDLE with that session's autogroup
    at nice 19: in the service's session it would compete for the CPU as the service's
    autogroup, half a serving core (test_a_background_session_leader_lowers_its_autogroup)."""
    import psutil

    from mesh.modelfiles.formats import CONVERSIONS
    from mesh.service.preparation import ConvertTool

    tool = ConvertTool()
    python, why = tool.python(CONVERSIONS["gguf"])
    if python is None:
        pytest.skip(why)

    async def observe() -> dict:
        run = asyncio.create_task(tool.run(CONVERSIONS["gguf"], python, str(demo_gguf), tmp_path / "hf",
                                           tmp_path / "convert.log"))
        try:
            for _ in range(200):
                await asyncio.sleep(0.05)
                kids = [p for p in psutil.Process().children() if "mesh.modelfiles.convert" in " ".join(p.cmdline())]
                if kids:
                    pid = kids[0].pid
                    await asyncio.sleep(1.0)  # past its argument parsing
                    return {"pid": pid, "sid": os.getsid(pid), "policy": os.sched_getscheduler(pid),
                            "autogroup": Path(f"/proc/{pid}/autogroup").read_text().strip()}
            raise AssertionError("no conversion process started")
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)

    facts = asyncio.run(observe())
    assert facts["sid"] == facts["pid"] and facts["sid"] != os.getsid(0), facts
    assert facts["policy"] == os.SCHED_IDLE, facts
    if _autogroups_on():
        assert facts["autogroup"].endswith("nice 19"), facts
    assert not psutil.Process().children(), "the conversion outlived its run"
