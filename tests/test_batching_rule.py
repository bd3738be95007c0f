"""The batching rule, pinned: a scripted workload gives the same iteration sequence (kind and
batch size of every step) on the simulated engine and on the real OpenVINO engine.

The script adds requests before given steps (so it does not depend on timing): several
prompts at once (one prefill takes them while they fit the prefill token budget), arrivals
while others decode, requests of different output lengths finishing in different rounds,
and one that ends at its first token. The slow test runs it on the demo model; the fast
one checks the simulated engine against the sequence written out by hand.
"""
from __future__ import annotations

import asyncio

import pytest

from doubles import LinearTimes
from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.engines.simulated import SimulatedEngine
from mesh.policy.batching import IterationKind

WINDOW = 256  # context window and prefill token budget of both engines
# step index -> requests added just before that step: (id, prompt tokens, output tokens)
SCRIPT: dict[int, list[tuple[str, int, int]]] = {
    0: [("a", 100, 4), ("b", 100, 6), ("c", 100, 3)],  # a + b fit the budget of 256, c waits
    3: [("d", 20, 5)],  # joins while a, b, c decode
    5: [("e", 60, 1), ("f", 200, 3)],  # e ends at its first token; e + f exceed the budget
    8: [("g", 10, 6), ("h", 12, 6), ("i", 14, 6), ("j", 16, 6)],  # more than MAX_BATCH would hold
    30: [("k", 10, 2)],  # arrives when the engine is idle
}
MAX_BATCH = 4  # max_num_seqs: most requests one engine holds running
EXPECTED = [  # (kind, batch size) of every step, by the rule, for SCRIPT
    ("prefill", 2), ("prefill", 1), ("decode", 3),  # a + b fit 256 tokens, c does not; waiting prompts first
    ("prefill", 1), ("decode", 4),  # d joins; c ends (3 tokens)
    ("prefill", 1), ("prefill", 1),  # e alone (e + f > 256; e ends at its first token), f
    ("decode", 4),  # a ends (4 tokens): b, d, f run
    ("prefill", 1), ("decode", 4),  # g..j wait but only one fits MAX_BATCH
    ("prefill", 1), ("decode", 4), ("prefill", 2), ("decode", 4),  # h; i + j as b, d, f end
    ("decode", 4), ("decode", 4), ("decode", 3), ("decode", 2),
    ("prefill", 1), ("decode", 1),  # k on an idle engine
]


def _kinds(steps: list[tuple[IterationKind, int]]) -> list[tuple[str, int]]:
    return [(k.value, n) for k, n in steps]


async def run_script(engine, prompt_ids) -> list[tuple[IterationKind, int]]:
    """Drive `engine` through SCRIPT; the (kind, batch size) of every step."""
    steps: list[tuple[IterationKind, int]] = []
    k = 0
    while True:
        for rid, prompt, out in SCRIPT.get(k, ()):
            engine.add_request(EngineRequest(rid, prompt, Sampling(max_tokens=out), prompt_ids(prompt, rid),
                                             output_len=out))
        if not engine.has_work():
            if k > max(SCRIPT):
                return steps
            k += 1
            continue
        result = await engine.step()
        steps.append((result.kind, len(result.request_ids)))
        k += 1


def simulated() -> SimulatedEngine:
    times = LinearTimes(prefill_per_token=0.0001, decode_base=0.001)
    return SimulatedEngine("m", times, kv_bytes_per_token=1000, weight_bytes=10**6, context_window=WINDOW,
                           prefill_token_budget=WINDOW, max_batch=MAX_BATCH)


def test_simulated_engine_follows_the_scripted_rule():
    from mesh.replay.virtual_loop import run_virtual

    steps = _kinds(run_virtual(run_script(simulated(), lambda n, rid: None)))
    assert steps == EXPECTED
    # every request produced exactly its output length: tokens = sum of batch sizes
    assert sum(n for _, n in steps) == sum(out for reqs in SCRIPT.values() for _, _, out in reqs)


@pytest.mark.slow
def test_openvino_engine_runs_the_same_iteration_sequence_as_the_simulated_one():
    from mesh.calibration.openvino_calibration import TokenPrompts
    from mesh.engines.openvino_engine import OpenVINOEngine
    from mesh.modelfiles.demo import demo_gguf_path
    from mesh.replay.virtual_loop import run_virtual

    sim_steps = _kinds(run_virtual(run_script(simulated(), lambda n, rid: None)))

    async def live() -> list[tuple[IterationKind, int]]:
        engine = OpenVINOEngine(demo_gguf_path(fetch=True), model_name="m", context_window=WINDOW,
                                max_num_seqs=MAX_BATCH, ignore_eos=True)
        await engine.load()
        tp = TokenPrompts.for_engine(engine)
        try:
            return await run_script(engine, lambda n, rid: tp.ids(n, ord(rid)))
        finally:
            await engine.unload()

    live_steps = _kinds(asyncio.run(live()))
    assert live_steps == sim_steps


def test_first_divergence_names_the_iteration_and_the_arrival_between():
    from mesh.bench.fidelity_trace import first_divergence, per_instance_match

    def row(i, inst, kind, batch, start):
        return {"i": i, "instance": inst, "kind": kind, "batch": batch, "tokens": 10, "start_s": start,
                "duration_s": 0.01, "predicted_s": 0.01, "predicted_kind": kind, "predicted_batch": batch}

    live = [row(0, "a", "prefill", 1, 0.0), row(1, "a", "decode", 1, 0.02), row(2, "a", "decode", 1, 0.05)]
    sim = [row(0, "a", "prefill", 1, 0.0), row(1, "a", "decode", 1, 0.01), row(2, "b", "prefill", 1, 0.03)]
    d = first_divergence(live, sim, [("r1", "b", 0.04)])
    assert d.index == 2 and "r1 (b) at 0.040 s arrived" in d.why
    assert first_divergence(live, live).index == -1
    m = per_instance_match(live, sim)
    assert m["a"] == {"live": 3, "sim": 2, "common_prefix": 2, "prefills_live": 1, "prefills_sim": 1}
    assert m["b"]["prefills_sim"] == 1 and m["b"]["live"] == 0
