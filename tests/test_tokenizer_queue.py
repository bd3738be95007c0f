"""Tokenizing is admitted work (issue 32 item 4; mesh.node.tokenizers): jobs shared between
tenants by the worker time they take, a blocking tokenize (vLLM's) off the event loop, a deadline on every
job with a stuck worker killed and replaced (the real worker process, on the demo model),
and the worker's tokenizers bounded by bytes."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from mesh.engines.engine_api import EngineError
from mesh.node.tokenizer_worker import TokenizerCache
from mesh.node.tokenizers import TokenizerProcess


class _Recorder:
    """A stand-in for the worker's connection: a job takes `job_s` seconds, or
    `job_s(prompt)`, one at a time (the queue sends one at a time); records the prompts in
    the order they ran."""

    dead = None

    def __init__(self, job_s) -> None:
        self.job_s, self.ran = job_s if callable(job_s) else (lambda _prompt: job_s), []

    def call(self, op, **fields):
        fut = asyncio.get_running_loop().create_future()
        self.ran.append(fields["prompt"])
        asyncio.get_running_loop().call_later(self.job_s(fields["prompt"]), fut.set_result, [1, 2, 3])
        return fut


def test_jobs_are_shared_between_tenants_by_the_time_they_take(monkeypatch):
    """A's five prompts of 0.2 s each, then B's five of 0.01 s: B's all run after A's first
    (the one running when they came), not in turn with A's (a round robin would)."""
    worker = _Recorder(lambda prompt: 0.2 if prompt.startswith("A") else 0.01)
    monkeypatch.setattr(TokenizerProcess, "_connection", lambda self: worker)

    async def main():
        tp = TokenizerProcess()
        a = [asyncio.ensure_future(tp.encode("m", None, f"A{i}" + "a" * 100_000, "a")) for i in range(5)]
        await asyncio.sleep(0)
        b = [asyncio.ensure_future(tp.encode("m", None, f"B{i}" + "b" * 8, "b")) for i in range(5)]
        await asyncio.gather(*a, *b)
        return [p[:2] for p in worker.ran], tp

    order, tp = asyncio.run(main())
    assert order == ["A0", "B0", "B1", "B2", "B3", "B4", "A1", "A2", "A3", "A4"], order
    assert tp.counts.done == 10 and tp.waiting == 0 and not tp._finish  # no tenant left remembered


def test_short_prompts_that_build_tokenizers_are_charged_the_builds(monkeypatch):
    """The soak's case: a churning tenant sends short prompts to five new models (each job
    also builds a tokenizer: 0.3 s here, seconds there) and a streaming tenant then sends five
    long chat prompts (0.01 s each). The stream's prompts all run right after the build that
    was running: a job's share is the time it takes. (Weighed by characters, all five builds
    went first.)"""
    worker = _Recorder(lambda prompt: 0.01 if prompt.startswith("chat") else 0.3)
    monkeypatch.setattr(TokenizerProcess, "_connection", lambda self: worker)

    async def main():
        tp = TokenizerProcess()
        builds = [asyncio.ensure_future(tp.encode(f"model-{i}", None, f"hi{i}", "churn")) for i in range(5)]
        await asyncio.sleep(0)
        chats = [asyncio.ensure_future(tp.encode("demo", None, f"chat{i} " + "x" * 2000, "demo")) for i in range(5)]
        await asyncio.gather(*builds, *chats)
        return [p[:5] for p in worker.ran], tp

    order, tp = asyncio.run(main())
    assert order == ["hi0"] + [f"chat{i}" for i in range(5)] + [f"hi{i}" for i in range(1, 5)], order
    assert not tp._finish


async def _never_stuck(why: str) -> bool:
    raise AssertionError(f"no job should be stuck: {why}")


def test_a_blocking_tokenize_runs_off_the_event_loop():
    """`run` (how the agent tokenizes for vLLM, whose engine answers on a blocking socket):
    the loop keeps ticking while a 0.5 s call runs, and the calls take their turns, each
    given the job's deadline."""

    async def main():
        tp = TokenizerProcess(job_timeout_s=7.0)
        ticks = 0
        deadlines = []

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        def call(ids):
            def tokenize(deadline_s):
                deadlines.append(deadline_s)
                time.sleep(0.5)
                return ids
            return tokenize

        t = asyncio.ensure_future(ticker())
        start = time.monotonic()
        ids = await asyncio.gather(tp.run("a", call([7]), _never_stuck), tp.run("b", call([8]), _never_stuck))
        took = time.monotonic() - start
        t.cancel()
        return ids, ticks, took, deadlines

    ids, ticks, took, deadlines = asyncio.run(main())
    assert ids == [[7], [8]] and deadlines == [7.0, 7.0]
    assert took >= 1.0  # one at a time
    assert ticks >= 30, ticks  # the loop ran meanwhile (100 ticks if idle; the machine is shared)


