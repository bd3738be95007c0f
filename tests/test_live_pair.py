"""Live scaling on real node agents (BlitzScale 5.2): a loading instance serves with the layers
it holds while the model arrives by multicast, its activations pulled agent to agent.

Real `python -m mesh.agent` processes with layer hosts, a real paced weights agent as the
parameter pool's host copy, the layer protocol (mesh.wire.layers) between them, and the live
pair's ZigZag (mesh.control.live_pair). The fast tests run the tiny random Llama of
tests/test_torch_layers.py (its output depends on the context, so a wrong KV cache shows);
the slow one the demo SmolLM2-135M. The check of correctness: every stream's greedy tokens
equal the source's whole-model tokens for the same prompt.
"""
from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from mesh.engines.engine_api import HiddenStates, TokenBatch
from mesh.framing import ProtocolError
from mesh.wire.layers import Peer, Run, RunResult
from test_torch_layers import _torch, tiny  # noqa: F401 - the tiny model fixture

pytestmark = pytest.mark.timeout(600)


def test_a_run_frame_carries_hidden_states_as_its_payload_and_refuses_a_wrong_size():
    hidden = HiddenStates(3, ("a", "b"), (0, 7), (2, 1), 4, "float32", bytes(range(48)))
    header, payload = Run("m", 3, 5, hidden).to_header(9)
    assert header["nbytes"] == len(payload) == hidden.nbytes == 3 * 4 * 4
    back = Run.from_header(header, payload)
    assert back.batch == hidden and (back.start, back.stop, back.keep) == (3, 5, False)
    with pytest.raises(ProtocolError, match="payload bytes"):
        Run.from_header(header, payload[:-4])
    pulled = Run("m", 2, 4, None, Peer("127.0.0.1:9", "t"), ("a",))
    back = Run.from_header(*pulled.to_header(1))
    assert back.pull == Peer("127.0.0.1:9", "t") and back.pull_ids == ("a",) and back.batch is None
    kept = Run.from_header(*Run("m", 2, 4, None, None, ("a",), keep=True).to_header(1))
    assert kept.pull is None and kept.pull_ids == ("a",) and kept.keep
    tokens = Run("m", 0, 2, TokenBatch(("a",), (0,), ((1, 2, 3),)))
    assert Run.from_header(*tokens.to_header(1)).batch == tokens.batch
    with pytest.raises(ProtocolError, match="empty"):
        Run.from_header({**tokens.to_header(1)[0], "start": 2}, b"")
    with pytest.raises(ProtocolError, match="twice"):
        Run.from_header({**tokens.to_header(1)[0], "tokens": {"request_ids": ["a", "a"], "positions": [0, 0],
                                                                 "token_ids": [[1], [2]]}}, b"")
    assert RunResult.from_fields(*RunResult(hidden).to_fields()).output == hidden


async def _scale_out(hf: Path, root: Path, live: bool, cfg_kw: dict, arrive_s: float):
    from mesh.bench.live_scale_out import RunConfig, prepare, run_once, spawn_layer_agent
    from mesh.weights.launch import spawn_agent

    prepared = prepare(hf, root / "prepared", blocks=6)
    token, weights_token = secrets.token_hex(8), secrets.token_hex(8)
    mbps = prepared.path.stat().st_size * 8 / 1e6 / arrive_s
    agents = []
    pool = await spawn_agent("pool", mbps, token=weights_token)
    try:
        for node in ("source", "target"):
            agents.append(await spawn_layer_agent(node, root, root / "prepared", token, weights_token))
        cfg = RunConfig(arrive_s=arrive_s, **cfg_kw)
        return prepared, await run_once(prepared, agents[0], agents[1], pool, live, cfg)
    finally:
        for agent in agents:
            await agent.stop()
        pool.kill()
        await pool.process.wait()


@pytest.mark.parametrize("live", [True, False], ids=["live", "stop-the-world"])
def test_a_loading_instance_serves_with_the_layers_it_holds_and_every_token_is_right(tiny, tmp_path, live):  # noqa: F811 - fixtures imported by name
    _torch()
    cfg = dict(streams=3, prompt_tokens=12, max_tokens=6, warm_s=1.0, after_s=1.0, check_max=40)
    prepared, run = asyncio.run(_scale_out(tiny, tmp_path, live, cfg, arrive_s=4.0))
    assert run.full_s > run.scale_out_s + 1.0, "the model arrived at once: the link was not paced"
    assert run.failed == 0 and run.streams_checked > 0 and run.streams_equal == run.streams_checked
    if live:  # layers ran on the target before its last block, and activations crossed
        assert run.target_runs > 0 and run.pulls > 0 and run.streams_split > 0, (run.ready, run.scale_out_s, run.full_s)
        assert run.activation_bytes > 0 and run.activation_bytes % (prepared.layout.config["hidden_size"] * 4) == 0
        assert 0 < run.ready[1][1] < prepared.layers and run.ready[1][0] < run.full_s
        assert run.recomputed > 0
    else:
        assert run.target_runs == run.pulls == run.streams_split == run.activation_bytes == 0


@pytest.mark.slow
def test_the_demo_model_split_live_across_two_agents_gives_its_whole_greedy_output(demo_hf, tmp_path):
    _torch()
    cfg = dict(streams=3, prompt_tokens=24, max_tokens=6, warm_s=2.0, after_s=1.0, check_max=8)
    prepared, run = asyncio.run(_scale_out(demo_hf, tmp_path, True, cfg, arrive_s=10.0))
    assert run.target_runs > 0 and run.pulls > 0 and run.streams_split > 0
    assert run.streams_checked > 0 and run.streams_equal == run.streams_checked
