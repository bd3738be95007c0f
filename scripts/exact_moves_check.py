"""Does a moved greedy stream go on exactly? And what do exact numerics cost? (docs/openvino.md)

For each set of OpenVINO CPU properties: one engine on the demo model generates 64 greedy
tokens for two prompts (the reference), then for k in 0, 8, 12, 16, 20, 30, 40 recomputes
prompt + the first k reference tokens in one prefill, as a moved request is, and counts the
continuations that differ from the reference. Then the median decode step at batch 1 and 8
and one 10x-prompt prefill, in ms.

    python scripts/exact_moves_check.py            # the defaults, f16 KV, EXACT_RECOMPUTE, ...
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mesh.engines.openvino_engine import EXACT_RECOMPUTE, OpenVINOEngine  # noqa: E402
from mesh.engines.engine_api import EngineRequest, Sampling  # noqa: E402
from mesh.modelfiles.demo import demo_gguf_path  # noqa: E402

PROMPTS = ([{"role": "user", "content": "Name three colours of the rainbow and say one thing about each."}],
           [{"role": "user", "content": "Write a short story about a cat who learns to fly."}])
SETTINGS = ({}, {"KV_CACHE_PRECISION": "f16"}, {"KV_CACHE_PRECISION": "f16", "INFERENCE_PRECISION_HINT": "f32"},
            {"KV_CACHE_PRECISION": "f16", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}, EXACT_RECOMPUTE)


async def _generate(engine: OpenVINOEngine, rid: str, ids: list[int], n: int, ignore_eos: bool = False) -> list[int]:
    engine.add_request(EngineRequest(rid, len(ids), Sampling(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos),
                                     list(ids)))
    out: list[int] = []
    while engine.has_work():
        out += list((await engine.step()).token_ids or [])
    return out


async def _check(properties: dict) -> str:
    engine = OpenVINOEngine(str(demo_gguf_path()), model_name="m", context_window=2048, max_num_seqs=16,
                            properties=properties)
    await engine.load()
    moves = diverged = 0
    for p, messages in enumerate(PROMPTS):
        ids = engine.encode_chat(messages)
        ref = await _generate(engine, f"ref{p}", ids, 64)
        for k in (0, 8, 12, 16, 20, 30, 40):
            if k >= len(ref):
                continue
            moves += 1
            diverged += ref[:k] + await _generate(engine, f"p{p}k{k}", ids + ref[:k], 64 - k) != ref
    ids = engine.encode_chat(PROMPTS[1])
    steps: dict[int, float] = {}
    for batch in (1, 8):
        times = []
        for i in range(batch):
            engine.add_request(EngineRequest(f"b{batch}-{i}", len(ids), Sampling(max_tokens=32, temperature=0.0,
                                                                                 ignore_eos=True), list(ids)))
        while engine.has_work():
            t = time.perf_counter()
            await engine.step()
            times.append(time.perf_counter() - t)
        steps[batch] = statistics.median(times[2:]) * 1e3
    t = time.perf_counter()
    await _generate(engine, "prefill", ids * 10, 1)
    prefill_ms = (time.perf_counter() - t) * 1e3
    await engine.unload()
    return (f"{str(properties or 'defaults'):<100} diverged {diverged:>2}/{moves}  decode b1 {steps[1]:5.1f} ms  "
            f"b8 {steps[8]:5.1f} ms  prefill {len(ids) * 10} tokens {prefill_ms:6.1f} ms")


if __name__ == "__main__":
    for settings in SETTINGS:
        print(asyncio.run(_check(dict(settings))), flush=True)
