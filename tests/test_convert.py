"""mesh.modelfiles.convert, GGUF -> Hugging Face folder for vLLM (issue 11 item 3).

Fast: bad inputs are refused with the file, what failed and what to do, and nothing is
left behind (run in Mesh's own environment: the checks come before any heavy import).
Slow: the demo SmolLM2 GGUF converted with the vLLM environment's Python; the folder is
complete, its tokenizer gives the same chat ids as OpenVINO's tokenizer of the GGUF (the
service tokenizes a prompt once, on either kind of node), and vLLM's CPU build loads it and
greedily answers "What is the capital of France?" with Paris (OpenVINO's reference: "The
capital of France is Paris.").
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mesh.engines.engine_api import EngineRequest, Sampling
from mesh.engines.worker_process import REPO_ROOT

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def convert(python: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                                      if p))
    return subprocess.run([python, "-m", "mesh.modelfiles.convert", "gguf-to-hf", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=REPO_ROOT, timeout=1800)


def test_bad_inputs_are_refused_saying_which_file_and_what_to_do(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a model")
    r = convert(sys.executable, not_gguf, tmp_path / "out")
    assert r.returncode == 2 and f"convert: {not_gguf} is not a GGUF file" in r.stderr and r.stdout == ""
    r = convert(sys.executable, tmp_path / "missing.gguf", tmp_path / "out")
    assert r.returncode == 2 and "missing.gguf does not exist" in r.stderr
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    (tmp_path / "taken").mkdir()
    r = convert(sys.executable, gguf, tmp_path / "taken")
    assert r.returncode == 2 and "taken already exists; delete it or name another output folder" in r.stderr
    r = convert(sys.executable, gguf, tmp_path / "out", "--dtype", "int4")
    assert r.returncode == 2 and "invalid choice: 'int4'" in r.stderr
    if all(importlib.util.find_spec(n) is not None for n in ("torch", "transformers", "gguf", "accelerate")):
        return  # this environment could convert: the next check is about one that cannot
    r = convert(sys.executable, gguf, tmp_path / "out")
    assert r.returncode == 1 and f"in {sys.executable}" in r.stderr and "scripts/setup.sh" in r.stderr
    assert "converting fake.gguf needs" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf", "model.gguf", "taken"]  # nothing left


def greedy(engine: Any, ids: list[int], max_tokens: int = 20) -> tuple[str, list[int]]:
    """Run one greedy request on a loaded engine to its end: (its text, its token ids)."""
    engine.add_request(EngineRequest("q", len(ids), Sampling(max_tokens=max_tokens, temperature=0.0), ids))
    text, tokens = "", []

    async def run() -> None:
        nonlocal text
        while engine.has_work():
            r = await engine.step()
            tokens.extend(r.token_ids)
            text += "".join(r.texts)

    asyncio.run(run())
    return text, tokens


def _converter_python() -> str:
    """The vLLM environment's Python, if it has what the conversion needs; else skip (fail
    under MESH_REQUIRE_VLLM=1)."""
    from mesh.engines.vllm_engine import find_vllm_python

    python = find_vllm_python()
    why = "vLLM is not installed (.venv-vllm)" if python is None else ""
    if python is not None:
        probe = subprocess.run([python, "-c", "import gguf, accelerate, transformers, torch"], capture_output=True,
                               text=True, timeout=300)
        if probe.returncode != 0:
            why = f"{python} lacks gguf or accelerate ({probe.stderr.strip().splitlines()[-1]})"
    if why:
        if os.environ.get("MESH_REQUIRE_VLLM") == "1":
            pytest.fail(f"MESH_REQUIRE_VLLM=1 but {why}: run scripts/setup.sh")
        pytest.skip(f"{why}: run scripts/setup.sh")
    return python


def export_python() -> str:
    """The export environment's Python (.venv-export); else skip (fail under
    MESH_WITH_EXPORT=1, which asked scripts/setup.sh for it, as CI does)."""
    from mesh.modelfiles.convert import find_export_python

    python = find_export_python()
    if python is None:
        why = "no export environment (MESH_WITH_EXPORT=1 scripts/setup.sh creates .venv-export)"
        if os.environ.get("MESH_WITH_EXPORT") == "1":
            pytest.fail(f"MESH_WITH_EXPORT=1 but {why}")
        pytest.skip(why)
    return python


@pytest.fixture(scope="module")
def converted(tmp_path_factory, demo_gguf) -> tuple[Path, dict, float]:
    python = _converter_python()
    out = tmp_path_factory.mktemp("convert") / "smollm2-hf"
    started = time.perf_counter()
    r = convert(python, demo_gguf, out)
    wall = time.perf_counter() - started
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads(r.stdout.strip().splitlines()[-1]), wall


@pytest.mark.slow
def test_the_demo_gguf_becomes_a_complete_hugging_face_folder(converted):
    out, summary, wall = converted
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files, files
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"],
            config["vocab_size"]) == (30, 576, 3, 49152)
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert summary["weight_bytes"] == weights and summary["dtype"] == "bfloat16"
    assert 250e6 < weights < 300e6  # 134.5 M parameters in bfloat16, the tied embedding stored once
    print(f"\nconversion: {wall:.1f} s wall ({summary['seconds']} s in the converter: load {summary['load_s']} s, "
          f"save {summary['save_s']} s), {summary['folder_bytes'] / 1e6:.1f} MB folder, "
          f"{summary['tensors']} tensors")


@pytest.mark.slow
def test_vllm_serves_the_converted_folder_with_openvinos_token_ids(converted, demo_gguf):
    from mesh.engines.openvino_engine import standalone_encoder
    from mesh.engines.vllm_engine import VLLMEngine

    out, _, _ = converted
    openvino = standalone_encoder(str(demo_gguf))
    e = VLLMEngine(out, context_window=1024, max_num_seqs=4, kv_capacity_bytes=64 << 20)
    asyncio.run(e.load())
    try:
        ids = e.encode_chat(QUESTION)
        assert ids == openvino.encode_chat(QUESTION)  # the same prompt ids on either kind of node
        text = "naïve café, 12345 + 678"
        assert e.decode(e.encode_prompt(text)) == text == openvino.decode(openvino.encode_prompt(text))
        answer, tokens = greedy(e, ids)
        print(f"\nvLLM on the converted folder: {answer!r} ({tokens})")
        assert "Paris" in answer
    finally:
        asyncio.run(e.unload())


@pytest.mark.slow
def test_the_converted_folder_exports_to_an_ir_openvino_serves(converted, tmp_path, demo_gguf):
    """HF folder -> OpenVINO IR (the export environment, .venv-export): the IR OpenVINO
    serves, with the GGUF's token ids and the same answer."""
    from mesh.engines.openvino_engine import OpenVINOEngine, standalone_encoder

    python = export_python()
    folder, _, _ = converted
    out = tmp_path / "smollm2-ir"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    started = time.perf_counter()
    r = subprocess.run([python, "-m", "mesh.modelfiles.convert", "hf-to-ir", str(folder), str(out)],
                       capture_output=True,
                       text=True, env=env, cwd=REPO_ROOT, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\nHF -> IR: {time.perf_counter() - started:.1f} s, {summary['folder_bytes'] / 1e6:.1f} MB")
    assert not [p for p in out.iterdir() if p.is_dir()]  # a flat folder: it travels by the weights plane
    e = OpenVINOEngine(out, context_window=1024, max_num_seqs=4)
    asyncio.run(e.load())
    try:
        ids = e.encode_chat(QUESTION)
        assert ids == standalone_encoder(str(demo_gguf)).encode_chat(QUESTION)
        answer, _ = greedy(e, ids)
        print(f"OpenVINO on the exported IR: {answer!r}")
        assert "Paris" in answer
    finally:
        asyncio.run(e.unload())


def test_the_export_environment_is_looked_for_in_the_repository():
    from mesh.modelfiles.convert import EXPORT_VENV

    assert EXPORT_VENV == Path(__file__).resolve().parents[1] / ".venv-export"
