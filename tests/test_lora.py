"""PEFT LoRA folders (mesh.modelfiles.lora): what the tests' writer makes, and what the check of an
adapter against its base accepts and refuses, each refusal saying what is wrong."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mesh.modelfiles.lora import CONFIG, MODULES, WEIGHTS, AdapterError, BaseLinears, read_adapter, write_adapter

# The demo model's shape (SmolLM2-135M), cut to 2 layers.
DEMO = {"hidden_size": 576, "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "intermediate_size": 1536}


@pytest.fixture
def base() -> BaseLinears:
    return BaseLinears.of_config(DEMO)


def test_the_bases_linear_shapes_come_from_its_config(base):
    assert base.layers == 2
    assert base.shapes["q_proj"] == (576, 576) and base.shapes["k_proj"] == (192, 576)
    assert base.shapes["down_proj"] == (576, 1536) and base.shapes["gate_proj"] == (1536, 576)


def test_a_written_adapter_has_pefts_keys_and_shapes(tmp_path, base):
    folder = write_adapter(tmp_path / "a", base, rank=4, alpha=8, seed=3)
    tensors = load_file(str(folder / WEIGHTS))
    assert set(tensors) == {f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
                            for i in range(2) for m in ("q_proj", "v_proj") for ab in "AB"}
    assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (192, 4)
    assert json.loads((folder / CONFIG).read_text())["target_modules"] == ["q_proj", "v_proj"]
    facts = read_adapter(folder, base)
    assert (facts.rank, facts.scale, facts.modules) == (4, 2.0, ("q_proj", "v_proj"))
    assert facts.nbytes == (folder / WEIGHTS).stat().st_size


def test_the_zero_adapter_changes_nothing_and_the_random_one_is_seeded(tmp_path, base):
    zero = load_file(str(write_adapter(tmp_path / "z", base, seed=None, modules=MODULES) / WEIGHTS))
    assert all(not t.any() for k, t in zero.items() if "lora_B" in k)
    assert any(t.any() for k, t in zero.items() if "lora_A" in k)
    one = load_file(str(write_adapter(tmp_path / "r1", base, seed=1) / WEIGHTS))
    again = load_file(str(write_adapter(tmp_path / "r1b", base, seed=1) / WEIGHTS))
    other = load_file(str(write_adapter(tmp_path / "r2", base, seed=2) / WEIGHTS))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert np.array_equal(one[key], again[key]) and not np.array_equal(one[key], other[key])


def test_rslora_scales_by_the_root_of_the_rank(tmp_path, base):
    folder = write_adapter(tmp_path / "a", base, rank=4, alpha=8, seed=1)
    config = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps(dict(config, use_rslora=True)))
    assert read_adapter(folder, base).scale == 4.0


def _rewrite(folder, change):
    tensors = load_file(str(folder / WEIGHTS))
    change(tensors)
    save_file(tensors, str(folder / WEIGHTS))


@pytest.mark.parametrize("spoil, says", [
    (lambda f: (f / CONFIG).unlink(), "no adapter_config.json"),
    (lambda f: (f / WEIGHTS).unlink(), "no adapter_model.safetensors"),
    (lambda f: (f / WEIGHTS).write_bytes(b"GGUF not a safetensors file"), "not a safetensors file"),
    (lambda f: (f / CONFIG).write_text("{"), "not JSON"),
    (lambda f: (f / CONFIG).write_text(json.dumps({"peft_type": "PREFIX_TUNING", "r": 8})), "only LORA"),
    (lambda f: (f / CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 8, "use_dora": True})), "use_dora"),
    (lambda f: (f / CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 0})), "r must be a positive"),
    (lambda f: (f / CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 16})), "need [16, 576]"),
    (lambda f: _rewrite(f, lambda t: t.update({"model.layers.0.q_proj.weight": np.zeros(2, np.float32)})),
     "is not a PEFT LoRA key"),
    (lambda f: _rewrite(f, lambda t: t.update({
        "base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": np.zeros((8, 576), np.float32)})),
     "targets layer 5; the base has 2 layers"),
    (lambda f: _rewrite(f, lambda t: t.update({
        "base_model.model.model.layers.0.self_attn.qkv.lora_A.weight": np.zeros((8, 576), np.float32)})),
     "which the base does not have"),
    (lambda f: _rewrite(f, lambda t: t.update({
        "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight": np.zeros((576, 8), np.float32)})),
     "has shape [576, 8]; the base and r=8 need [192, 8]"),
    (lambda f: _rewrite(f, lambda t: t.pop("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight")),
     "lora_A without its pair"),
])
def test_a_bad_adapter_is_refused_saying_what_is_wrong(tmp_path, base, spoil, says):
    folder = write_adapter(tmp_path / "a", base, seed=1)
    read_adapter(folder, base)  # sound before it is spoilt
    spoil(folder)
    with pytest.raises(AdapterError) as info:
        read_adapter(folder, base)
    assert says in str(info.value)


def test_a_file_is_not_an_adapter_folder(tmp_path, base):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    with pytest.raises(AdapterError, match="is not a folder"):
        read_adapter(tmp_path / "a.gguf", base)
