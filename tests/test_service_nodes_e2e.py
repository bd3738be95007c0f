"""`mesh serve --cpu-nodes 2` end to end (issue 7 items 1 and 4): the real server, two real
node agent processes, the real SmolLM2 model. The demo model's first host copy goes to a
node by the weights transport, a scale-out multicasts it to the other node, whose engine
loads its own received copy; with the first node killed, the second serves the same greedy
answer; deleting the model deletes both nodes' copies. With `--vllm-cpu`, a Hugging Face
folder registered by path travels file by file to the vLLM node, whose engine serves from
the received folder. With `--remote-agent`, an agent the service did not start gets the
model in its own folder, serves, and is reconnected after a restart."""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_service_e2e import Server

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


def sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def weights_of(server: Server) -> dict:
    (model,) = server.admin("GET", "/admin/cluster")["weights"]["models"].values()
    return model


def test_models_reach_nodes_by_multicast_and_survive_a_node(tmp_path, demo_gguf):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server = Server(tmp_path / "data", allowed, tmp_path / "server.log", extra=("--cpu-nodes", "2"))
    server.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not server.admin("GET", "/admin/cluster")["weights"]["models"]:
            time.sleep(0.2)
        first = weights_of(server)
        assert first["host_copies"] == ["cpu-0"] and first["transfers"][0]["sources"] == ["origin"]
        copy0 = Path(first["copies"]["cpu-0"])
        assert copy0.is_relative_to(tmp_path / "data" / "nodes" / "cpu-0") and sha(copy0) == sha(demo_gguf)

        client = server.client()
        ask = dict(model="demo/smollm2", messages=[{"role": "user", "content": "Name three colours."}],
                   max_tokens=12, temperature=0)
        before = client.chat.completions.create(**ask).choices[0].message.content

        scaled = server.admin("POST", "/admin/scale", {"tenant": "demo", "model": "demo/smollm2", "nodes": ["cpu-1"]})
        (result,) = scaled["results"]
        assert result["ok"] and result["weights"] == "multicast from cpu-0", scaled
        after_scale = weights_of(server)
        assert after_scale["transfers"][-1]["sources"] == ["cpu-0"]
        assert after_scale["host_copies"] == ["cpu-0", "cpu-1"]
        assert sha(after_scale["copies"]["cpu-1"]) == sha(demo_gguf)

        nodes = {n["node_id"]: n for n in server.admin("GET", "/admin/cluster")["nodes"]}
        os.kill(nodes["cpu-0"]["pid"], signal.SIGKILL)
        time.sleep(0.3)
        answer = client.chat.completions.create(**ask).choices[0].message.content
        assert answer == before  # greedy: cpu-1's engine, on its received copy, answers the same
        view = {n["node_id"]: n for n in server.admin("GET", "/admin/cluster")["nodes"]}
        assert [i["weights"] for i in view["cpu-1"]["instances"]] == ["multicast from cpu-0"]

        server.wait_healthy()
        status, _ = server.http("DELETE", "/v1/models/demo/smollm2", token=server.key)
        assert status == 200
        assert not copy0.parent.exists() and not Path(after_scale["copies"]["cpu-1"]).parent.exists()
        assert server.admin("GET", "/admin/cluster")["weights"]["models"] == {}
    finally:
        assert server.stop() == 0


