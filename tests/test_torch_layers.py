"""The layer-range engine (mesh.engines.torch_layers) and what crosses a layer boundary
(engine_api's HiddenStates), against the correctness test of live scaling (BlitzScale 5.2,
lambdaScale 4.3-4.4): greedy output token for token the same whole on one engine, split
across two engines at every layer boundary (hidden states handed over as bytes, as the
network carries them), and through a switch from a pipeline to a full instance that
recomputes the KV cache from the prompt and the tokens so far. And weights that arrive
block by block: a layer counts once every block before it is in.

Fast tests run a tiny random Llama written here (and compare it with transformers' Llama
where transformers is installed); slow ones the demo SmolLM2-135M from its Hugging Face
folder (tests/conftest.py's demo_hf), with transformers' LlamaForCausalLM in the
converter's environment as an independent reference. Skips where PyTorch is missing
unless MESH_REQUIRE_BENCH=1 (CI), where that fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

from mesh.engines.engine_api import EngineError, HiddenStates, LayerRange, NextTokens, TokenBatch, can_run_layers
from mesh.policy.layer_prefix import LayerSpans, complete_layers, usable_layers

# the demo tokenizer's ids of "The capital of France is" and "Once upon a time, there was"
PROMPTS = {"a": [504, 3575, 282, 4649, 314], "b": [6403, 1980, 253, 655, 28, 665, 436]}


def _torch():
    try:
        import safetensors  # noqa: F401 - only checked for: the engine imports it
        import torch
    except ImportError as exc:
        why = f"PyTorch or safetensors is not installed ({exc}); the layers extra: pip install -e '.[layers]'"
        if os.environ.get("MESH_REQUIRE_BENCH") == "1":
            pytest.fail(why + " and MESH_REQUIRE_BENCH=1")
        pytest.skip(why)
    return torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """torch computes on one thread here: on a machine whose cores other processes share,
    two threads spinning at each barrier made a step ten times slower (15 s against 1.3 s
    for 8 tokens of the demo model)."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def over_the_wire(h: HiddenStates) -> HiddenStates:
    """What the receiving agent rebuilds from a frame: the fields as JSON, the tensor as bytes."""
    meta = json.loads(json.dumps({"layer": h.layer, "request_ids": h.request_ids, "positions": h.positions,
                                  "token_counts": h.token_counts, "hidden_size": h.hidden_size, "dtype": h.dtype}))
    payload = bytes(bytearray(h.data))
    assert len(payload) == h.nbytes == h.tokens * h.hidden_size * 4
    return HiddenStates(meta["layer"], tuple(meta["request_ids"]), tuple(meta["positions"]),
                        tuple(meta["token_counts"]), meta["hidden_size"], meta["dtype"], payload)


