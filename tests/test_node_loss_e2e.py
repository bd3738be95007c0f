"""A lost node costs a stream nothing but time, end to end: a real `mesh serve` (HTTP, the
dispatcher, two real node agents with the OpenVINO engine on the demo model) and OpenAI SDK
clients streaming eight greedy chats at once (`ignore_eos`, no client retries).

- The agent serving them is SIGKILLed mid-stream, in three rounds in a row (whichever agent
  serves; the supervisor restarts it and the operator's scale-out loads the model there
  again between rounds): every stream ends with exactly its max_tokens (the usage chunk),
  no error, and the very text of an undisturbed run (`--exact-moves`: recomputing prompt
  plus produced tokens gives the values decoding gave, so a greedy stream resumed from
  the wrong token, or with text lost or repeated, would differ).
- A frozen agent (SIGSTOP) is found by its heartbeat, and its streams go on the same way.
- A remote agent behind a TCP proxy the test controls: the proxy stops relaying mid-stream
  (the network goes away, the sockets stay open), the heartbeat finds it, and its streams
  go on on the local node.
The service counts every one resumed, by cause, in /admin/cluster and /metrics."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from test_service_e2e import ADMIN, Server

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

MODEL = "demo/smollm2"
MAX_TOKENS = 48
REMOTE_MAX_TOKENS = 160
STREAMS = 8
PROMPTS = [f"Write a short note about {thing}." for thing in
           ("the sea", "a red kite", "bread", "winter light", "a train", "old maps", "bees", "a lighthouse")]


class Streams:
    """STREAMS greedy chat streams at once, each in a thread of its own (the sync SDK), no retries."""

    def __init__(self, server: Server, max_tokens: int = MAX_TOKENS) -> None:
        self.client = server.client(max_retries=0)
        self.max_tokens = max_tokens
        self.results: list[dict[str, Any]] = [{"text": "", "chunks": 0, "usage": None, "finish": None, "error": None,
                                               "times": []} for _ in PROMPTS]
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(PROMPTS))]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        out = self.results[i]
        try:
            stream = self.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=self.max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.usage is not None:
                    out["usage"] = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.delta.content:
                        out["text"] += choice.delta.content
                        out["chunks"] += 1
                        out["times"].append(time.monotonic())
                    if choice.finish_reason:
                        out["finish"] = choice.finish_reason
        except Exception as exc:  # noqa: BLE001 - what the client saw is the result
            out["error"] = repr(exc)

    def wait_chunks(self, at_least: int, timeout_s: float = 300.0) -> None:
        """Until every stream has streamed `at_least` chunks of text."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(r["chunks"] >= at_least or r["error"] or r["finish"] for r in self.results):
                return
            time.sleep(0.05)
        raise AssertionError(f"the streams did not get {at_least} chunks: {self.results}")

    def stall_s(self) -> float:
        """The longest wait between two chunks of one stream (a resume's cost, as the client sees it)."""
        return max((b - a for r in self.results for a, b in zip(r["times"], r["times"][1:])), default=0.0)

    def join(self, timeout_s: float = 600.0) -> list[dict[str, Any]]:
        for t in self.threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self.threads), "a stream never ended"
        return self.results


def assert_complete(results: list[dict[str, Any]], max_tokens: int = MAX_TOKENS) -> None:
    """Every stream ended well, with exactly its max_tokens."""
    for r in results:
        assert r["error"] is None and r["finish"] == "length" and r["usage"] == max_tokens, r


def nodes(server: Server) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in server.admin("GET", "/admin/cluster")["nodes"]}


def serving(server: Server) -> dict[str, Any]:
    """The node whose instance holds the streams (reactive defragmentation, 7.2: one takes them all)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = [n for n in nodes(server).values() if any(i["active"] for i in n["instances"])]
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.05)
    raise AssertionError(f"no one node serves the streams: {nodes(server)}")


def scale_to(server: Server, node_ids: list[str]) -> None:
    """The operator's scale-out: the demo model loaded on each of `node_ids` (again, after a restart)."""
    server.wait_healthy(120)
    scaled = server.admin("POST", "/admin/scale", {"tenant": "demo", "model": MODEL, "nodes": node_ids})
    assert all(r["ok"] for r in scaled["results"]), scaled


def dispatcher(server: Server) -> dict[str, Any]:
    return server.admin("GET", "/admin/cluster")["dispatcher"]


def metrics(server: Server) -> str:
    return server.http("GET", "/metrics", token=ADMIN)[1]