def test_a_hugging_face_folder_reaches_the_vllm_node_and_serves_from_there(tmp_path):
    from mesh.engines.vllm_engine import find_vllm_python
    from mesh.modelfiles.local import write_tiny_llama

    if find_vllm_python() is None:
        if os.environ.get("MESH_REQUIRE_VLLM") == "1":
            pytest.fail("MESH_REQUIRE_VLLM=1 but no Python with vLLM: run scripts/setup.sh (creates .venv-vllm)")
        pytest.skip("vLLM is not installed (.venv-vllm): run scripts/setup.sh")
    allowed = tmp_path / "allowed"
    tiny = write_tiny_llama(allowed / "demo" / "tiny")  # the demo tenant's folder: its paths are relative to it
    # --no-prepare: the demo GGUF is not converted for the vLLM node meanwhile (tests/test_formats_e2e.py does that)
    server = Server(tmp_path / "data", allowed, tmp_path / "server.log", extra=("--vllm-cpu", "--no-prepare"))
    server.start()
    try:
        status, body = server.http("POST", "/v1/models", {"name": "tiny", "path": "tiny"}, token=server.key)
        assert status == 201 and body["mesh"]["kind"] == "hf", body
        out = server.client().completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
        cluster = server.admin("GET", "/admin/cluster")
        (instance,) = [i for n in cluster["nodes"] if n["node_id"] == "vllm-cpu-0" for i in n["instances"]]
        assert instance["model"] == "tiny" and instance["state"] == "ready"
        (weights,) = [m for m in cluster["weights"]["models"].values() if m["files"] > 1 and m["native"]]
        assert weights["host_copies"] == ["vllm-cpu-0"]  # the first copy goes where the model runs
        copy = Path(weights["copies"]["vllm-cpu-0"])
        assert copy.is_relative_to(tmp_path / "data" / "nodes" / "vllm-cpu-0")
        assert {f.name: sha(f) for f in copy.iterdir()} == {f.name: sha(f) for f in Path(tiny).iterdir()}
    finally:
        assert server.stop() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remote_agent(port: int, weights_port: int, folder: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mesh.agent", "--listen", f"127.0.0.1:{port}", "--node-id", "cpu-r",
           "--kind", "cpu", "--memory-bytes", str(4 * 2**30), "--weights-listen", f"0.0.0.0:{weights_port}",
           "--weights-dir", str(folder)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert "MESH_AGENT_LISTENING" in proc.stdout.readline()
    return proc


def test_a_remote_agent_gets_models_by_multicast_and_is_reconnected(tmp_path, monkeypatch):
    """An agent the service did not start (another machine's, here a process on loopback):
    the model reaches its own folder by multicast, it serves, and after it is killed and
    started again it is reconnected and trusted with its copy only after checking it."""
    monkeypatch.setenv("MESH_AGENT_TOKEN", "remote-agent-token")
    monkeypatch.setenv("MESH_WEIGHTS_TOKEN", "shared-weights-token")
    port, weights_port = _free_port(), _free_port()
    folder = tmp_path / "remote-weights"
    agent = _remote_agent(port, weights_port, folder)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server = Server(tmp_path / "data", allowed, tmp_path / "server.log",
                    extra=("--remote-agent", f"cpu-r=127.0.0.1:{port}"))
    try:
        server.start()
        server.wait_healthy()
        scaled = server.admin("POST", "/admin/scale", {"tenant": "demo", "model": "demo/smollm2", "nodes": ["cpu-r"]})
        (result,) = scaled["results"]
        assert result["ok"] and result["weights"] == "multicast from cpu-0", scaled
        (copy,) = folder.rglob("*.gguf")
        assert sha(copy) == sha(weights_of(server)["copies"]["cpu-0"])

        nodes = {n["node_id"]: n for n in server.admin("GET", "/admin/cluster")["nodes"]}
        assert nodes["cpu-r"]["pid"] is None and nodes["cpu-r"]["memory"]["capacity_bytes"] == 4 * 2**30
        os.kill(nodes["cpu-0"]["pid"], signal.SIGKILL)
        time.sleep(0.3)
        out = server.client().chat.completions.create(
            model="demo/smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert out.choices[0].message.content is not None  # served by cpu-r while cpu-0 restarts

        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 30
        while server.http("GET", "/healthz")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        status, health = server.http("GET", "/healthz")
        assert status == 503 and health["nodes"]["cpu-r"] == "down"
        agent = _remote_agent(port, weights_port, folder)
        server.wait_healthy(30)
        (again,) = server.admin("POST", "/admin/scale", {"tenant": "demo", "model": "demo/smollm2",
                                                         "nodes": ["cpu-r"]})["results"]
        assert again["ok"] and again["weights"] == "host copy (already on the node)", again
        nodes = {n["node_id"]: n for n in server.admin("GET", "/admin/cluster")["nodes"]}
        assert nodes["cpu-r"]["restarts"] == 1  # one reconnection
    finally:
        agent.kill()
        assert server.stop() == 0
