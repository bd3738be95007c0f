"""`mesh bench adapters`: tokens per second of one OpenVINO instance when its requests use no
adapter, one LoRA adapter, or several (mesh.engines.openvino_adapters): OpenVINO GenAI applies
one adapter per step, so requests of different adapters take turns instead of batching.

Each round adds `--requests` greedy requests at once (the same prompt, `--output-len` tokens
each, EOS ignored), spread round-robin over k adapters made here (seeded random, rank 8, q/v;
mesh.modelfiles.lora.write_adapter), and steps the engine until they end. The model is an
OpenVINO IR folder exported by optimum (adapters need its weight names: a GGUF has none).
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from mesh.bench.report import emit

PROMPT = [{"role": "user", "content": "Tell me a story about a cat."}]


def _round(engine: Any, ids: list[int], adapters: list[str | None], requests: int, output_len: int) -> dict[str, Any]:
    from mesh.engines.engine_api import EngineRequest, Sampling

    for i in range(requests):
        sampling = Sampling(max_tokens=output_len, adapter=adapters[i % len(adapters)], adapter_scale=2.0)
        engine.add_request(EngineRequest(f"r{i}", len(ids), sampling, ids))
    started, tokens, steps = time.perf_counter(), 0, 0
    while engine.has_work():
        tokens += len(engine.step_blocking().token_ids)
        steps += 1
    wall = time.perf_counter() - started
    return {"tok_s": round(tokens / wall, 1), "steps": steps, "wall_s": round(wall, 2)}


def run(model: str, requests: int = 32, output_len: int = 32, counts: tuple[int, ...] = (1, 8, 32)) -> dict[str, Any]:
    from mesh.engines.openvino_engine import OpenVINOEngine
    from mesh.modelfiles.lora import WEIGHTS, BaseLinears, write_adapter

    base = BaseLinears.of_folder(model)
    engine = OpenVINOEngine(model, model_name="m", context_window=512, max_num_seqs=requests, ignore_eos=True)
    asyncio.run(engine.load())
    figures: dict[str, Any] = {"requests": requests, "output_len": output_len}
    try:
        if not engine.runs_adapters:
            raise SystemExit(f"{model}: this instance cannot run adapters (not an IR folder with a Llama-style "
                             "config.json)")
        ids = engine.encode_chat(PROMPT)
        with tempfile.TemporaryDirectory(prefix="mesh-adapters-") as tmp:
            made = [str(write_adapter(Path(tmp) / f"a{i}", base, seed=i + 1, std=0.05) / WEIGHTS)
                    for i in range(max(counts))]
            _round(engine, ids, [None], 1, 2)  # the first step's one-time costs, outside the figures
            figures["base"] = _round(engine, ids, [None], requests, output_len)
            for k in counts:
                figures[f"{k}_adapters"] = _round(engine, ids, list(made[:k]), requests, output_len)
    finally:
        asyncio.run(engine.unload())
    return figures


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapters", help="tok/s of one OpenVINO instance with no, one and many LoRA adapters")
    p.add_argument("--model", required=True, help="an OpenVINO IR folder exported by optimum (with its config.json)")
    p.add_argument("--requests", type=int, default=32, help="requests added at once per round (default 32)")
    p.add_argument("--output-len", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--adapters", default="1,8,32", help="adapter counts to spread the requests over (default 1,8,32)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=lambda a: emit("mesh bench adapters", run(
        a.model, a.requests, a.output_len, tuple(int(x) for x in a.adapters.split(","))), a.json, {}))
