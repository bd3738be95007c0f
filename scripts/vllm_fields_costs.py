"""What the OpenAI fields beyond plain sampling cost on the vLLM engine (docs/service.md):
the first step (prefill) and the mean decode step of one request alone, plain, with each
chosen token's log probability, with 20 alternatives, with a penalty, and under a JSON
schema (the first structured request of the instance, which builds vLLM's grammar tables,
then a second schema).

    python scripts/vllm_fields_costs.py HF_FOLDER [--json OUT]

Timings are time.perf_counter() around the engine calls, as the node runtime sees them, on
one worker process; a shared machine moves them: the load average is printed with them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mesh.engines.engine_api import EngineRequest, Sampling  # noqa: E402 - after the path above
from mesh.engines.vllm_engine import VLLMEngine  # noqa: E402 - likewise

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                         "country": {"type": "string", "maxLength": 32}},
        "required": ["city", "country"], "additionalProperties": False}
CASES: list[tuple[str, dict]] = [
    ("plain", {}),
    ("logprobs", {"logprobs": True}),
    ("top_logprobs=20", {"logprobs": True, "top_logprobs": 20}),
    ("repetition_penalty=1.3", {"repetition_penalty": 1.3}),
    ("json_schema (first)", {"json_schema": json.dumps(PERSON)}),
    ("json_schema (second)", {"json_schema": json.dumps(CITY)}),
]


async def one(e: VLLMEngine, rid: str, ids: list[int], sampling: dict) -> dict:
    e.add_request(EngineRequest(rid, len(ids), Sampling(max_tokens=32, ignore_eos=True, **sampling), ids))
    t = time.perf_counter()
    await e.step()
    first = time.perf_counter() - t
    decodes = []
    while e.has_work():
        t = time.perf_counter()
        await e.step()
        decodes.append(time.perf_counter() - t)
    return {"first_step_ms": round(1000 * first, 1), "decode_ms": round(1000 * sum(decodes) / len(decodes), 2)}


async def main(folder: str) -> dict:
    e = VLLMEngine(folder, context_window=512, max_num_seqs=4, kv_capacity_bytes=64 * 2**20)
    await e.load()
    try:
        ids = e.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
        await one(e, "warm", ids, {})
        return {name: await one(e, f"r{k}", ids, sampling) for k, (name, sampling) in enumerate(CASES)}
    finally:
        await e.unload()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a Hugging Face model folder (the demo: tests/conftest.py's demo_hf)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    results = asyncio.run(main(args.folder))
    print(f"load average {os.getloadavg()[0]:.2f}")
    for name, r in results.items():
        print(f"{name:24s} first step {r['first_step_ms']:8.1f} ms   decode step {r['decode_ms']:7.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