def generate(stages: Sequence, prompts: dict[str, list[int]], n: int,
             start: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Greedy decoding of every prompt together (one batch per step) through `stages` in
    order; `start`: tokens already generated, prefilled with the prompt from position 0."""
    out = {r: list((start or {}).get(r, [])) for r in prompts}
    feed = {r: list(p) + out[r] for r, p in prompts.items()}
    pos = dict.fromkeys(prompts, 0)
    rids = tuple(prompts)
    while len(out[rids[0]]) < n:
        x = TokenBatch(rids, tuple(pos[r] for r in rids), tuple(tuple(feed[r]) for r in rids))
        for stage in stages:
            x = stage.run_layers(x if isinstance(x, TokenBatch) else over_the_wire(x))
        assert isinstance(x, NextTokens) and x.request_ids == rids
        for r, t in zip(rids, x.token_ids):
            pos[r] += len(feed[r])
            feed[r] = [t]
            out[r].append(t)
    return out


def release_all(*engines) -> None:
    for e in engines:
        for r in list(e.request_ids):
            e.release(r)
        assert e.kv_bytes_in_use() == 0


# --- no model ---------------------------------------------------------------------------------

def test_hidden_states_count_their_bytes_and_refuse_a_wrong_size():
    h = HiddenStates(3, ("a", "b"), (0, 7), (5, 1), 576, "bfloat16", bytes(6 * 576 * 2))
    assert (h.tokens, h.shape, h.nbytes) == (6, (6, 576), 6 * 576 * 2)
    with pytest.raises(EngineError, match="carry 10 B, but 6 tokens x 576 x float32 make 13824 B"):
        HiddenStates(3, ("a", "b"), (0, 7), (5, 1), 576, "float32", bytes(10))
    with pytest.raises(EngineError, match="2 request ids, 1 positions"):
        HiddenStates(3, ("a", "b"), (0,), (5, 1), 576, "float32", bytes(6 * 576 * 4))
    with pytest.raises(EngineError, match="inside the model's 30 layers"):
        LayerRange(12, 31, 30)
    assert LayerRange(0, 12, 30).first and not LayerRange(0, 12, 30).last and LayerRange(12, 30, 30).last


def test_whole_model_engines_say_they_cannot_run_layer_ranges():
    from mesh.engines.openvino_engine import OpenVINOEngine
    from mesh.engines.openvino_process import OpenVINOProcessEngine
    from mesh.engines.simulated import SimulatedEngine
    from mesh.engines.torch_layers import TorchLayerEngine
    from mesh.engines.vllm_engine import VLLMEngine

    for cls in (OpenVINOEngine, OpenVINOProcessEngine, SimulatedEngine, VLLMEngine):
        assert cls.runs_layer_ranges is False and not can_run_layers(cls), cls
    assert TorchLayerEngine.runs_layer_ranges is True


def test_usable_layer_prefix_grows_only_with_contiguous_blocks():
    # header+embedding 0-100, layers end at 130, 160, 190, 220, head to 250; blocks of 100, 60, 60, 30
    spans = LayerSpans(100, (130, 160, 190, 220), 250)
    sizes = [100, 60, 60, 30]
    assert usable_layers(spans, set(), sizes) == 0
    assert usable_layers(spans, {1}, sizes) == 0  # layers without the embedding before them: nothing
    assert usable_layers(spans, {0}, sizes) == 0  # the embedding alone
    assert usable_layers(spans, {0, 2}, sizes) == 0  # block 2 before block 1 adds nothing
    assert complete_layers(spans, {0, 2}, sizes) == frozenset({2, 3})  # (a pipeline member could run them)
    assert usable_layers(spans, {0, 1}, sizes) == 2
    assert usable_layers(spans, {0, 1, 2}, sizes) == 4
    assert usable_layers(spans, {0, 1, 2, 3}, sizes) == 4
    assert spans.boundaries() == [100, 130, 160, 190, 220]


def test_without_torch_the_engine_says_to_install_the_extra():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import mesh.engines.torch_layers as t\n"
            "from mesh.engines.engine_api import EngineError, LayerRange\n"
            "try:\n    t.TorchLayerEngine.from_folder('nowhere')\n"
            "except EngineError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert r.returncode == 0, r.stderr
    assert "needs PyTorch, which is not installed" in r.stdout and "pip install -e '.[layers]'" in r.stdout


# --- a tiny random Llama ----------------------------------------------------------------------

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "vocab_size": 97, "tie_word_embeddings": False,
        "max_position_embeddings": 256, "hidden_act": "silu", "eos_token_id": 2, "bos_token_id": 1}
TINY_PROMPTS = {"a": [1, 5, 17, 42, 8, 63, 11], "b": [1, 90, 3]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 4-layer Llama with random bfloat16 weights (untied LM head), as a Hugging Face folder.
    The attention weights are three times the usual scale so the output depends on the
    context (at 1x, greedy decoding settles on one token, and a KV bug would go unseen)."""
    torch = _torch()
    from safetensors.torch import save_file

    c = TINY
    g = torch.Generator().manual_seed(7)
    h, f, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    att = 3 * h ** -0.5

    def w(*shape: int, scale: float | None = None) -> "torch.Tensor":
        t = torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)
        return t.to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], h, scale=1.0), "model.norm.weight": 1 + w(h, scale=0.1),
               "lm_head.weight": w(c["vocab_size"], h, scale=0.5)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": 1 + w(h, scale=0.1),
                    p + "post_attention_layernorm.weight": 1 + w(h, scale=0.1),
                    p + "self_attn.q_proj.weight": w(c["num_attention_heads"] * hd, h, scale=att),
                    p + "self_attn.k_proj.weight": w(c["num_key_value_heads"] * hd, h, scale=att),
                    p + "self_attn.v_proj.weight": w(c["num_key_value_heads"] * hd, h, scale=att),
                    p + "self_attn.o_proj.weight": w(h, c["num_attention_heads"] * hd, scale=att),
                    p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
                    p + "mlp.down_proj.weight": w(h, f)}
    out = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(c))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_tiny_model_matches_transformers_llama(tiny):
    torch = _torch()
    transformers = pytest.importorskip("transformers", reason="no transformers here to compare with")
    from mesh.engines.torch_layers import TorchLayerEngine

    ref = transformers.LlamaForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    mine = generate([TorchLayerEngine.from_folder(tiny, device="cpu")], {"a": TINY_PROMPTS["a"]}, 10)["a"]
    ids = torch.tensor([TINY_PROMPTS["a"]])
    theirs = ref.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert mine == theirs[0, ids.shape[1]:].tolist()


