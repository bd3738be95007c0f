"""guidellm, the vLLM project's load generator (the `bench` extra), against a real
`mesh serve --demo` with its default validation on (GET /health, GET /v1/models), as a user
benchmarking Mesh runs it (docs/benchmarking.md): a handful of streamed requests with
`ignore_eos` and `stream_options.include_usage`, none of them errored under the demo's
default admission (queue). Skips, saying why, where guidellm is not installed, unless
MESH_REQUIRE_BENCH=1 (CI, .ci/run), where that is a failure."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_service_e2e import Server

pytestmark = pytest.mark.slow


def _guidellm() -> Path:
    exe = Path(sys.executable).with_name("guidellm")
    if exe.exists():
        return exe
    found = shutil.which("guidellm")
    if found:
        return Path(found)
    why = "guidellm is not installed (the bench extra: pip install -e '.[bench]'; scripts/setup.sh does it)"
    if os.environ.get("MESH_REQUIRE_BENCH") == "1":
        pytest.fail(why + " and MESH_REQUIRE_BENCH=1")
    pytest.skip(why)


def test_guidellm_runs_against_mesh_serve_demo_with_validation(tmp_path, demo_gguf):
    guidellm = _guidellm()
    server = Server(tmp_path / "data", tmp_path / "allowed", tmp_path / "server.log")
    (tmp_path / "allowed").mkdir()
    server.start()
    try:
        report = tmp_path / "report.json"
        # the tokenizer for guidellm's synthetic prompts: the demo GGUF's own (transformers' GGUF loader)
        cmd = [str(guidellm), "run",
               "--backend", f"kind=openai_http,target={server.url},model=demo/smollm2,api_key={server.key}",
               "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=4",
               "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
               "--tokenizer", f"kind=huggingface_auto,model={demo_gguf.parent},load_kwargs.gguf_file={demo_gguf.name}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        (bench,) = json.loads(report.read_text())["benchmarks"]
        totals = bench["metrics"]["request_totals"]
        assert totals == {"successful": 4, "errored": 0, "incomplete": 0, "total": 4}, totals
        # ignore_eos: exactly the asked output per request, counted from the usage chunk
        assert bench["metrics"]["output_token_count"]["successful"]["total_sum"] == 4 * 8
    finally:
        assert server.stop() == 0