@pytest.mark.parametrize("stuck_by", ["the queue's deadline", "the call's own deadline"])
def test_a_blocking_tokenize_past_its_deadline_fails_clearly_and_its_worker_is_killed(stuck_by):
    """Past the job's deadline (the queue gives up on the thread, or the call itself raises
    WorkerStuck, whichever comes first), the job fails clearly, `on_stuck` kills the worker
    it waited on (counted as a restart), and the next job runs."""
    from mesh.engines.worker_process import WorkerStuck

    def stuck(deadline_s):
        if stuck_by == "the queue's deadline":
            time.sleep(deadline_s + 0.5)
            return [1]
        raise WorkerStuck(f"the vLLM worker answered no encode_prompt within {deadline_s:g} s: it is stuck")

    async def main():
        tp = TokenizerProcess(job_timeout_s=0.3)
        killed = []

        async def kill(why):
            killed.append(why)
            return True

        with pytest.raises(EngineError, match="took over 0.3 s"):
            await tp.run("a", stuck, kill)
        return await tp.run("a", lambda _deadline_s: [2], _never_stuck), tp.counts, killed

    ids, counts, killed = asyncio.run(main())
    assert ids == [2] and counts.timed_out == 1 and counts.restarts == 1 and counts.done == 1
    assert killed == ["a tokenize job ran past its 0.3 s deadline"]
@pytest.mark.slow
def test_a_stuck_tokenizer_worker_is_killed_and_replaced(demo_gguf):
    """The real worker, stopped (SIGSTOP) as if wedged in a tokenizer build: the job fails
    at its deadline, the worker is killed, and the next job runs in a new one."""

    async def main():
        tp = TokenizerProcess(job_timeout_s=120.0)
        try:
            first = await tp.encode(str(demo_gguf), None, "Hello there", "a")  # builds the tokenizer: seconds
            stuck = tp._conn.proc.pid
            os.kill(stuck, signal.SIGSTOP)
            tp.job_timeout_s = 1.0
            start = time.monotonic()
            with pytest.raises(EngineError, match="took over 1 s"):
                await tp.encode(str(demo_gguf), None, "Hello there", "a")
            failed_after = time.monotonic() - start
            assert tp._conn is None and tp.counts.restarts == 1 and tp.counts.timed_out == 1
            with pytest.raises(ProcessLookupError):
                os.kill(stuck, 0)  # killed and reaped
            tp.job_timeout_s = 120.0
            again = await tp.encode(str(demo_gguf), None, "Hello there", "a")
            assert tp._conn.proc.pid != stuck
            stats = await tp.cache_stats()
            return first, again, failed_after, stats
        finally:
            await tp.close()

    first, again, failed_after, stats = asyncio.run(main())
    assert first == again and first
    assert failed_after < 15.0  # the deadline, and the kill
    assert stats["entries"] == 1 and 0 < stats["held_bytes"] <= stats["budget_bytes"], stats


def test_the_tokenizer_cache_is_bounded_by_bytes(monkeypatch):
    """Entries are charged what the process grew by while they were built; the least recently
    used go past the budget, the newest always stays."""
    import mesh.node.tokenizer_worker as worker

    sizes = iter([100, 250, 400, 650, 900, 1500])  # RSS before/after each build: 150, 250, 600 bytes

    class Front:
        def __init__(self, path):
            self.path = path

        def encode_prompt(self, prompt):
            return [len(prompt)]

    monkeypatch.setattr(worker, "_rss_bytes", lambda: next(sizes))
    monkeypatch.setattr("mesh.engines.openvino_engine.OpenVINOEngine", Front)
    cache = TokenizerCache(budget_bytes=500)
    assert cache.encode("a", None, "xy") == [2]
    assert cache.encode("b", None, "xyz") == [3]
    assert cache.stats()["held_bytes"] == 400 and cache.stats()["entries"] == 2
    assert cache.encode("a", None, "x") == [1]  # a hit: no build, a is the most recent now
    assert cache.encode("c", None, "x") == [1]  # 600 bytes: over the budget alone; b and a go
    assert cache.stats() == {"entries": 1, "held_bytes": 600, "budget_bytes": 500, "evicted": 2}
    assert cache.forget("c") and cache.stats()["entries"] == 0


def test_models_with_one_tokenizer_share_one_build(monkeypatch, tmp_path, demo_gguf):
    """Two tenants' copies of the demo GGUF and a third file whose chat template differs:
    the copies share one front (built once); the other gets its own. Forgetting one copy
    keeps the shared front for the other; forgetting both frees it."""
    import mesh.node.tokenizer_worker as worker
    from mesh.modelfiles.gguf import tokenizer_digest

    built = []

    class Front:
        def __init__(self, path):
            built.append(path)

        def encode_prompt(self, prompt):
            return [len(prompt)]

    copies = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for copy in copies:
        copy.symlink_to(demo_gguf)
    data = demo_gguf.read_bytes()
    template = b"{% for message in messages %}"
    assert data.count(template) == 1
    other = tmp_path / "c.gguf"
    other.write_bytes(data.replace(template, b"{% for  essage in messages %}"))  # same length, other text
    assert tokenizer_digest(copies[0]) == tokenizer_digest(copies[1]) != tokenizer_digest(other)

    monkeypatch.setattr(worker, "_rss_bytes", lambda: 0)
    monkeypatch.setattr("mesh.engines.openvino_engine.OpenVINOEngine", Front)
    cache = TokenizerCache(budget_bytes=1 << 30)
    for path in (*copies, other, copies[0]):
        assert cache.encode(str(path), None, "xy") == [2]
    assert built == [str(copies[0]), str(other)] and cache.stats()["entries"] == 2
    assert not cache.forget(str(copies[0]))  # b still uses it
    assert cache.encode(str(copies[1]), None, "x") == [1] and len(built) == 2
    assert cache.forget(str(copies[1])) and cache.stats()["entries"] == 1