def test_tiny_model_split_at_every_layer_and_the_switch_match_whole(tiny):
    _torch()
    from mesh.engines.torch_layers import TorchLayerEngine

    whole = TorchLayerEngine.from_folder(tiny, device="cpu")
    n, layers = 10, TINY["num_hidden_layers"]
    expected = generate([whole], TINY_PROMPTS, n)
    assert min(len(set(t)) for t in expected.values()) > 5  # a real sequence, not one token repeated
    for cut in range(1, layers):
        front, back = whole.share(LayerRange(0, cut, layers)), whole.share(LayerRange(cut, layers, layers))
        assert generate([front, back], TINY_PROMPTS, n) == expected, f"split at layer {cut}"
        release_all(front, back)
    for k in (1, 4):
        stages = [whole.share(LayerRange(a, b, layers)) for a, b in ((0, 1), (1, 3), (3, 4))]
        piped = generate(stages, TINY_PROMPTS, k)
        full = whole.share(LayerRange.whole(layers))
        assert generate([full], TINY_PROMPTS, n, start=piped) == expected, f"switch after {k} tokens"


def test_tiny_model_samples_with_a_seed_the_same_whole_or_split(tiny):
    _torch()
    from mesh.engines.engine_api import Sampling
    from mesh.engines.torch_layers import TorchLayerEngine

    whole = TorchLayerEngine.from_folder(tiny, device="cpu")
    assert can_run_layers(whole)
    hot = {"a": Sampling(temperature=1.5, top_p=0.9, seed=5), "b": Sampling(temperature=1.5, seed=6)}

    def sample(stages: list) -> dict[str, list[int]]:
        out = {}
        for rid in ("a", "b"):  # one request at a time: a request's generator lives with its KV
            x, toks = TokenBatch((rid,), (0,), (tuple(TINY_PROMPTS[rid]),)), []
            for _ in range(12):
                for s in stages:
                    x = s.run_layers(x, hot)
                toks.append(x.token_ids[0])
                x = TokenBatch((rid,), (len(TINY_PROMPTS[rid]) + len(toks) - 1,), ((toks[-1],),))
            out[rid] = toks
        release_all(*stages)
        return out

    once = sample([whole])
    assert once == sample([whole]) == sample([whole.share(LayerRange(0, 2, 4)), whole.share(LayerRange(2, 4, 4))])
    assert once != generate([whole], TINY_PROMPTS, 12)  # not greedy
    assert all(0 <= t < TINY["vocab_size"] for t in once["a"] + once["b"])


