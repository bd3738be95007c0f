"""`mesh bench tokens`: per-token overhead of a 64-token stream, framed TCP against Ray.

Three ways to carry one request's tokens from a node agent to the control service, on this
machine, with no engine (the tokens are ready): Mesh's framed TCP connection (one `tokens`
frame per token, as an agent sends them, read by an asyncio client); a Ray actor's streaming
generator (one yielded item per token); one Ray actor call per token. Each row: microseconds
per token, the median of `--repeat` streams after a warm-up. docs/cluster.md records the
numbers and the choice they led to (tokens stay on framed TCP, never in Ray's control store).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from mesh.bench.report import write_json
from mesh.wire.agent_protocol import Ping, TokensEvent, encode_frame, read_frame


def _item(i: int) -> list[Any]:
    return ["req-1", [1000 + i], f" tok{i}"]  # (request id, token ids, text): one `tokens` item


async def _framed(tokens: int, repeat: int) -> list[float]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await read_frame(reader)) is not None:
            for i in range(tokens):
                writer.write(encode_frame(TokensEvent([_item(i)]).to_message()))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        writer.write(encode_frame(Ping().to_message()))  # any frame starts a stream
        for _ in range(tokens):
            await read_frame(reader)
        times.append(time.perf_counter() - t0)
    writer.close()
    server.close()
    return times[1:]


class _Streamer:
    def stream(self, tokens: int):
        for i in range(tokens):
            yield _item(i)

    def one(self, i: int) -> list[Any]:
        return _item(i)


def _ray_rows(tokens: int, repeat: int) -> dict[str, list[float]]:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        actor = ray.remote(_Streamer).remote()
        gen, call = [], []
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            for ref in actor.stream.options(num_returns="streaming").remote(tokens):
                ray.get(ref)
            gen.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(tokens):
                ray.get(actor.one.remote(i))
            call.append(time.perf_counter() - t0)
        return {"ray_streaming_generator": gen[1:], "ray_call_per_token": call[1:]}
    finally:
        ray.shutdown()


def run(tokens: int = 64, repeat: int = 20) -> dict[str, Any]:
    if tokens < 1 or repeat < 1:
        raise ValueError("--tokens and --repeat must be >= 1")
    rows = {"framed_tcp": asyncio.run(_framed(tokens, repeat)), **_ray_rows(tokens, repeat)}
    return {"tokens": tokens, "repeat": repeat, "cpu_count": os.cpu_count(),
            "us_per_token": {k: statistics.median(v) / tokens * 1e6 for k, v in rows.items()},
            "stream_s": {k: statistics.median(v) for k, v in rows.items()}}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokens", help="per-token overhead of a stream: framed TCP vs Ray actor generator/calls")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")

    def go(a: argparse.Namespace) -> int:
        fig = run(a.tokens, a.repeat)
        print(f"mesh bench tokens: one {fig['tokens']}-token stream, median of {fig['repeat']}, "
              f"{fig['cpu_count']} cores")
        for name, us in fig["us_per_token"].items():
            print(f"  {name:<24} {us:8.1f} us/token  ({fig['stream_s'][name] * 1000:.2f} ms per stream)")
        if a.json:
            write_json(a.json, fig)
        return 0

    p.set_defaults(func=go)
