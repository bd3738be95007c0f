"""Measure the vLLM engine's costs for docs/vllm.md: start-up, step times, the worker
process's round trip, KV resize (reinit and rebuild) with running requests, unload.

    python scripts/vllm_measure.py [--model tiny-llama|llama-3.2-3b|PATH] [--reps N] [--json OUT]

Timings come from time.perf_counter() around the engine calls, as the node runtime sees
them. On a small shared machine the medians move with other jobs: the load average is
printed with the results.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mesh.calibration.vllm_calibration import resolve_model_arg  # noqa: E402
from mesh.engines.engine_api import EngineRequest, Sampling  # noqa: E402
from mesh.engines.vllm_engine import VLLMEngine  # noqa: E402


def ids(n: int, k: int = 0) -> list[int]:
    return [65 + (k + 7 * i) % 26 for i in range(n)]


def median_ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 2)


async def steps(e: VLLMEngine, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await e.step()
        out.append(time.perf_counter() - t)
    return out


async def measure(folder: Path, in_process: bool, reps: int, window: int, batches: list[int],
                  prompts: list[int], resize: bool) -> dict:
    res: dict = {"in_process": in_process}
    t0 = time.perf_counter()
    e = VLLMEngine(folder, context_window=window, max_num_seqs=max(batches), ignore_eos=True,
                   in_process=in_process)
    block = e.block_size * e.kv_bytes_per_token
    blocks = max(batches) * (-(-window // e.block_size)) + 1
    await e.load()  # worker start + import vllm + tokenizer
    res["start_and_import_s"] = round(time.perf_counter() - t0, 2)
    t = time.perf_counter()
    await e.resize_kv(blocks * block)  # the build: weights + KV cache
    res["build_s"] = round(time.perf_counter() - t, 2)
    res["facts"] = {k: e.facts.get(k) for k in ("import_s", "build_s", "kv_bytes_per_token", "weight_bytes",
                                                "block_size", "num_blocks")}
    # prefill of one prompt
    pre = {}
    for n in prompts:
        xs = []
        for r in range(reps):
            e.add_request(EngineRequest(f"p{n}-{r}", n, Sampling(max_tokens=1), ids(n, r)))
            xs += await steps(e, 1)
        pre[n] = median_ms(xs)
    res["prefill_ms"] = pre
    # decode at context ~64
    dec = {}
    for b in batches:
        for j in range(b):
            e.add_request(EngineRequest(f"d{b}-{j}", 60, Sampling(max_tokens=reps + 3), ids(60, j)))
        while True:  # prefill steps
            r = await e.step()
            if r.kind.value == "decode":
                break
        dec[b] = median_ms(await steps(e, reps))
        while e.has_work():
            await e.step()
    res["decode_ms_ctx64"] = dec
    if resize:
        out = {}
        for mode in ("reinit", "rebuild"):
            e.resize_mode = mode
            xs = {"grow": [], "shrink": []}
            for r in range(max(2, reps // 5) if mode == "reinit" else 1):
                for j in range(4):
                    e.add_request(EngineRequest(f"z{mode}{r}-{j}", 200, Sampling(max_tokens=50), ids(200, j)))
                await steps(e, 3)
                for what, size in (("grow", (blocks + 8) * block), ("shrink", blocks * block)):
                    t = time.perf_counter()
                    await e.resize_kv(size)
                    xs[what].append(time.perf_counter() - t)
                    assert e.last_resize["reran"] == 4, e.last_resize
                for rid in list(e._live):
                    e.abort(rid)
            out[mode] = {k: median_ms(v) for k, v in xs.items()}
        res["resize_ms_4_running"] = out
    t = time.perf_counter()
    await e.unload()
    res["unload_s"] = round(time.perf_counter() - t, 2)
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--prompts", default="128,512")
    p.add_argument("--no-resize", action="store_true")
    p.add_argument("--modes", default="worker,inprocess")
    p.add_argument("--json")
    a = p.parse_args()
    folder, name = resolve_model_arg(a.model)
    out = {"model": name, "load_average_start": os.getloadavg(), "runs": []}
    for mode in a.modes.split(","):
        out["runs"].append(asyncio.run(measure(folder, mode == "inprocess", a.reps, a.window,
                                               [int(x) for x in a.batches.split(",")],
                                               [int(x) for x in a.prompts.split(",")], not a.no_resize)))
        print(json.dumps(out["runs"][-1]), flush=True)
    out["load_average_end"] = os.getloadavg()
    print(json.dumps({"load_average": [out["load_average_start"], out["load_average_end"]]}))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
