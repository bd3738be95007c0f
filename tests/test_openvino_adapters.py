"""LoRA adapters on the real OpenVINO engine (mesh.engines.openvino_adapters), with adapters the
tests make from the demo model (conftest.demo_adapters): the zero adapter reproduces the base,
a random one changes the output the same way every time, and requests of several adapters
added at once each get what they get alone (the adapters take turns in the pipeline). The
engine computes as `--exact-moves` instances do (EXACT_RECOMPUTE), so alone and batched agree
on any CPU (with the defaults, bf16 on a CPU that has it may turn a near-tie in a batch)."""
from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from mesh.engines.engine_api import EngineError, EngineRequest, Sampling
from mesh.modelfiles.lora import WEIGHTS

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def _request(rid: str, ids: list[int], adapter=None, scale: float = 2.0, max_tokens: int = 12) -> EngineRequest:
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0, adapter_scale=scale,
                        adapter=None if adapter is None else str(adapter / WEIGHTS))
    return EngineRequest(rid, len(ids), sampling, ids)


def _run(engine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    """Add every request at once, step to the end: each request's token ids."""
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = defaultdict(list)

    async def run() -> None:
        while engine.has_work():
            result = await engine.step()
            for rid, token in zip(result.request_ids, result.token_ids):
                tokens[rid].append(token)

    asyncio.run(run())
    return dict(tokens)


@pytest.fixture(scope="module")
def ir_engine(demo_ir):
    from mesh.engines.openvino_engine import EXACT_RECOMPUTE, OpenVINOEngine

    e = OpenVINOEngine(demo_ir, context_window=512, max_num_seqs=8, properties=EXACT_RECOMPUTE)
    asyncio.run(e.load())
    yield e
    asyncio.run(e.unload())


@pytest.mark.slow
def test_adapters_on_the_ir_engine_reproduce_change_and_take_turns(ir_engine, demo_adapters):
    e = ir_engine
    assert e.runs_adapters
    ids = e.encode_chat(PROMPT)
    base = _run(e, [_request("b", ids)])["b"]
    zero = _run(e, [_request("z", ids, demo_adapters["zero"])])["z"]
    one = _run(e, [_request("r", ids, demo_adapters["random"])])["r"]
    again = _run(e, [_request("r", ids, demo_adapters["random"])])["r"]
    two = _run(e, [_request("r2", ids, demo_adapters["random2"])])["r2"]
    print(f"\nbase {base}\nzero {zero}\nrandom {one}\nrandom2 {two}")
    assert zero == base  # B = 0: exactly the base's greedy tokens
    assert one != base and two != base and one != two
    assert again == one  # deterministic
    assert "Paris" in e.decode(base)  # a real answer
    # all at once, interleaved: each gets its own adapter's tokens (turns, not one adapter for the batch)
    mixed = _run(e, [_request("m0", ids), _request("m1", ids, demo_adapters["random"]),
                     _request("m2", ids, demo_adapters["zero"]), _request("m3", ids, demo_adapters["random"]),
                     _request("m4", ids, demo_adapters["random2"]), _request("m5", ids)])
    assert mixed == {"m0": base, "m1": one, "m2": base, "m3": one, "m4": two, "m5": base}


@pytest.mark.slow
def test_a_waiting_request_can_be_aborted_and_a_gguf_instance_refuses_adapters(ir_engine, demo_adapters, demo_gguf):
    from mesh.engines.openvino_engine import OpenVINOEngine

    e = ir_engine
    ids = e.encode_chat(PROMPT)
    e.add_request(_request("runs", ids, max_tokens=3))
    e.add_request(_request("waits", ids, demo_adapters["random"]))
    e.abort("waits")
    assert _run(e, []).keys() == {"runs"}
    assert not e.has_work()
    gguf = OpenVINOEngine(demo_gguf, context_window=512, max_num_seqs=4)
    asyncio.run(gguf.load())
    try:
        assert not gguf.runs_adapters
        with pytest.raises(EngineError, match="cannot run LoRA adapters"):
            gguf.add_request(_request("x", ids, demo_adapters["random"]))
    finally:
        asyncio.run(gguf.unload())


@pytest.mark.slow
def test_the_adapters_bench_shows_the_turns(demo_ir):
    """`mesh bench adapters`: requests of one adapter batch as the base's do; of 4 adapters, they
    take turns (4 x the steps)."""
    from mesh.bench.adapter_turns import run

    figures = run(str(demo_ir), requests=4, output_len=4, counts=(1, 4))
    print(f"\n{figures}")
    assert figures["base"]["steps"] == figures["1_adapters"]["steps"] == 4
    assert figures["4_adapters"]["steps"] == 16
    assert all(figures[k]["tok_s"] > 0 for k in ("base", "1_adapters", "4_adapters"))


def test_turns_keep_arrival_order_per_adapter_and_close_to_newcomers_once_another_waits():
    """AdapterTurns alone (no OpenVINO): who waits, and which requests make the next turn."""
    from mesh.engines.openvino_adapters import BASE, AdapterTurns

    def req(rid: str, adapter: str | None) -> EngineRequest:
        return EngineRequest(rid, 1, Sampling(adapter=adapter, adapter_scale=2.0), [1])

    turns = AdapterTurns()
    assert not turns.must_wait(("a", 2.0), busy=False)  # an idle pipeline switches at once
    assert not turns.must_wait(BASE, busy=True)  # the running turn's adapter joins it
    assert turns.must_wait(("a", 2.0), busy=True)  # another adapter waits for the turn to end
    turns.waiting.extend([req("1", "a"), req("2", None), req("3", "a"), req("4", "b")])
    assert turns.must_wait(BASE, busy=True)  # once one waits, the running turn takes no newcomers
    assert turns.drop("2") and not turns.drop("2")
    key, turn = turns.next_turn()
    assert key == ("a", 2.0) and [r.request_id for r in turn] == ["1", "3"]
    assert [r.request_id for r in turns.waiting] == ["4"] and list(turns.waiting_ids()) == ["4"]