def test_tiny_model_refuses_a_wrong_position_layer_or_missing_layers(tiny):
    _torch()
    from mesh.engines.torch_layers import TorchLayerEngine

    whole = TorchLayerEngine.from_folder(tiny, device="cpu")
    e = whole.share(LayerRange(0, 2, 4))
    h = e.run_layers(TokenBatch(("a",), (0,), ((1, 5, 17),)))
    assert isinstance(h, HiddenStates) and h.layer == 2 and h.nbytes == 3 * 64 * 4
    assert e.kv_tokens("a") == 3 and e.kv_bytes_in_use() == 3 * e.kv_bytes_per_token
    with pytest.raises(EngineError, match="comes at position 2, but layer 0 holds 3 of its tokens"):
        e.run_layers(TokenBatch(("a",), (2,), ((9,),)))
    with pytest.raises(EngineError, match="hidden states for layer 2 sent to layers \\[0, 2\\)"):
        e.run_layers(h)
    with pytest.raises(EngineError, match="take hidden states, not token ids"):
        whole.share(LayerRange(2, 4, 4)).run_layers(TokenBatch(("a",), (0,), ((1,),)))
    e.release("a")
    e.release("never-seen")
    assert e.kv_bytes_in_use() == 0 and e.kv_tokens("a") == 0


def blocks_of(path: Path, boundaries: list[int], block_bytes: int) -> tuple[list[tuple[int, int]], list[bytes]]:
    from mesh.weights.blocks import pack

    manifest = pack(path, block_bytes, boundaries=boundaries)
    data = path.read_bytes()
    spans = [(b.offset, b.size) for b in manifest.blocks]
    return spans, [data[o:o + s] for o, s in spans]


def test_tiny_model_serves_from_the_blocks_it_has(tiny, tmp_path):
    _torch()
    from mesh.engines.torch_layers import TorchLayerEngine
    from mesh.modelfiles.layer_order import read_layout, write_layer_ordered

    layout = write_layer_ordered(tiny, tmp_path / "tiny.safetensors")
    assert [t.name for t in sorted(layout.tensors.values(), key=lambda t: t.start)][0] == "model.embed_tokens.weight"
    ends = [*layout.boundaries(), layout.spans.total_bytes]  # one block per part: embedding, 4 layers, head
    spans = [(a, b - a) for a, b in zip([0, *ends], ends)]
    raw = (tmp_path / "tiny.safetensors").read_bytes()
    data = [raw[o:o + n] for o, n in spans]
    assert read_layout(data[0]).spans == layout.spans  # block 0 tells a receiver the layout
    whole = TorchLayerEngine.from_folder(tiny, device="cpu")
    expected = generate([whole], TINY_PROMPTS, 6)
    e = TorchLayerEngine.receiving(read_layout(data[0]), spans, device="cpu")
    assert e.receive_block(2, data[2]) == 0  # layer 1 before the embedding and layer 0: nothing
    assert e.receive_block(0, data[0]) == 0
    assert e.receive_block(1, data[1]) == 2  # the gap filled: layers 0 and 1
    # execute while loading: this engine runs layers [0, 2), a full one the rest
    rest = whole.share(LayerRange(2, 4, 4))

    class Front:
        def run_layers(self, x):
            return e.run_layers(x, stop=2)

    assert generate([Front(), rest], TINY_PROMPTS, 6) == expected
    with pytest.raises(EngineError, match="layers \\[0, 2\\) of \\[0, 4\\) hold weights"):
        e.run_layers(TokenBatch(("z",), (0,), ((1,),)))
    assert e.receive_block(4, data[4]) == 2 and e.receive_block(3, data[3]) == 4
    assert not e.ready()  # no final norm and LM head yet
    assert e.receive_block(5, data[5]) == 4 and e.ready()
    e.release("a"), e.release("b")
    assert generate([e], TINY_PROMPTS, 6) == expected
    tail = TorchLayerEngine.from_folder(tmp_path / "tiny.safetensors", LayerRange(3, 4, 4), device="cpu")
    assert generate([whole.share(LayerRange(0, 3, 4)), tail], TINY_PROMPTS, 6) == expected


