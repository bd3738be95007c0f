"""Weight transport: packed blocks, framing, and multicasts between real agent processes on
loopback (a few MB): identical files, corrupt blocks detected, a killed target dropped and
re-planned around, two multicasts at once."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from mesh.policy.multicast import chain, make_plan, naive
from mesh.weights.blocks import CorruptBlock, Manifest, cut, load_blocks, pack, verify, write_atomic
from mesh.weights.coordinator import MulticastError, multicast
from mesh.weights.frames import ProtocolError, frame, read_message, send
from mesh.weights.launch import running_agents, token_of
from mesh.weights.peer import WeightAgent

KB = 1 << 10


def model_file(path: Path, size: int, seed: int = 0) -> Path:
    path.write_bytes(os.urandom(size) if seed == 0 else bytes((i * seed) % 251 for i in range(size)))
    return path


# --- blocks and framing --------------------------------------------------------------------

def test_cut_fixed_and_on_layer_boundaries():
    assert cut(10, 4) == [(0, 4), (4, 4), (8, 2)]
    # layers start at 3, 5, 9: each block ends on the last boundary that fits
    assert cut(12, 6, boundaries=[3, 5, 9]) == [(0, 5), (5, 4), (9, 3)]
    # a layer larger than a block is cut anyway
    assert cut(10, 3, boundaries=[8]) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    with pytest.raises(ValueError, match="block size must be > 0"):
        cut(10, 0)


def test_pack_verify_and_atomic_reassembly(tmp_path):
    src = model_file(tmp_path / "m.bin", 100 * KB + 7)
    m = pack(src, 16 * KB)
    assert m.count == 7 and m.total_bytes == 100 * KB + 7 and m.blocks[-1].size == 4 * KB + 7
    assert Manifest.from_dict(m.to_dict()) == m
    blocks = load_blocks(src, m)
    verify(m, 2, blocks[2])
    bad = bytearray(blocks[2])
    bad[100] ^= 1
    with pytest.raises(CorruptBlock, match="block 2 checksum mismatch"):
        verify(m, 2, bytes(bad))
    with pytest.raises(CorruptBlock, match="block 6 has 3 B"):
        verify(m, 6, b"abc")
    out = write_atomic(tmp_path / "out" / "m.bin", m, dict(enumerate(blocks)))
    assert out.read_bytes() == src.read_bytes()
    assert [p.name for p in out.parent.iterdir()] == ["m.bin"]  # no temporary left behind
    with pytest.raises(ValueError, match="block 3 is missing"):
        write_atomic(tmp_path / "x.bin", m, {i: b for i, b in enumerate(blocks) if i != 3})
    assert not (tmp_path / "x.bin").exists()


def test_manifest_must_tile_the_file():
    with pytest.raises(ValueError, match="block 1 at 5"):
        Manifest.from_dict({"model": "m", "total_bytes": 8, "blocks": [[0, 4, "x"], [5, 3, "y"]]})
    with pytest.raises(ValueError, match="cover 7 B of 8 B"):
        Manifest.from_dict({"model": "m", "total_bytes": 8, "blocks": [[0, 4, "x"], [4, 3, "y"]]})


def test_framing_round_trip_and_errors():
    async def go():
        r = asyncio.StreamReader()
        r.feed_data(frame({"type": "block", "block": 3, "nbytes": 5}) + b"hello" + frame({"type": "go"}))
        r.feed_eof()
        assert await read_message(r) == ({"type": "block", "block": 3, "nbytes": 5}, b"hello")
        assert await read_message(r) == ({"type": "go"}, b"")
        assert await read_message(r) is None
        bad = asyncio.StreamReader()
        bad.feed_data(frame({"no": "type"}))
        bad.feed_eof()
        with pytest.raises(ProtocolError, match="with a string type .type."):
            await read_message(bad)
        cut_short = asyncio.StreamReader()
        cut_short.feed_data(b"\x00\x00")
        cut_short.feed_eof()
        with pytest.raises(ProtocolError, match="inside a frame header"):
            await read_message(cut_short)
        for data, why in ((frame({"type": "block", "nbytes": 5}) + b"hel", "inside a frame payload .3 of 5"),
                          (frame({"type": "block", "nbytes": -1}), "bad nbytes -1"),
                          (frame({"type": "go"})[:-2], "inside a frame header")):
            r = asyncio.StreamReader()
            r.feed_data(data)
            r.feed_eof()
            with pytest.raises(ProtocolError, match=why):
                await read_message(r)

    asyncio.run(go())


def test_pacer_books_the_link_when_it_is_free_and_the_block_is_here():
    from mesh.weights.peer import Pacer

    p = Pacer(100.0)  # bytes per second
    assert p.reserve(50, ready_at=0.0) == 0.0  # link free, block here: goes at once
    assert p.reserve(50, ready_at=0.0) == 0.5  # waits for the link
    assert p.reserve(10, ready_at=5.0) == 5.0  # waits for the block; an idle link saves nothing
    assert p.reserve(10, ready_at=0.0) == 5.1
    with pytest.raises(ValueError, match="link rate must be > 0"):
        Pacer(0.0)


# --- agents on loopback --------------------------------------------------------------------

TARGETS = ["a", "b", "c", "d"]


def addresses(agents):
    return {n: a.address for n, a in agents.items()}


@pytest.mark.parametrize("name", ["naive", "chain", "binomial"])
def test_every_target_receives_an_identical_file(tmp_path, name):
    src = model_file(tmp_path / "model.bin", 2 * 1024 * KB + 123)
    m = pack(src, 64 * KB)

    async def go():
        async with running_agents(["s", *TARGETS]) as agents:
            plan = make_plan(name, ["s"], TARGETS, m.count)
            outs = {t: str(tmp_path / f"{t}.bin") for t in TARGETS}
            return await multicast(addresses(agents), m, plan, {"s": str(src)}, outs, timeout_s=60,
                                   token=token_of(agents))

    r = asyncio.run(go())
    assert set(r.completion_s) == set(TARGETS) and r.dropped == [] and r.replans == 0
    for t in TARGETS:
        assert Path(r.outputs[t]).read_bytes() == src.read_bytes()
    assert len(r.arrivals) == len(TARGETS) * m.count


def test_a_corrupt_block_is_detected_named_and_sent_again(tmp_path):
    src = model_file(tmp_path / "model.bin", 1024 * KB)
    m = pack(src, 64 * KB)

    async def go():
        async with running_agents(["s", "a", "b"]) as agents:
            plan = chain(["s"], ["a", "b"], m.count)
            return await multicast(addresses(agents), m, plan, {"s": str(src)},
                                   {t: str(tmp_path / f"{t}.bin") for t in ("a", "b")},
                                   faults={"s": {"corrupt_blocks": [3]}}, timeout_s=60, token=token_of(agents))

    r = asyncio.run(go())
    assert [(e["node"], e["block"], e["sender"]) for e in r.corrupt] == [("a", 3, "s")]
    assert "block 3 checksum mismatch" in r.corrupt[0]["reason"]
    assert r.replans == 1
    for t in ("a", "b"):
        assert Path(r.outputs[t]).read_bytes() == src.read_bytes()


def test_a_source_file_that_does_not_match_its_manifest_is_refused(tmp_path):
    src = model_file(tmp_path / "model.bin", 256 * KB)
    m = pack(src, 64 * KB)
    data = bytearray(src.read_bytes())
    data[64 * KB * 2 + 5] ^= 0xFF  # block 2
    src.write_bytes(bytes(data))

    async def go():
        async with running_agents(["s", "a"]) as agents:
            await multicast(addresses(agents), m, naive(["s"], ["a"], m.count), {"s": str(src)}, timeout_s=30,
                            token=token_of(agents))

    with pytest.raises(MulticastError, match="agent 's'.*block 2 checksum mismatch"):
        asyncio.run(go())


def test_a_killed_target_is_dropped_and_the_rest_complete(tmp_path):
    """Chain s -> a -> b -> c -> d at 40 Mbit/s per node; b is killed after its 4th block.
    c and d, downstream of b, get the rest from the re-plan."""
    src = model_file(tmp_path / "model.bin", 1024 * KB)
    m = pack(src, 64 * KB)  # 16 blocks, 13 ms each at 5 MB/s

    async def go():
        async with running_agents(["s", *TARGETS], link_mbps=40) as agents:
            got = {t: 0 for t in TARGETS}

            def observer(node, ev):
                if ev["type"] == "have":
                    got[node] += 1
                    if node == "b" and got[node] == 4:
                        agents["b"].kill()

            plan = chain(["s"], TARGETS, m.count)
            assert [t.receiver for t in plan.sends("b")] == ["c"] * m.count
            return await multicast(addresses(agents), m, plan, {"s": str(src)},
                                   {t: str(tmp_path / f"{t}.bin") for t in TARGETS}, observer=observer,
                                   timeout_s=60, token=token_of(agents)), got

    r, got = asyncio.run(go())
    assert r.dropped == ["b"] and r.replans >= 1
    assert set(r.completion_s) == {"a", "c", "d"} and got["b"] < m.count
    for t in ("a", "c", "d"):
        assert Path(r.outputs[t]).read_bytes() == src.read_bytes()
    assert not (tmp_path / "b.bin").exists()
    # pacing: a, fed by s alone, cannot finish before the model crossed one 40 Mbit/s link
    assert r.completion_s["a"] >= 0.9 * m.total_bytes / 5e6


def test_two_multicasts_run_at_once(tmp_path):
    one = model_file(tmp_path / "one.bin", 1024 * KB)
    two = model_file(tmp_path / "two.bin", 768 * KB + 5, seed=7)
    m1, m2 = pack(one, 64 * KB), pack(two, 32 * KB)

    async def go():
        async with running_agents(["s", "t", *TARGETS]) as agents:
            addr = addresses(agents)
            # s sends model one to a, b, c; t sends model two to b, c, d: b and c get both
            return await asyncio.gather(
                multicast(addr, m1, chain(["s"], ["a", "b", "c"], m1.count), {"s": str(one)},
                          {x: str(tmp_path / f"one-{x}.bin") for x in "abc"}, transfer_id="one", timeout_s=60,
                          token=token_of(agents)),
                multicast(addr, m2, make_plan("binomial", ["t"], ["b", "c", "d"], m2.count), {"t": str(two)},
                          {x: str(tmp_path / f"two-{x}.bin") for x in "bcd"}, transfer_id="two", timeout_s=60,
                          token=token_of(agents)),
            )

    r1, r2 = asyncio.run(go())
    assert (r1.transfer, r2.transfer) == ("one", "two")
    for x in "abc":
        assert (tmp_path / f"one-{x}.bin").read_bytes() == one.read_bytes()
    for x in "bcd":
        assert (tmp_path / f"two-{x}.bin").read_bytes() == two.read_bytes()


def test_agents_without_the_token_are_refused(tmp_path):
    """Agents spawned by the launcher require their random token: a multicast with none or
    a wrong one fails naming the reason, and nothing is written."""
    src = model_file(tmp_path / "model.bin", 256 * KB)
    m = pack(src, 64 * KB)
    out = tmp_path / "a.bin"

    async def go(token):
        async with running_agents(["s", "a"]) as agents:
            assert token_of(agents) != token
            await multicast(addresses(agents), m, chain(["s"], ["a"], m.count), {"s": str(src)}, {"a": str(out)},
                            timeout_s=30, token=token)

    with pytest.raises(MulticastError, match="weights token missing"):
        asyncio.run(go(None))
    with pytest.raises(MulticastError, match="weights token wrong"):
        asyncio.run(go("not-the-token"))
    assert not out.exists()


def test_the_token_guards_control_and_data_connections(tmp_path):
    """In one process: a target agent with a token. A `start` with no or a wrong token and a
    data connection with no or a wrong token get an `error` frame and are closed; no block
    is accepted. With the token, the transfer starts and a block is kept."""
    src = model_file(tmp_path / "model.bin", 128 * KB)
    m = pack(src, 64 * KB)
    blocks = load_blocks(src, m)
    secret = "s3cret-token"

    async def first_reply(agent, header, payload=b""):
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
        try:
            writer.write(frame(header) + payload)
            await writer.drain()
            reply = await read_message(reader)
            closed = await read_message(reader) is None  # the agent closes after refusing
            return (reply[0] if reply else None), closed
        finally:
            writer.close()

    def block(k, **extra):
        return {"type": "block", "transfer": "t1", "block": k, "sender": "s", "nbytes": len(blocks[k]), **extra}

    async def go():
        agent = WeightAgent(token=secret)
        await agent.start()
        try:
            plan = naive(["s"], ["a"], m.count)
            start = {"type": "start", "transfer": "t1", "node": "a", "manifest": m.to_dict(), "plan": plan.to_dict(),
                     "peers": {"s": ["127.0.0.1", 1]}, "output_path": str(tmp_path / "a.bin")}
            for token, why in ((None, "weights token missing"), ("wrong", "weights token wrong")):
                h = dict(start) if token is None else {**start, "token": token}
                reply, closed = await first_reply(agent, h)
                assert reply["type"] == "error" and reply["reason"].startswith(why) and closed
                assert "t1" not in agent.transfers
            assert (await first_reply(agent, {"type": "hello"}))[0]["type"] == "error"

            # the right token: the transfer starts
            reader, control = await asyncio.open_connection("127.0.0.1", agent.port)
            await send(control, {**start, "token": secret})
            assert (await read_message(reader))[0]["type"] == "ready"
            st = agent.transfers["t1"]
            # data connections without the token, or with a wrong one, are refused
            for extra, why in (({}, "weights token missing"), ({"token": "nope"}, "weights token wrong")):
                reply, closed = await first_reply(agent, block(0, **extra), blocks[0])
                assert reply["type"] == "error" and reply["reason"].startswith(why) and closed
            await asyncio.sleep(0.05)
            assert st.blocks == {} and not st.verifying
            # with the token, the block is verified and kept
            _, data = await asyncio.open_connection("127.0.0.1", agent.port)
            data.write(frame(block(0, token=secret)) + blocks[0])
            await data.drain()
            have = (await asyncio.wait_for(read_message(reader), 10))[0]
            assert (have["type"], have["block"]) == ("have", 0) and list(st.blocks) == [0]
            data.close()
            control.close()
        finally:
            await agent.close()
        assert not (tmp_path / "a.bin").exists()

    asyncio.run(go())


def test_bad_multicast_requests_get_clear_errors(tmp_path):
    src = model_file(tmp_path / "model.bin", 128 * KB)
    m = pack(src, 64 * KB)

    async def go(plan, agents, sources):
        return await multicast(agents, m, plan, sources, timeout_s=5)

    with pytest.raises(MulticastError, match="plan 'naive' has 3 blocks"):
        asyncio.run(go(naive(["s"], ["a"], 3), {"s": ("127.0.0.1", 1), "a": ("127.0.0.1", 1)}, {"s": str(src)}))
    with pytest.raises(MulticastError, match="no agent address for node 'a'"):
        asyncio.run(go(naive(["s"], ["a"], 2), {"s": ("127.0.0.1", 1)}, {"s": str(src)}))
    with pytest.raises(MulticastError, match="source 's' has no model file"):
        asyncio.run(go(naive(["s"], ["a"], 2), {"s": ("127.0.0.1", 1), "a": ("127.0.0.1", 1)}, {}))
    with pytest.raises(MulticastError, match="cannot reach the agent of"):
        asyncio.run(go(naive(["s"], ["a"], 2), {"s": ("127.0.0.1", 1), "a": ("127.0.0.1", 1)}, {"s": str(src)}))


def test_bench_multicast_writes_the_interface_json(tmp_path, capsys):
    """`mesh bench multicast --receivers N --size-mb M --json PATH`: per plan total_s, bound_s."""
    import json

    from mesh.cli import main

    out = tmp_path / "mc.json"
    assert main(["bench", "multicast", "--receivers", "2", "--size-mb", "2", "--block-mb", "0.25",
                 "--bw-repeats", "1", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    for name in ("naive", "chain", "binomial"):
        assert fig[name]["total_s"] > 0 and fig[name]["bound_s"] > 0
        assert set(fig[name]["completion_s"]) == {"r0", "r1"}
    assert fig["blocks"] == 8 and fig["mode"] == "loopback" and len(fig["loadavg_before"]) == 3
    assert "bound M/B" in capsys.readouterr().out
