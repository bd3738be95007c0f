"""VLLMEngine: fast tests of the model folders, estimates and input checks; slow tests on
vLLM's CPU build with a tiny local Llama (mesh.modelfiles.local, no download).

The slow tests need a Python with vLLM: $MESH_VLLM_PYTHON, this one, or .venv-vllm
(scripts/setup.sh makes it). They skip with that reason when there is none, unless
MESH_REQUIRE_VLLM=1 (CI), where a missing vLLM is a failure. One engine is shared by most
slow tests (each worker start imports vLLM: several seconds on 2 cores).
"""
from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path

import pytest

from mesh.engines.engine_api import Engine, EngineError, EngineRequest, FinishReason, Sampling
from mesh.engines.vllm_engine import VLLMEngine, find_vllm_python, resolve_hf_model
from mesh.modelfiles.local import (
    TINY_LLAMA_CONFIG,
    llama_parameter_count,
    shape_config,
    shape_names,
    tokenizer_files,
    write_shape_folder,
    write_tiny_llama,
)
from mesh.policy.batching import IterationKind

WINDOW = 256


# ---- fast tests -------------------------------------------------------------------------------

def test_tiny_llama_folder(tmp_path: Path) -> None:
    out = write_tiny_llama(tmp_path / "tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == json.loads(json.dumps(TINY_LLAMA_CONFIG))
    raw = (out / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    assert sum(v["data_offsets"][1] - v["data_offsets"][0] for v in tensors.values()) == 4 * llama_parameter_count(cfg)
    assert len(raw) == 8 + n + 4 * llama_parameter_count(cfg)
    assert tensors["model.layers.1.self_attn.k_proj.weight"]["shape"] == [2 * 32, 128]
    # the same seed writes the same weights
    again = write_tiny_llama(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == raw


def test_byte_level_tokenizer_files() -> None:
    files = tokenizer_files(300)
    vocab = files["tokenizer.json"]["model"]["vocab"]
    assert len(vocab) == 300 and sorted(vocab.values()) == list(range(300))
    assert vocab["A"] == 65 and vocab["<|endoftext|>"] == 256 and vocab["<r299>"] == 299
    assert "add_generation_prompt" in files["tokenizer_config.json"]["chat_template"]
    with pytest.raises(ValueError):
        tokenizer_files(100)


@pytest.mark.parametrize("name,params_b,kv_per_token", [
    ("llama-3.2-3b", 3.21, 2 * 28 * 8 * 128 * 2),
    ("llama-2-7b", 6.74, 2 * 32 * 32 * 128 * 2),
    ("llama-2-13b", 13.0, 2 * 40 * 40 * 128 * 2),
])
def test_shape_folders_give_real_sizes(tmp_path: Path, name: str, params_b: float, kv_per_token: int) -> None:
    assert name in shape_names()
    folder = write_shape_folder(name, tmp_path / name)
    assert not list(folder.glob("*.safetensors"))
    assert llama_parameter_count(shape_config(name)) / 1e9 == pytest.approx(params_b, rel=0.01)
    engine = VLLMEngine(folder, device="cuda")  # nothing starts until load()
    assert engine.load_format == "dummy"
    assert engine.kv_bytes_per_token == kv_per_token  # 16-bit K and V
    assert engine.weight_bytes == pytest.approx(2 * params_b * 1e9, rel=0.01)
    assert engine.context_window == 4096 and engine.prefill_token_budget == 4096
    assert isinstance(engine, Engine)


def test_model_folder_checks(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="does not exist"):
        resolve_hf_model(tmp_path / "nothing")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(EngineError, match="OpenVINO engine"):
        resolve_hf_model(gguf)
    (tmp_path / "ir").mkdir()
    (tmp_path / "ir" / "openvino_model.xml").write_text("")
    with pytest.raises(EngineError, match="no config.json.*OpenVINO IR"):
        resolve_hf_model(tmp_path / "ir")
    folder = tmp_path / "notok"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    with pytest.raises(EngineError, match="no tokenizer"):
        resolve_hf_model(folder)
    tiny = write_tiny_llama(tmp_path / "tiny")
    assert resolve_hf_model(tiny / "config.json")[0] == tiny


def test_constructor_checks(tmp_path: Path) -> None:
    tiny = write_tiny_llama(tmp_path / "tiny")
    with pytest.raises(EngineError, match="below context_window"):
        VLLMEngine(tiny, context_window=512, prefill_token_budget=256)
    with pytest.raises(EngineError, match="device"):
        VLLMEngine(tiny, device="tpu")
    shape = write_shape_folder("llama-2-7b", tmp_path / "7b")
    with pytest.raises(EngineError, match="load_format='dummy'"):
        VLLMEngine(shape, load_format="auto")
    e = VLLMEngine(tiny, context_window=WINDOW)
    assert e.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # float32 K and V, 2 layers, 2 KV heads of 32
    assert e.weight_bytes == (tiny / "model.safetensors").stat().st_size
    assert e.min_kv_bytes() == 3 * 128 * e.kv_bytes_per_token  # 2 blocks for 256 tokens + the null block
    with pytest.raises(EngineError, match="not loaded"):
        e.add_request(EngineRequest("r", 3, Sampling(), [1, 2, 3]))


def test_missing_vllm_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    assert find_vllm_python() == str(tmp_path / "no-such-python")
    e = VLLMEngine(write_tiny_llama(tmp_path / "tiny"))
    with pytest.raises(EngineError, match="cannot start the vLLM worker"):
        asyncio.run(e.load())


# ---- slow tests on vLLM's CPU build ---------------------------------------------------------

def _vllm_python() -> str | None:
    python = find_vllm_python()
    if python is None and os.environ.get("MESH_REQUIRE_VLLM") == "1":
        pytest.fail("MESH_REQUIRE_VLLM=1 but no Python with vLLM: run scripts/setup.sh (creates .venv-vllm)")
    return python


needs_vllm = pytest.mark.skipif(
    find_vllm_python() is None and os.environ.get("MESH_REQUIRE_VLLM") != "1",
    reason="vLLM is not installed (neither this Python, $MESH_VLLM_PYTHON nor .venv-vllm has it); "
           "run scripts/setup.sh to create .venv-vllm")


@pytest.fixture(scope="module")
def tiny_models() -> tuple[Path, Path]:
    """Two tiny Llamas with different random weights, in the data folder (written once)."""
    from mesh.paths import data_dir

    _vllm_python()
    paths = []
    for seed in (0, 1):
        folder = data_dir() / "models" / f"tiny-llama-seed{seed}"
        if not (folder / "config.json").exists():
            write_tiny_llama(folder, seed=seed)
        paths.append(folder)
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def engine(tiny_models: tuple[Path, Path]):
    e = VLLMEngine(tiny_models[0], context_window=WINDOW, max_num_seqs=8, kv_capacity_bytes=16 * 128 * 1024)
    asyncio.run(e.load())
    yield e
    asyncio.run(e.unload())


def req(rid: str, ids: list[int], **sampling) -> EngineRequest:
    return EngineRequest(rid, len(ids), Sampling(**sampling), ids)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [65 + (offset + 7 * i) % 26 for i in range(n)]


def drain(e: VLLMEngine, *, resize: dict[int, int] | None = None) -> tuple[dict[str, list[int]], dict[str, str], list]:
    """Step until idle: tokens and text per request, and (kind, ids) per step; `resize`
    maps a step number to a KV size to resize to before that step."""
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    steps = []

    async def run() -> None:
        k = 0
        while e.has_work():
            if resize and k in resize:
                await e.resize_kv(resize[k])
            r = await e.step()
            k += 1
            assert len(set(r.request_ids)) == len(r.request_ids)
            steps.append((r.kind, list(r.request_ids), dict(r.finished)))
            for rid, tok, text in zip(r.request_ids, r.token_ids, r.texts):
                tokens.setdefault(rid, []).append(tok)
                texts[rid] = texts.get(rid, "") + text

    asyncio.run(run())
    return tokens, texts, steps


@needs_vllm
@pytest.mark.slow
def test_one_step_is_one_iteration_prefill_and_decode_apart(engine: VLLMEngine) -> None:
    e = engine
    e.add_request(req("a", prompt(20), max_tokens=6))
    r = asyncio.run(e.step())
    assert (r.kind, list(r.request_ids)) == (IterationKind.PREFILL, ["a"])
    r = asyncio.run(e.step())
    assert (r.kind, list(r.request_ids)) == (IterationKind.DECODE, ["a"])
    # vLLM alone would decode "a" in the step that prefills "b" and "c": here it does not
    e.add_request(req("b", prompt(30, 1), max_tokens=4))
    e.add_request(req("c", prompt(10, 2), max_tokens=3))
    r = asyncio.run(e.step())
    assert (r.kind, list(r.request_ids)) == (IterationKind.PREFILL, ["b", "c"])
    info = asyncio.run(e.info())
    assert info["requests"] == {"a": (20, 2), "b": (30, 1), "c": (10, 1)}
    r = asyncio.run(e.step())
    assert (r.kind, list(r.request_ids)) == (IterationKind.DECODE, ["a", "b", "c"])
    # KV accounting: the parent's count equals vLLM's block pool after every step
    assert e.kv_bytes_in_use() == e.vllm_kv_bytes_in_use == 3 * 128 * e.kv_bytes_per_token
    tokens, _, steps = drain(e)
    assert all(kind is IterationKind.DECODE for kind, _, _ in steps)
    assert steps[-1][2] == {"a": FinishReason.LENGTH}
    assert e.kv_bytes_in_use() == e.vllm_kv_bytes_in_use == 0


@needs_vllm
@pytest.mark.slow
def test_prefill_batches_follow_the_token_budget(engine: VLLMEngine) -> None:
    """Prompts are prefilled in arrival order while they fit the budget (256 here)."""
    e = engine
    for k, n in enumerate((150, 100, 50)):
        e.add_request(req(f"p{k}", prompt(n, k), max_tokens=2))
    _, _, steps = drain(e)
    assert [(kind, ids) for kind, ids, _ in steps[:2]] == [(IterationKind.PREFILL, ["p0", "p1"]),
                                                             (IterationKind.PREFILL, ["p2"])]
    assert steps[2][0] is IterationKind.DECODE and steps[2][1] == ["p0", "p1", "p2"]


@needs_vllm
@pytest.mark.slow
def test_streaming_order_text_and_length(engine: VLLMEngine) -> None:
    e = engine
    text = "Héllo wörld, 你好! "
    ids = e.encode_prompt(text)
    assert e.decode(ids) == text and len(ids) == len(text.encode())
    chat = e.encode_chat([{"role": "user", "content": "hi"}])
    assert e.decode(chat) == "user\nhi\nassistant\n"  # special tokens are skipped in text
    e.add_request(req("s", ids, max_tokens=12))
    tokens, texts, steps = drain(e)
    assert len(tokens["s"]) == 12 and steps[-1][2] == {"s": FinishReason.LENGTH}
    assert [kind for kind, _, _ in steps] == [IterationKind.PREFILL] + [IterationKind.DECODE] * 11
    # the deltas concatenate to the whole output, in order (an incomplete UTF-8 tail is dropped:
    # the random model emits arbitrary bytes)
    assert texts["s"] == e.decode(tokens["s"]).rstrip("\ufffd")


@needs_vllm
@pytest.mark.slow
def test_abort(engine: VLLMEngine) -> None:
    e = engine
    e.add_request(req("x", prompt(40), max_tokens=50))
    e.add_request(req("y", prompt(40, 3), max_tokens=6))
    asyncio.run(e.step())
    asyncio.run(e.step())
    e.abort("x")
    e.abort("x")  # twice, and unknown ids: ignored
    e.abort("nobody")
    tokens, _, steps = drain(e)
    assert "x" not in tokens and all("x" not in ids for _, ids, _ in steps)
    assert len(tokens["y"]) == 4 and steps[-1][2] == {"y": FinishReason.LENGTH}
    assert asyncio.run(e.info())["kv_bytes_in_use"] == 0
    # an abort sent while a step runs: that step's token for it is dropped
    e.add_request(req("z", prompt(10), max_tokens=5))

    async def abort_during_step() -> tuple[object, bool]:
        task = asyncio.ensure_future(e.step())
        await asyncio.sleep(0)  # the step is sent and awaited (unless the reply was already there)
        during = not task.done()
        e.abort("z")
        return await task, during

    r, during = asyncio.run(abort_during_step())
    if during:
        assert "z" not in r.request_ids
    assert not e.has_work()


@needs_vllm
@pytest.mark.slow
def test_context_window_refused_before_vllm(engine: VLLMEngine) -> None:
    e = engine
    with pytest.raises(EngineError, match=rf"prompt of {WINDOW} tokens leaves no room.*at most {WINDOW - 1}"):
        e.add_request(req("long", prompt(WINDOW)))
    with pytest.raises(EngineError, match="outside .* vocabulary of 264"):
        e.add_request(req("bad", [1, 2, 999]))
    with pytest.raises(EngineError, match="prompt_len"):
        e.add_request(EngineRequest("n", 5, Sampling(), [1, 2]))
    assert not e.has_work()
    # a prompt that leaves room: max_tokens is cut at the window and the request ends with length
    e.add_request(req("edge", prompt(WINDOW - 3), max_tokens=100))
    tokens, _, steps = drain(e)
    assert len(tokens["edge"]) == 3 and steps[-1][2] == {"edge": FinishReason.LENGTH}


@needs_vllm
@pytest.mark.slow
def test_sampling_parameters_pass_through(engine: VLLMEngine) -> None:
    e = engine
    p = prompt(16, 5)

    def run(**sampling) -> tuple[list[int], str, dict]:
        e.add_request(req("q", p, **sampling))
        tokens, texts, steps = drain(e)
        return tokens.get("q", []), texts.get("q", ""), steps[-1][2]

    greedy, greedy_text, _ = run(max_tokens=10)
    assert run(max_tokens=10)[0] == greedy
    hot = [run(max_tokens=10, temperature=1.5, seed=s)[0] for s in (1, 1, 2)]
    assert hot[0] == hot[1] and hot[0] != hot[2] and hot[0] != greedy
    assert run(max_tokens=10, temperature=1.5, top_p=1e-6, seed=3)[0] == greedy  # top_p ~ 0 is greedy
    # a stop string: the text is cut before it and the request ends with stop
    stop = greedy_text[4:6]
    assert stop and greedy_text.find(stop) == 4
    tokens, text, finished = run(max_tokens=10, stop=(stop,))
    assert finished == {"q": FinishReason.STOP} and text == greedy_text[:4]
    assert tokens == greedy[:len(tokens)] and len(tokens) < 10


@needs_vllm
@pytest.mark.slow
def test_resize_keeps_running_requests_correct(engine: VLLMEngine) -> None:
    e = engine
    reqs = [("r0", prompt(60), 14), ("r1", prompt(30, 4), 9), ("r2", prompt(100, 9), 12)]

    def run(resize: dict[int, int] | None = None) -> tuple[dict[str, list[int]], list]:
        for rid, ids, n in reqs:
            e.add_request(req(rid, ids, max_tokens=n))
        tokens, _, steps = drain(e, resize=resize)
        return tokens, steps

    before = e.num_blocks
    block = e.block_size * e.kv_bytes_per_token
    alone, alone_steps = run()
    grown, grown_steps = run({3: (before + 8) * block, 7: (before + 8) * block})  # grow, then the same size
    assert e.num_blocks == before + 8
    assert e.last_resize == {"mode": "none", "blocks": before + 8, "reran": 0, "seconds": 0.0}
    shrunk, _ = run({5: 6 * block})  # shrink while all three run
    assert e.num_blocks == 6 and e.last_resize["mode"] == "reinit" and e.last_resize["reran"] == 3
    assert grown == alone and shrunk == alone  # greedy streams continue exactly
    assert len(grown_steps) == len(alone_steps)  # the re-run's tokens come as one DECODE step
    assert [k for k, _, _ in grown_steps] == [k for k, _, _ in alone_steps]
    asyncio.run(e.resize_kv(16 * block))  # back to the shared size
    assert e.num_blocks == 16
    assert asyncio.run(e.info())["num_blocks"] == 16


@needs_vllm
@pytest.mark.slow
def test_a_stopped_cpu_instance_is_parked_and_adopted(tiny_models: tuple[Path, Path]) -> None:
    """mesh.engines.parking on vLLM's CPU build: an unloaded instance's worker is kept (its
    requests dropped), a load with the same settings adopts it (same process, then sized
    by the node's resize) and generates what the first did; other settings build anew."""
    from mesh.engines.parking import ParkingLot

    async def main() -> None:
        lot = ParkingLot(1 << 30)
        first = VLLMEngine(tiny_models[0], context_window=WINDOW, max_num_seqs=8, kv_capacity_bytes=16 * 128 * 1024)
        first.parking = lot
        try:
            await first.load()
            ids = prompt(20)
            first.add_request(req("a", ids, max_tokens=6, temperature=0))
            first.add_request(req("left", prompt(30, 3), max_tokens=50, temperature=0))
            expected: list[int] = []
            while "a" in first._live:
                r = await first.step()
                expected += [t for rid, t in zip(r.request_ids, r.token_ids) if rid == "a"]
            pid = first.worker_pid
            await first.unload()  # "left" is still running: dropped with the park
            assert lot.models() == [first.model_name]
            other = VLLMEngine(tiny_models[0], context_window=WINDOW, max_num_seqs=4)
            assert other._park_key() != first._park_key()
            again = VLLMEngine(tiny_models[0], context_window=WINDOW, max_num_seqs=8)
            again.parking = lot
            await again.load()
            assert again.loaded and again.loaded_from == "parked" and again.worker_pid == pid
            await again.resize_kv(8 * 128 * 1024)  # the node sizes the adopted cache
            again.add_request(req("b", ids, max_tokens=6, temperature=0))
            got: list[int] = []
            while again.has_work():
                got += list((await again.step()).token_ids or ())
            assert got == expected
            await again.unload()
            assert lot.models() == [again.model_name]
        finally:
            await lot.close()

    asyncio.run(main())


@needs_vllm
@pytest.mark.slow
def test_resize_below_vllm_minimum_is_raised_to_it(engine: VLLMEngine) -> None:
    e = engine
    asyncio.run(e.resize_kv(1))
    assert e.num_blocks == 3 and e.kv_bytes_allocated() == e.min_kv_bytes()
    e.add_request(req("m", prompt(200), max_tokens=50))  # 250 tokens fit the 2 usable blocks
    tokens, _, _ = drain(e)
    assert len(tokens["m"]) == 50
    asyncio.run(e.resize_kv(16 * e.block_size * e.kv_bytes_per_token))


@needs_vllm
@pytest.mark.slow
def test_two_models_on_one_node_stepped_alternately(tiny_models: tuple[Path, Path]) -> None:
    """Two instances (different weights) under one NodeRuntime: the compute subsystem
    interleaves their iterations; outputs equal each model run alone (greedy)."""
    from doubles import LinearTimes
    from mesh.node.runtime import NodeRuntime
    from mesh.policy.kv_demand import RunningMean
    from mesh.policy.node_spec import NodeSpec
    from mesh.policy.slo import SLO
    from mesh.wire.served_request import Outcome, ServedRequest

    prompts = {"m0": [prompt(40), prompt(25, 3)], "m1": [prompt(33, 1), prompt(50, 2)]}

    async def on_node() -> tuple[dict[str, list[int]], list, dict]:
        node = NodeRuntime(NodeSpec("gpu-0", "cpu", 2**30), record_iterations=True)
        node.start()
        times = LinearTimes(prefill_per_token=1e-4, decode_base=0.01)
        slo = SLO(ttft_min_s=600.0, tpot_s=60.0)
        engines = {}
        for k, path in enumerate(tiny_models):
            engines[f"m{k}"] = VLLMEngine(path, model_name=f"m{k}", context_window=WINDOW, max_num_seqs=8)
            issued = node.memory_ops.start_instance(f"m{k}", f"m{k}", engines[f"m{k}"], times, slo, RunningMean(8),
                                                    60.0)
            assert issued.accepted
        while not all(inst.loaded for inst in node.instances.values()):
            await asyncio.sleep(0.2)
        out: dict[str, list[int]] = {}
        done: list[ServedRequest] = []
        now = asyncio.get_running_loop().time()
        for model, ps in prompts.items():
            for j, ids in enumerate(ps):
                rid = f"{model}-{j}"
                r = ServedRequest(req(rid, ids, max_tokens=8), model, now, slo,
                                  on_output=lambda r, toks, _t, _lp: out.setdefault(r.request_id, []).extend(toks),
                                  on_done=done.append)
                assert node.try_admit(model, r).ok
        while len(done) < 4:
            await asyncio.sleep(0.05)
        assert all(r.outcome is Outcome.COMPLETED for r in done)
        sizes = {m: e.kv_bytes_allocated() for m, e in engines.items()}
        for m in list(node.instances):
            node.memory_ops.stop_instance(m)
        await asyncio.sleep(0.5)
        await node.stop()
        for e in engines.values():
            await e.unload()
        return out, node.iterations, sizes

    together, iterations, sizes = asyncio.run(on_node())
    order = [it.instance_id for it in iterations]
    assert {"m0", "m1"} == set(order)
    switches = sum(1 for a, b in zip(order, order[1:]) if a != b)
    assert switches >= 3, order  # stepped alternately, not one model after the other
    assert all(size > 0 for size in sizes.values())  # each was built with the memory subsystem's KV size

    async def alone(k: int) -> dict[str, list[int]]:
        e = VLLMEngine(tiny_models[k], context_window=WINDOW, max_num_seqs=8, kv_capacity_bytes=2**21)
        await e.load()
        for j, ids in enumerate(prompts[f"m{k}"]):
            e.add_request(req(f"m{k}-{j}", ids, max_tokens=8))
        out: dict[str, list[int]] = {}
        while e.has_work():
            r = await e.step()
            for rid, tok in zip(r.request_ids, r.token_ids):
                out.setdefault(rid, []).append(tok)
        await e.unload()
        return out

    separately = {**asyncio.run(alone(0)), **asyncio.run(alone(1))}
    assert together == separately
    assert together["m0-0"] != together["m1-0"][: len(together["m0-0"])]  # different models


@needs_vllm
@pytest.mark.slow
def test_mesh_calibrate_vllm_writes_a_profile(tmp_path: Path, tiny_models: tuple[Path, Path]) -> None:
    """`mesh calibrate --engine vllm` on the smallest grid the runner allows."""
    from mesh.cli import main
    from mesh.perf import load_profile

    out = tmp_path / "tiny.json"
    code = main(["calibrate", "--engine", "vllm", "--model", str(tiny_models[0]), "--name", "tiny", "--out", str(out),
                 "--max-prompt", "32", "--max-batch", "2", "--max-context", "32", "--reps", "1", "--warmup", "0",
                 "--max-wait", "0", "--no-progress"])
    assert code == 0
    profile = load_profile(out)
    assert (profile.engine, profile.model, profile.device_kind) == ("vllm", "tiny", "cpu")
    assert profile.kv_bytes_per_token == 1024 and profile.max_context == 64
    assert profile.prefill_lengths == (16, 32) and profile.decode_batches == (1, 2)
    assert all(t > 0 for t in profile.prefill_s) and all(t > 0 for row in profile.decode_s for t in row)
    assert profile.provenance["engine"]["scheduler"].startswith("mesh.engines.vllm_scheduler.PhasedScheduler")


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stuck_vllm_tokenizer_is_killed_and_restarted_through_the_agent(tiny_models: tuple[Path, Path]) -> None:
    """Issue 32 item 4, vLLM's way: a node agent (its real control port and client) tokenizes
    with the model's front, then with its loaded instance; each time the worker is stopped
    (SIGSTOP): the tokenize fails with a clear error at the job's deadline, the worker is
    killed, and a front's next tokenize runs in a fresh worker; the instance fails (the
    service places a new one), its requests would go back with their progress
    (tests/test_node_resume.py)."""
    import time

    from mesh.control.agent_client import AgentCallError, AgentClient
    from mesh.node.agent_server import AgentServer
    from mesh.policy.node_spec import NodeSpec
    from mesh.wire.agent_protocol import InstanceSpec
    from test_worker_process import stop_process

    token = "vllm-stuck-token"
    path = str(tiny_models[0])
    front_msg = {"t": "tokenize", "model": "tiny", "path": path, "engine": "vllm", "context_window": WINDOW,
                 "prompt": "Hello there", "tenant": "a"}

    def reaped(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    async def stuck_tokenize(server: AgentServer, client: AgentClient, pid: int, msg: dict) -> float:
        stop_process(pid)
        server.tokenizers.job_timeout_s = 2.0
        start = time.monotonic()
        with pytest.raises(AgentCallError, match="tokenizing took over 2 s and was stopped"):
            await client.call_message(msg)
        took = time.monotonic() - start
        server.tokenizers.job_timeout_s = 300.0  # a first call in a fresh worker imports and builds: seconds
        return took

    async def main() -> None:
        server = AgentServer(NodeSpec("g0", "gpu", 8 * 2**30), token, load_roots=[str(tiny_models[0].parent)])
        server.tokenizers.job_timeout_s = 300.0
        events: list[dict] = []
        client = AgentClient("g0", events.append, lambda _why: None)
        try:
            await client.connect(await server.serve("127.0.0.1:0"), token)
            first = (await client.call_message(front_msg))["ids"]
            (front,) = server.models.fronts.values()
            stuck = front.worker_pid
            took = await stuck_tokenize(server, client, stuck, front_msg)
            assert took < 20.0, took  # the 2 s deadline and the kill, not for ever (a shared machine)
            assert reaped(stuck) and not server.models.fronts  # killed, and the front dropped
            counts = server.tokenizers.counts
            assert (counts.timed_out, counts.restarts) == (1, 1)
            assert (await client.call_message(front_msg))["ids"] == first  # a fresh front and worker
            (fresh,) = server.models.fronts.values()
            assert fresh is not front and fresh.worker_pid not in (None, stuck)

            spec = InstanceSpec("i1", "tiny", path, WINDOW, engine="vllm", max_num_seqs=4)
            await client.call_message(spec.to_message())
            for _ in range(3000):
                if any(ev.get("t") == "instance" for ev in events):
                    break
                await asyncio.sleep(0.1)
            assert {"t": "instance", "instance_id": "i1", "state": "ready"} in events, events
            by_instance = {"t": "tokenize", "instance_id": "i1", "prompt": "Hello there", "tenant": "a"}
            assert (await client.call_message(by_instance))["ids"] == first
            worker = server.node.instances["i1"].engine.worker_pid
            took = await stuck_tokenize(server, client, worker, by_instance)
            assert took < 20.0, took
            assert reaped(worker) and "i1" not in server.node.instances
            failed = [ev for ev in events if ev.get("t") == "instance" and ev.get("state") == "failed"]
            assert [ev["instance_id"] for ev in failed] == ["i1"] and "tokenizer is stuck" in failed[0]["error"], failed
            assert (counts.timed_out, counts.restarts) == (2, 2)
        finally:
            await client.close()
            await server.close()
            for engine in server.models.fronts.values():
                await engine.unload()

    asyncio.run(main())