def test_sigkilled_agents_streams_go_on_from_the_next_token_three_times(tmp_path, demo_gguf):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server = Server(tmp_path / "data", allowed, tmp_path / "server.log",
                    extra=("--cpu-nodes", "2", "--exact-moves", "--keep-alive", "3600"))
    server.start()
    try:
        scale_to(server, ["cpu-0", "cpu-1"])
        undisturbed = Streams(server)
        reference = undisturbed.join()
        reference_stall = undisturbed.stall_s()
        assert_complete(reference)
        killed: list[tuple[str, float]] = []
        stalls: list[float] = []
        for _ in range(3):
            streams = Streams(server)
            streams.wait_chunks(8)
            node = serving(server)
            assert all(r["finish"] is None for r in streams.results)  # mid-stream
            os.kill(node["pid"], signal.SIGKILL)
            killed.append((node["node_id"], time.monotonic()))
            results = streams.join()
            stalls.append(round(streams.stall_s(), 2))
            assert_complete(results)
            assert [r["text"] for r in results] == [r["text"] for r in reference]  # nothing lost, repeated, changed
            scale_to(server, [node["node_id"]])  # restarted by the supervisor; the model loads there again
        d = dispatcher(server)
        assert d["lost"]["exited"] + d["lost"]["connection"] == 3 * STREAMS, d
        assert d["resumed"]["exited"] + d["resumed"]["connection"] == 3 * STREAMS, d
        assert sum(d["lost_failed"].values()) == 0 and d["failed"] == {}, d
        text = metrics(server)
        assert 'mesh_dispatcher_resumed_total{cause="exited"}' in text and "mesh_dispatcher_lost_failed_total" in text
        print(f"killed {[k for k, _ in killed]}; longest wait between two chunks: {stalls} s (undisturbed "
              f"{reference_stall:.2f} s); dispatcher lost {d['lost']} resumed {d['resumed']}")
    finally:
        assert server.stop() == 0


def test_a_frozen_agent_is_found_by_its_heartbeat_and_its_streams_go_on(tmp_path, demo_gguf):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    config = tmp_path / "mesh.toml"
    config.write_text("heartbeat_timeout_s = 5.0\n")
    server = Server(tmp_path / "data", allowed, tmp_path / "server.log",
                    extra=("--cpu-nodes", "2", "--keep-alive", "3600", "--config", str(config)))
    server.start()
    try:
        scale_to(server, ["cpu-0", "cpu-1"])
        streams = Streams(server)
        streams.wait_chunks(8)
        node = serving(server)
        os.kill(node["pid"], signal.SIGSTOP)  # alive, answering nothing: the supervisor kills it past the heartbeat
        assert_complete(streams.join())
        d = dispatcher(server)
        assert d["lost"]["heartbeat"] == STREAMS and d["resumed"]["heartbeat"] == STREAMS, d
        assert sum(d["lost_failed"].values()) == 0 and d["failed"] == {}, d
        assert 'mesh_dispatcher_resumed_total{cause="heartbeat"} 8.0' in metrics(server)
        print(f"frozen {node['node_id']}: longest wait between two chunks {streams.stall_s():.2f} s")
    finally:
        assert server.stop() == 0


class Proxy:
    """A TCP relay the test controls, between the service and a remote agent: `cut()` stops
    relaying in both directions and keeps the sockets open (the network went away, no reset)."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.relaying = True
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.relaying:
                self.sockets.append(client)  # held, never answered
                continue
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            while not self.relaying:  # the network is gone: nothing passes, nothing is closed
                time.sleep(0.05)
                if src.fileno() < 0:
                    return
            try:
                dst.sendall(data)
            except OSError:
                return

    def cut(self) -> None:
        self.relaying = False

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_remote_agent_whose_network_goes_away_loses_no_stream(tmp_path, monkeypatch, demo_gguf):
    monkeypatch.setenv("MESH_AGENT_TOKEN", "remote-agent-token")
    monkeypatch.setenv("MESH_WEIGHTS_TOKEN", "shared-weights-token")
    port, weights_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "mesh.agent", "--listen", f"127.0.0.1:{port}", "--node-id", "cpu-r", "--kind", "cpu",
           "--memory-bytes", str(4 * 2**30), "--weights-listen", f"127.0.0.1:{weights_port}",
           "--weights-dir", str(tmp_path / "remote-weights")]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    proxy = None
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    config = tmp_path / "mesh.toml"
    config.write_text("heartbeat_timeout_s = 5.0\n")
    try:
        assert "MESH_AGENT_LISTENING" in agent.stdout.readline()
        proxy = Proxy(port)
        server = Server(tmp_path / "data", allowed, tmp_path / "server.log",
                        extra=("--remote-agent", f"cpu-r=127.0.0.1:{proxy.port}", "--keep-alive", "3600",
                               "--config", str(config)))
        server.start()
        try:
            scale_to(server, ["cpu-r"])
            os.kill(nodes(server)["cpu-0"]["pid"], signal.SIGKILL)  # cpu-0 restarts without the model:
            server.wait_healthy(120)  # the streams go to cpu-r, its one instance
            streams = Streams(server, max_tokens=REMOTE_MAX_TOKENS)  # long enough to outlast cpu-0's load
            streams.wait_chunks(4)
            assert serving(server)["node_id"] == "cpu-r"
            scale_to(server, ["cpu-0"])  # somewhere for them to go on
            streams.wait_chunks(8)
            assert all(r["finish"] is None for r in streams.results), "the streams ended before the cut"
            proxy.cut()
            assert_complete(streams.join(), REMOTE_MAX_TOKENS)
            print(f"network cut: longest wait between two chunks {streams.stall_s():.2f} s")
            d = dispatcher(server)
            assert d["lost"]["heartbeat"] == STREAMS and d["resumed"]["heartbeat"] == STREAMS, d
            assert sum(d["lost_failed"].values()) == 0 and d["failed"] == {}, d
        finally:
            assert server.stop() == 0
    finally:
        if proxy is not None:
            proxy.close()
        agent.kill()
        agent.wait()
