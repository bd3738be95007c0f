"""One registration, both kinds of node, end to end (issue 11 item 3): the real `mesh serve
--demo --vllm-cpu` with its OpenVINO CPU agent and its vLLM-on-CPU agent (standing in for a
GPU node), the demo SmolLM2 GGUF registered once.

1. `--policy sllm` (GPU nodes only): the service converts the GGUF to a Hugging Face folder
   in the background, records it in SQLite, puts it in the parameter pool (first host copy on
   the vLLM node), and the request is served by vLLM from that copy: "Paris".
2. Restarted on the same data folder under `--policy mesh`: the prepared format is still
   ready (same row, nothing converted again), the request is served on the CPU node (CPU
   first), and `/admin/scale` starts the model on the vLLM node too.
"""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from test_convert import _converter_python
from test_service_e2e import Server

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

ASK = dict(model="demo/smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
           max_tokens=20, temperature=0)


def demo_view(server: Server) -> dict:
    status, body = server.http("GET", "/v1/models/demo/smollm2", token=server.key)
    assert status == 200, body
    return body["mesh"]


def prepared_row(data: Path) -> tuple:
    db = sqlite3.connect(data / "registry.sqlite3")
    try:
        return db.execute("SELECT node_kind, format, path, state, reason, updated_at FROM prepared_formats").fetchone()
    finally:
        db.close()


def instances(server: Server) -> dict[str, list[str]]:
    nodes = server.admin("GET", "/admin/cluster")["nodes"]
    return {n["node_id"]: [i["model"] for i in n["instances"] if i["state"] == "ready"] for n in nodes}


def test_a_gguf_registered_once_is_served_by_openvino_and_by_vllm(tmp_path):
    _converter_python()  # skips without vLLM's environment (or its gguf package)
    data, allowed = tmp_path / "data", tmp_path / "allowed"
    allowed.mkdir()
    server = Server(data, allowed, tmp_path / "sllm.log", extra=("--vllm-cpu", "--policy", "sllm"))
    server.start()
    try:
        started = time.monotonic()
        view = demo_view(server)
        while view["formats"]["gpu"]["state"] == "preparing" and time.monotonic() - started < 900:
            time.sleep(1)
            view = demo_view(server)
        assert view["formats"]["gpu"]["state"] == "ready", view
        assert view["node_kinds"] == ["cpu", "gpu"] and view["formats"]["cpu"]["format"] == "gguf"
        print(f"\nGGUF -> HF folder in the service: {view['formats']['gpu']['seconds']} s, "
              f"{view['formats']['gpu']['weight_bytes'] / 1e6:.1f} MB of weights")
        row = prepared_row(data)
        assert row[:2] == ("gpu", "hf") and row[3:5] == ("ready", "")
        assert Path(row[2]).is_relative_to(data / "prepared") and (Path(row[2]) / "model.safetensors").is_file()

        answer = server.client().chat.completions.create(**ASK).choices[0].message.content
        assert "Paris" in answer, answer
        placed = instances(server)
        assert placed["vllm-cpu-0"] == ["demo/smollm2"] and placed["cpu-0"] == []  # sllm: GPU nodes only
        cluster = server.admin("GET", "/admin/cluster")
        assert cluster["dispatcher"]["placed_by_kind"] == {"gpu": 1}
        pool = {m["node_kind"]: m for m in cluster["weights"]["models"].values()}
        assert pool["gpu"]["host_copies"] == ["vllm-cpu-0"] and pool["gpu"]["native"] is False
        assert Path(pool["gpu"]["copies"]["vllm-cpu-0"]).is_relative_to(data / "nodes" / "vllm-cpu-0")
        (instance,) = [i for n in cluster["nodes"] if n["node_id"] == "vllm-cpu-0" for i in n["instances"]]
        assert instance["weights"] in ("host copy", "host copy (already on the node)")
    finally:
        assert server.stop() == 0

    server = Server(data, allowed, tmp_path / "mesh.log", extra=("--vllm-cpu",))  # --policy mesh
    server.start()
    try:
        view = demo_view(server)
        assert view["formats"]["gpu"]["state"] == "ready" and view["node_kinds"] == ["cpu", "gpu"]
        assert prepared_row(data) == row  # read back, not prepared again
        answer = server.client().chat.completions.create(**ASK).choices[0].message.content
        assert "Paris" in answer, answer
        placed = instances(server)
        assert placed["cpu-0"] == ["demo/smollm2"] and placed["vllm-cpu-0"] == []  # mesh: CPU first
        (result,) = server.admin("POST", "/admin/scale", {"tenant": "demo", "model": "demo/smollm2",
                                                          "nodes": ["vllm-cpu-0"]})["results"]
        assert result["ok"], result
        assert instances(server)["vllm-cpu-0"] == ["demo/smollm2"]
        (listed,) = server.admin("GET", "/admin/models")["data"]
        assert listed["mesh"]["formats"]["gpu"]["state"] == "ready"
        assert "preparing its" not in (tmp_path / "mesh.log").read_text()
    finally:
        assert server.stop() == 0


def test_a_hugging_face_folder_registered_once_is_exported_for_the_cpu_node(tmp_path):
    """The other direction, where the export environment exists (.venv-export): a Hugging
    Face folder (here the demo GGUF converted beforehand) registered by path gets an
    OpenVINO IR prepared for CPU nodes, and `mesh` serves it there, CPU first: "Paris"."""
    from mesh.modelfiles.demo import demo_gguf_path
    from test_convert import convert, export_python

    python = _converter_python()
    export_python()
    data, allowed = tmp_path / "data", tmp_path / "allowed"
    made = convert(python, demo_gguf_path(), allowed / "demo" / "smollm2-hf")  # the demo tenant's folder
    assert made.returncode == 0, made.stderr[-2000:]
    server = Server(data, allowed, tmp_path / "hf.log", extra=("--vllm-cpu",))
    server.start()
    try:
        status, body = server.http("POST", "/v1/models", {"name": "smol-hf", "path": "smollm2-hf"}, token=server.key)
        assert status == 201 and body["mesh"]["kind"] == "hf" and body["mesh"]["node_kinds"] == ["gpu"], body
        started = time.monotonic()
        view = body["mesh"]
        while view["formats"]["cpu"]["state"] == "preparing" and time.monotonic() - started < 900:
            time.sleep(1)
            view = server.http("GET", "/v1/models/smol-hf", token=server.key)[1]["mesh"]
        assert view["formats"]["cpu"]["state"] == "ready" and view["formats"]["cpu"]["format"] == "ir", view
        assert view["node_kinds"] == ["cpu", "gpu"]
        print(f"\nHF -> IR in the service: {view['formats']['cpu']['seconds']} s")
        answer = server.client().chat.completions.create(**{**ASK, "model": "smol-hf"}).choices[0].message.content
        assert "Paris" in answer, answer
        assert "smol-hf" in instances(server)["cpu-0"]  # mesh: CPU first, on the prepared IR
        pool = [m for m in server.admin("GET", "/admin/cluster")["weights"]["models"].values()
                if m["node_kind"] == "cpu" and not m["native"]]
        assert any(Path(m["copies"].get("cpu-0", "/")).joinpath("openvino_model.xml").is_file() for m in pool)
    finally:
        assert server.stop() == 0