# --- the demo model (SmolLM2-135M, 30 layers) -------------------------------------------------

@pytest.fixture(scope="module")
def demo_engine(demo_hf):
    _torch()
    from mesh.engines.torch_layers import TorchLayerEngine

    return TorchLayerEngine.from_folder(demo_hf, device="cpu")


@pytest.fixture(scope="module")
def demo_expected(demo_engine) -> dict[str, list[int]]:
    """Greedy, 8 tokens for each prompt, the whole model on one engine."""
    out = generate([demo_engine], PROMPTS, 8)
    release_all(demo_engine)
    return out


@pytest.mark.slow
def test_demo_whole_matches_transformers_reference(demo_hf, demo_engine, demo_expected):
    """An independent reference: transformers' LlamaForCausalLM, float32, greedy, in the
    converter's environment (it has transformers; Mesh's own need not)."""
    from test_convert import _converter_python

    script = ("import json, sys, torch\nfrom transformers import LlamaForCausalLM\n"
              "m = LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
              "for ids in json.loads(sys.argv[2]):\n"
              "    x = torch.tensor([ids])\n"
              "    y = m.generate(x, max_new_tokens=8, do_sample=False)\n"
              "    print(json.dumps(y[0, x.shape[1]:].tolist()))\n")
    r = subprocess.run([_converter_python(), "-c", script, str(demo_hf), json.dumps(list(PROMPTS.values()))],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert reference == [demo_expected[k][:len(ref)] for k, ref in zip(PROMPTS, reference)]
    # one request alone gives the tokens it gets in a batch
    assert generate([demo_engine], {"b": PROMPTS["b"]}, 8)["b"] == demo_expected["b"]
    release_all(demo_engine)


@pytest.mark.slow
def test_demo_split_across_two_engines_at_every_layer_matches_whole(demo_engine, demo_expected):
    layers = demo_engine.layer_range.num_layers
    assert layers == 30
    for cut in range(1, layers):
        front = demo_engine.share(LayerRange(0, cut, layers))
        back = demo_engine.share(LayerRange(cut, layers, layers))
        assert generate([front, back], PROMPTS, 8) == demo_expected, f"split at layer {cut}"
        release_all(front, back)


@pytest.mark.slow
def test_demo_switch_from_pipeline_to_full_instance_matches_whole(demo_engine, demo_expected):
    """lambdaScale 4.4: a pipeline of two engines serves the first k tokens, then a full
    instance recomputes the KV cache from the prompt and those tokens and goes on."""
    layers = demo_engine.layer_range.num_layers
    for cut, k in ((11, 1), (19, 3), (27, 6)):
        stages = [demo_engine.share(LayerRange(0, cut, layers)), demo_engine.share(LayerRange(cut, layers, layers))]
        piped = generate(stages, PROMPTS, k)
        full = demo_engine.share(LayerRange.whole(layers))
        assert generate([full], PROMPTS, 8, start=piped) == demo_expected, f"switch after {k} tokens, cut {cut}"


@pytest.mark.slow
def test_demo_blocks_in_layer_order_serve_before_the_last_arrives(demo_hf, demo_engine, demo_expected, tmp_path):
    from mesh.engines.torch_layers import TorchLayerEngine
    from mesh.modelfiles.layer_order import read_layout, write_layer_ordered

    layout = write_layer_ordered(demo_hf, tmp_path / "layered.safetensors")
    spans, data = blocks_of(tmp_path / "layered.safetensors", layout.boundaries(), 24 << 20)
    e = TorchLayerEngine.receiving(read_layout(data[0]), spans, device="cpu")
    ready, layers = [], demo_engine.layer_range.num_layers
    for i, block in enumerate(data[:-1]):
        ready.append(e.receive_block(i, block))
        if 0 < ready[-1] < layers and (i == 0 or ready[-1] != ready[-2]):
            k = ready[-1]  # serve with the layers it has; the full instance runs the rest
            back = demo_engine.share(LayerRange(k, layers, layers))
            front = type("Front", (), {"run_layers": lambda self, x, k=k: e.run_layers(x, stop=k)})()
            assert generate([front, back], PROMPTS, 4) == {r: t[:4] for r, t in demo_expected.items()}, k
            release_all(e, back)
    assert ready == sorted(ready) and ready[0] == 0 and 0 < ready[len(ready) // 2] < ready[-1] < layers
    assert not e.ready()
    assert e.receive_block(len(data) - 1, data[-1]) == layers and e.ready()
    assert generate([e], PROMPTS, 8) == demo_expected


def test_a_whole_instance_follows_the_engine_protocol_and_batching_rule(tiny):
    _torch()
    import asyncio

    from mesh.engines.engine_api import Engine, EngineRequest, FinishReason, Sampling
    from mesh.engines.torch_engine import TorchEngine
    from mesh.engines.torch_layers import TorchLayerEngine
    from mesh.policy.batching import IterationKind

    expected = generate([TorchLayerEngine.from_folder(tiny, device="cpu")], TINY_PROMPTS, 6)
    e = TorchEngine(tiny, context_window=64, max_num_seqs=2, device="cpu", ignore_eos=True)
    assert isinstance(e, Engine) and e.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4
    asyncio.run(e.load())
    assert e.weight_bytes == e.layers.weight_bytes
    for rid, n in (("a", 6), ("b", 3), ("c", 2)):
        e.add_request(EngineRequest(rid, len(TINY_PROMPTS.get(rid, [1, 2])), Sampling(max_tokens=n),
                                    TINY_PROMPTS.get(rid, [1, 2])))
    with pytest.raises(EngineError, match="already running"):
        e.add_request(EngineRequest("a", 1, Sampling(), [1]))
    steps, tokens = [], {}

    async def run() -> None:
        while e.has_work():
            r = await e.step()
            steps.append((r.kind, tuple(r.request_ids), dict(r.finished)))
            for rid, t in zip(r.request_ids, r.token_ids):
                tokens.setdefault(rid, []).append(t)

    asyncio.run(run())
    P, D = IterationKind.PREFILL, IterationKind.DECODE
    assert steps[:4] == [(P, ("a", "b"), {}), (D, ("a", "b"), {}), (D, ("a", "b"), {"b": FinishReason.LENGTH}),
                         (P, ("c",), {})]  # c waits for room (max_num_seqs=2), then is prefilled alone
    assert tokens["a"] == expected["a"] and tokens["b"] == expected["b"][:3] and len(tokens["c"]) == 2
    assert e.kv_bytes_in_use() == 0 and not e.layers.request_ids
    e.add_request(EngineRequest("d", 3, Sampling(max_tokens=5), [1, 2, 3]))
    asyncio.run(e.step())
    assert e.kv_bytes_in_use() == 3 * e.kv_bytes_per_token
    e.abort("d")
    assert not e.has_work() and e.kv_bytes_in_use() == 0
    asyncio.run(e.unload())


@pytest.mark.slow
def test_demo_as_a_whole_instance_answers_with_its_tokenizer(demo_hf):
    _torch()
    import asyncio

    from mesh.engines.engine_api import EngineRequest, Sampling
    from mesh.engines.torch_engine import TorchEngine

    pytest.importorskip("tokenizers", reason="no tokenizers package: the engine has no text")
    e = TorchEngine(demo_hf, context_window=256, device="cpu")
    asyncio.run(e.load())
    ids = e.encode_prompt("The capital of France is")
    assert ids == PROMPTS["a"]
    e.add_request(EngineRequest("q", len(ids), Sampling(max_tokens=8, stop=("\n",)), ids))
    text = ""

    async def run() -> None:
        nonlocal text
        while e.has_work():
            text += "".join((await e.step()).texts)

    asyncio.run(run())
    assert text == " Paris."  # greedy; the stop string cut the rest
    asyncio.run(e.unload())
