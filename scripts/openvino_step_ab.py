"""Decode and prefill step times of OpenVINO worker engines built with different plugin
properties, stepped in turn so that every configuration sees the same background load
(docs/benchmarking.md, "Where a token's time goes"). Prints p10/p50/p90 per configuration.

    PYTHONPATH=$PWD python3 scripts/openvino_step_ab.py \
        '{"pinned": {}, "unpinned": {"ENABLE_CPU_PINNING": false}}' --batch 4 --rounds 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.engines.openvino_process import OpenVINOProcessEngine
from mesh.modelfiles.demo import demo_gguf_path


async def main(configs: dict[str, dict], batch: int, rounds: int, prompt: int, output: int) -> None:
    engines = {}
    for name, properties in configs.items():
        engine = OpenVINOProcessEngine(demo_gguf_path(fetch=True), model_name=name, context_window=2048,
                                       max_num_seqs=max(batch, 1), properties=properties, ignore_eos=True)
        await engine.load()
        engines[name] = engine
    decode: dict[str, list[float]] = {n: [] for n in engines}
    prefill: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(rounds + 1):  # round 0 warms every engine up, untimed
        for name, engine in engines.items():
            for k in range(batch):
                ids = [(17 * k + 5 * i + 7 * r) % 40000 + 100 for i in range(prompt)]
                engine.add_request(EngineRequest(f"{name}-{r}-{k}", prompt, Sampling(max_tokens=output, ignore_eos=True),
                                                 ids, output))
        while any(e.has_work() for e in engines.values()):
            for name, engine in engines.items():
                if not engine.has_work():
                    continue
                t0 = time.perf_counter()
                result = await engine.step()
                seconds = time.perf_counter() - t0
                if r and result.kind.name == "PREFILL":
                    prefill[name].append(seconds)
                elif r and len(result.request_ids) == batch:
                    decode[name].append(seconds)
    for name in engines:
        d = statistics.quantiles(decode[name], n=10)
        print(f"{name:12s} batch {batch}: decode step ms p10 {1000 * d[0]:.1f} p50 {1000 * statistics.median(decode[name]):.1f} "
              f"p90 {1000 * d[-1]:.1f} (n={len(decode[name])}); prefill steps of {batch}x{prompt} tokens ms "
              f"{sorted(round(1000 * s) for s in prefill[name])}")
    print(f"load average {os.getloadavg()}")
    for engine in engines.values():
        await engine.unload()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", help='JSON: {"name": {plugin properties}, ...}')
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=158, help="prompt tokens (guidellm's 128-token prompts are 158 with the chat template)")
    parser.add_argument("--output", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(main(json.loads(args.configs), args.batch, args.rounds, args.prompt, args.output))
