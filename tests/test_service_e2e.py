"""`mesh serve` end to end: the real server in a subprocess, the official `openai` client, the
real SmolLM2 model on the CPU node agent. One server is shared by the module's tests (each
model load costs seconds); the last test stops it mid-stream (drain) and restarts it on the
same data folder (persistence)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

ADMIN = "test-admin-token"


class Server:
    """`mesh serve` as a process: the demo model and an allowed folder, or (allowed=None) only
    what `extra` says (e.g. --emulate)."""

    def __init__(self, data_dir: Path, allowed: Path | None, log: Path, extra: tuple[str, ...] = ()) -> None:
        self.data_dir, self.allowed, self.log, self.extra = data_dir, allowed, log, extra
        self.proc: subprocess.Popen | None = None
        self.url = self.key = ""

    def start(self, timeout: float = 180.0) -> None:
        demo = () if self.allowed is None else ("--demo", "--allowed-dir", str(self.allowed), "--max-body-mb", "1")
        cmd = [sys.executable, "-m", "mesh.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--data-dir", str(self.data_dir), *demo, "--log-level", os.environ.get("MESH_TEST_LOG_LEVEL", "INFO"),
               *self.extra]
        env = dict(os.environ, MESH_ADMIN_TOKEN=ADMIN)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.log, "a"), text=True, env=env)
        found: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                if "ready url=" in line:
                    found.append(line)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not found:
            self.proc.kill()
            raise RuntimeError(f"mesh serve did not get ready; log:\n{self.log.read_text()[-3000:]}")
        m = re.search(r"ready url=(\S+)(?: api_key=(\S+))?", found[0])
        self.url, self.key = m.group(1), m.group(2) or ""

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9

    def client(self, key: str | None = None, **kw: Any) -> Any:
        # Retries honour Retry-After: a request for a cold model is turned away (its cold start
        # counts in its TTFT, LLM-Mesh 4) with the time its instance needs, as OpenAI clients expect.
        kw.setdefault("max_retries", 3)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.key, timeout=180, **kw)

    def http(self, method: str, path: str, body: Any = None, token: str | None = None,
             raw: bytes | None = None, headers: dict | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json", **(headers or {})}
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=180) as resp:
                return resp.status, _json(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())

    def admin(self, method: str, path: str, body: Any = None) -> Any:
        status, data = self.http(method, path, body, token=ADMIN)
        assert status in (200, 201), (status, data)
        return data

    def agent_pid(self) -> int:
        return self.admin("GET", "/admin/cluster")["nodes"][0]["pid"]

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.http("GET", "/healthz")[0] == 200:
                return
            time.sleep(0.1)
        raise AssertionError("the server did not become healthy")


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def allowed_with_demo(root: Path, demo_gguf: Path) -> Path:
    """A registration folder under `root` holding the demo model as smollm2.gguf (a hard link, else a copy)."""
    allowed = root / "allowed"
    allowed.mkdir()
    try:
        os.link(demo_gguf, allowed / "smollm2.gguf")
    except OSError:
        shutil.copy(demo_gguf, allowed / "smollm2.gguf")
    return allowed


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_gguf) -> Server:
    root = tmp_path_factory.mktemp("serve")
    allowed = allowed_with_demo(root, demo_gguf)
    os.symlink(demo_gguf, allowed / "outside-link.gguf")  # points outside the allowed folder
    s = Server(root / "data", allowed, root / "server.log", ("--queue-capacity", "900", "--queue-timeout", "45"))
    s.start()
    yield s
    s.stop()


def _tenant(server: Server, name: str) -> str:
    """A new tenant's API key; its folder of the allowed folder holds smollm2.gguf (a tenant
    registers paths only there)."""
    own = server.allowed / name
    own.mkdir(exist_ok=True)
    try:
        os.link(server.allowed / "smollm2.gguf", own / "smollm2.gguf")
    except OSError:
        shutil.copy(server.allowed / "smollm2.gguf", own / "smollm2.gguf")
    server.admin("POST", "/admin/tenants", {"name": name})
    return server.admin("POST", f"/admin/tenants/{name}/keys", {"label": "test"})["key"]


# ---- serving --------------------------------------------------------------------------------------


def test_chat_and_completions(server):
    c = server.client()
    chat = c.chat.completions.create(model="demo/smollm2", messages=[{"role": "user", "content": "What is 2+2?"}],
                                     max_tokens=8, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens > 10 and 0 < chat.usage.completion_tokens <= 8
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    comp = c.completions.create(model="demo/smollm2", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert comp.object == "text_completion" and "Paris" in comp.choices[0].text
    assert comp.usage.completion_tokens == 4 and comp.choices[0].finish_reason == "length"
    assert [m.id for m in c.models.list()] == ["demo/smollm2"]
    assert c.models.retrieve("demo/smollm2").owned_by == "demo"


def test_streaming_matches_whole_answers(server):
    c = server.client()
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = c.chat.completions.create(model="demo/smollm2", messages=messages, max_tokens=12, temperature=0)
    chunks = list(c.chat.completions.create(model="demo/smollm2", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    comp = list(c.completions.create(model="demo/smollm2", prompt="One, two, three,", max_tokens=6, temperature=0,
                                     stream=True))
    assert len(comp) >= 2 and "".join(ch.choices[0].text for ch in comp).strip()
    assert comp[-1].choices[0].finish_reason == "length"


def test_stop_seed_and_token_prompts(server):
    c = server.client()
    r = c.completions.create(model="demo/smollm2", prompt="Count: 1, 2, 3, 4,", max_tokens=16, temperature=0,
                             stop=[" 6"])
    assert r.choices[0].finish_reason == "stop" and " 6" not in r.choices[0].text and "5" in r.choices[0].text
    a, b = (c.completions.create(model="demo/smollm2", prompt="A random word:", max_tokens=8, temperature=1.0,
                                 top_p=0.9, seed=42).choices[0].text for _ in range(2))
    assert a == b
    ids = c.completions.create(model="demo/smollm2", prompt=[504, 3575, 282, 4649, 314], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 5


def test_requests_without_temperature_get_the_models_sampling_defaults(server):
    """The demo model's defaults (its card's temperature 0.2, top_p 0.9) answer the README's
    question; a model registered with greedy defaults answers exactly as at temperature 0."""
    c = server.client()
    demo = c.models.retrieve("demo/smollm2").model_extra["mesh"]
    assert demo["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}
    question = [{"role": "user", "content": "What is the capital of France?"}]
    for seed in (1, 2, 3):  # seeded so the test is repeatable; still sampled at the defaults
        answer = c.chat.completions.create(model="demo/smollm2", messages=question, max_tokens=24, seed=seed)
        assert "Paris" in answer.choices[0].message.content, answer.choices[0].message.content

    key = _tenant(server, "greta")
    status, body = server.http("POST", "/v1/models", {"name": "greedy", "path": "smollm2.gguf",
                                                      "sampling_defaults": {"temperature": 0}}, token=key)
    assert status == 201 and body["mesh"]["sampling_defaults"] == {"temperature": 0.0}
    g = server.client(key)
    prompt = "Once upon a time, in a small village,"
    outputs = [g.completions.create(model="greedy", prompt=prompt, max_tokens=24, **kw).choices[0].text
               for kw in ({}, {"seed": 5}, {"temperature": 0})]
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) > 20
    hot = g.completions.create(model="greedy", prompt=prompt, max_tokens=24, temperature=1.5, seed=5).choices[0].text
    assert hot != outputs[0]  # a request's own temperature still wins
    for bad, param in (({"temperature": 3}, "temperature"), ({"top_k": 5}, "top_k"), ("hot", "object")):
        status, err = server.http("POST", "/v1/models", {"name": "bad", "path": "smollm2.gguf",
                                                         "sampling_defaults": bad}, token=key)
        assert status == 400 and err["error"]["param"] == "sampling_defaults" and param in err["error"]["message"]


# ---- tenants and models -------------------------------------------------------------------------------


def test_tenant_isolation_and_model_registration(server):
    alice, bob = _tenant(server, "alice"), _tenant(server, "bob")
    ca, cb = server.client(alice), server.client(bob)
    status, body = server.http("POST", "/v1/models", {"name": "team/small", "path": "smollm2.gguf",
                                                      "context_length": 1024, "slo": {"ttft_s": 5}}, token=alice)
    assert status == 201 and body["id"] == "team/small" and body["mesh"]["context_length"] == 1024
    assert server.http("POST", "/v1/models", {"name": "team/small", "path": "smollm2.gguf"}, token=alice)[0] == 409
    assert [m.id for m in ca.models.list()] == ["team/small"]
    assert [m.id for m in cb.models.list()] == []
    # Bob cannot see or use it, and the answers are the same as for a model that does not exist.
    with pytest.raises(openai.NotFoundError) as theirs:
        cb.chat.completions.create(model="team/small", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError) as missing:
        cb.chat.completions.create(model="team/none", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert theirs.value.body["code"] == missing.value.body["code"] == "model_not_found"
    assert theirs.value.body["message"].replace("team/small", "X") == missing.value.body["message"].replace("team/none",
                                                                                                            "X")
    assert server.http("GET", "/v1/models/team/small", token=bob)[0] == 404
    assert server.http("DELETE", "/v1/models/team/small", token=bob)[0] == 404
    with pytest.raises(openai.NotFoundError):
        cb.chat.completions.create(model="demo/smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    # Alice's own model serves her.
    r = ca.chat.completions.create(model="team/small", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.usage.completion_tokens >= 1
    # Bob may use the same name for his own model.
    assert server.http("POST", "/v1/models", {"name": "team/small", "path": "smollm2.gguf"}, token=bob)[0] == 201
    assert server.http("DELETE", "/v1/models/team/small", token=bob)[1]["deleted"] is True
    assert [m.id for m in ca.models.list()] == ["team/small"]  # Alice's is untouched


def test_registration_refuses_path_escapes(server, demo_gguf):
    """A path out of the tenant's folder answers exactly what a missing file does (404)."""
    key = _tenant(server, "carol")
    # a registration refused for its path takes from the tenant's registration rate too (a prober's attempts
    # count): this test's dozen would empty the default burst, so the operator lifts it here
    server.admin("PUT", "/admin/tenants/carol/quota", {"registrations_per_min": None})
    os.symlink(demo_gguf, server.allowed / "carol" / "outside-link.gguf")  # points outside the allowed folder
    status, missing = server.http("POST", "/v1/models", {"name": "x", "path": "missing.gguf"}, token=key)
    assert status == 404 and missing["error"]["param"] == "path", missing
    for path in ("../allowed/smollm2.gguf", "outside-link.gguf", str(server.data_dir / "registry.sqlite3"),
                 "/etc/passwd", "../smollm2.gguf", str(server.allowed / "smollm2.gguf"), "../greta/smollm2.gguf", "."):
        assert server.http("POST", "/v1/models", {"name": "x", "path": path}, token=key) == (404, missing), path
    status, body = server.http("POST", "/v1/models", {"name": "../x", "path": "smollm2.gguf"}, token=key)
    assert status == 400 and body["error"]["param"] == "name"
    status, body = server.http("POST", "/v1/models", {"name": "x", "path": "smollm2.gguf", "context_length": 10**6},
                               token=key)
    assert status == 400 and body["error"]["param"] == "context_length"
    status, body = server.http("POST", "/v1/models", {"name": "x", "path": "smollm2.gguf", "slo": {"tpot_s": -1}},
                               token=key)
    assert status == 400 and body["error"]["param"] == "slo.tpot_s"


def test_upload_with_checksum(server, demo_gguf):
    key = _tenant(server, "dave")
    data = Path(demo_gguf).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    octet = {"Content-Type": "application/octet-stream"}
    status, body = server.http("POST", "/v1/models?name=up&sha256=" + "0" * 64, raw=data, token=key, headers=octet)
    assert status == 400 and body["error"]["code"] == "checksum_mismatch"
    status, body = server.http("POST", "/v1/models?name=up", raw=data, token=key, headers=octet)
    assert status == 400 and body["error"]["param"] == "sha256"
    status, body = server.http("POST", f"/v1/models?name=up&sha256={digest}&context_length=512", raw=data, token=key,
                               headers=octet)
    assert status == 201 and body["mesh"]["source"] == "upload" and body["mesh"]["sha256"] == digest
    uploads = list((server.data_dir / "uploads").iterdir())
    assert len(uploads) == 1 and uploads[0].stat().st_size == len(data)
    r = server.client(key).completions.create(model="up", prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    assert server.http("DELETE", "/v1/models/up", token=key)[0] == 200
    assert list((server.data_dir / "uploads").iterdir()) == []


# ---- errors -----------------------------------------------------------------------------------------------


def test_error_statuses(server):
    chat = {"model": "demo/smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    # 401: no key, a wrong key, a revoked key, admin routes without the admin token
    assert server.http("POST", "/v1/chat/completions", chat)[0] == 401
    status, body = server.http("POST", "/v1/chat/completions", chat, token="mesh-wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    server.admin("POST", "/admin/tenants", {"name": "erin"})
    issued = server.admin("POST", "/admin/tenants/erin/keys")
    assert server.http("GET", "/v1/models", token=issued["key"])[0] == 200
    server.admin("DELETE", f"/admin/keys/{issued['id']}")
    assert server.http("GET", "/v1/models", token=issued["key"])[0] == 401
    assert server.http("GET", "/admin/cluster", token=server.key)[0] == 401
    assert server.http("GET", "/admin/cluster")[0] == 401
    # 400: malformed JSON and bad fields, in the OpenAI format
    status, body = server.http("POST", "/v1/chat/completions", raw=b"{not json", token=server.key)
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    for bad, param in (({**chat, "temperature": "hot"}, "temperature"), ({**chat, "messages": "hi"}, "messages"),
                       ({**chat, "max_tokens": -3}, "max_tokens"), ({k: v for k, v in chat.items() if k != "model"},
                                                                    "model")):
        status, body = server.http("POST", "/v1/chat/completions", bad, token=server.key)
        assert status == 400 and body["error"]["param"] == param, body
    # 404: unknown model, unknown route
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=chat["messages"], max_tokens=2)
    assert server.http("GET", "/v2/whatever", token=server.key)[0] == 404
    # 413: a body over --max-body-mb 1
    status, body = server.http("POST", "/v1/chat/completions", raw=b'{"x": "' + b"a" * (2 * 2**20) + b'"}',
                               token=server.key)
    assert status == 413 and body["error"]["code"] == "request_too_large"


JUNK = [
    ("POST", "/v1/chat/completions", b'{"model": 5, "messages": 3}'),
    ("POST", "/v1/chat/completions", b'{"model": "demo/smollm2", "messages": [{"role": "user", "content": "hi"}], '
                                     b'"max_tokens": 1e400}'),
    ("POST", "/v1/completions", b'{"model": "demo/smollm2", "prompt": "\\ud800", "max_tokens": 2}'),
    ("POST", "/v1/completions", b'{"model": "demo/smollm2", "prompt": [99999999], "max_tokens": 2}'),
    ("POST", "/v1/completions", b'{"model": "demo/smollm2", "prompt": [[1, 2], [3]]}'),
    ("POST", "/v1/completions", b'\xff\xfe\x00'),
    ("GET", "/v1/models/%ED%A0%80", None),
    ("GET", "/v1/models/..%2f..%2fetc", None),
    ("POST", "/v1/models", b'{"name": 5, "path": []}'),
    ("POST", "/v1/models?name=x&sha256=abc&context_length=zz", b"GGUF"),
    ("PUT", "/v1/chat/completions", b"{}"),
]


def test_bad_input_never_gets_a_500(server):
    for method, path, raw in JUNK:
        headers = {"Content-Type": "application/octet-stream"} if "sha256" in path else None
        status, body = server.http(method, path, raw=raw, token=server.key, headers=headers)
        assert 400 <= status < 500, (method, path, status, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
    for raw in (b'{"name": 123}', b"[]"):
        assert server.http("POST", "/admin/tenants", raw=raw, token=ADMIN)[0] == 400


def test_prompt_over_the_context_window_and_unplaceable_requests(server):
    key = _tenant(server, "frank")
    # --demo's default admission queues (issue 33); this model chooses to turn away what cannot meet its SLO
    status, _ = server.http("POST", "/v1/models", {"name": "strict", "path": "smollm2.gguf", "context_length": 64,
                                                   "slo": {"ttft_s": 0.001, "ttft_s_per_prompt_token": 0},
                                                   "admission": "reject"}, token=key)
    assert status == 201
    c = server.client(key)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="strict", prompt="word " * 200, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and "64" in e.value.body["message"]
    # A 1 ms TTFT SLO cannot be met: the dispatcher turns it away (429), it is not queued forever.
    with pytest.raises(openai.RateLimitError) as e:
        server.client(key, max_retries=0).completions.create(model="strict", prompt="Hello", max_tokens=2)
    assert e.value.body["code"] == "slo_unattainable" and "cannot meet its SLO" in e.value.body["message"]
    assert "admission is 'reject'" in e.value.body["message"]
    assert int(e.value.response.headers["Retry-After"]) >= 1
    metrics = server.http("GET", "/metrics", token=ADMIN)[1]
    assert 'mesh_requests_total{model="strict",outcome="rejected",tenant="frank"} 1.0' in metrics
    usage = server.http("GET", "/v1/usage", token=key)[1]["data"]
    (strict,) = [m for m in usage if m["model"] == "strict"]
    assert strict["requests"]["rejected"] == 1 and strict["slo"]["placed"] == 1 and strict["slo"]["attainment"] == 0


def test_a_tenants_default_admission(server):
    """`PUT /admin/tenants/{t}/admission` sets the default for the tenant's models without their
    own choice: here `reject`, under --demo's service default `queue`; null restores it."""
    key = _tenant(server, "gina")
    assert server.admin("GET", "/admin/tenants/gina/admission") == {
        "tenant": "gina", "admission": None, "service_default": "queue", "effective": "queue"}
    status, err = server.http("PUT", "/admin/tenants/gina/admission", {"admission": "wait"}, token=ADMIN)
    assert status == 400 and err["error"]["param"] == "admission"
    assert server.admin("PUT", "/admin/tenants/gina/admission", {"admission": "reject"})["effective"] == "reject"
    status, _ = server.http("POST", "/v1/models", {"name": "hopeless", "path": "smollm2.gguf", "context_length": 64,
                                                   "slo": {"ttft_s": 0.001, "ttft_s_per_prompt_token": 0}}, token=key)
    assert status == 201
    with pytest.raises(openai.RateLimitError) as e:
        server.client(key, max_retries=0).completions.create(model="hopeless", prompt="Hello", max_tokens=2)
    assert "cannot meet its SLO" in e.value.body["message"] and "admission is 'reject'" in e.value.body["message"]
    assert int(e.value.response.headers["Retry-After"]) >= 1
    assert server.admin("PUT", "/admin/tenants/gina/admission", {"admission": None})["effective"] == "queue"


def test_ignore_eos_generates_exactly_max_tokens(server):
    """vLLM's `ignore_eos` extension: the answer runs to max_tokens (what benchmarks and
    `mesh replay --live` need to replay a trace's output lengths)."""
    c = server.client()
    r = c.completions.create(model="demo/smollm2", prompt="Hi", max_tokens=48, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 48 and r.choices[0].finish_reason == "length"
    status, body = server.http("POST", "/v1/completions", {"model": "demo/smollm2", "prompt": "Hi", "max_tokens": 4,
                                                            "ignore_eos": "yes"}, token=server.key)
    assert status == 400 and body["error"]["param"] == "ignore_eos"


def test_live_replay_sends_the_trace_and_simulates_the_same_requests(server, tmp_path):
    """`mesh replay --live` at its smallest: two functions for one minute through the real
    service; the live and simulated figures cover the same requests, every one counted."""
    out = tmp_path / "live.json"
    env = dict(os.environ, MESH_ADMIN_TOKEN=ADMIN)
    run = subprocess.run([sys.executable, "-m", "mesh.cli", "replay", "--live", server.url, "--functions", "2",
                          "--minutes", "1", "--seed", "2", "--target-rps", "0.3", "--no-progress", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    live, sim = data["live"], data["simulated"]
    n = data["replay"]["workload"]["requests"]
    assert n >= 5 and live["requests"] == sim["requests"] == n
    for figures in (live, sim):
        assert figures["slo_compliant"] + figures["slo_violating"] + figures["rejected"] + figures["failed"] == n
        assert figures["slo_rate"] == pytest.approx(figures["slo_compliant"] / n)
        assert {"ttft_p99_s", "tpot_p99_s", "cpu_nodes_avg", "gpu_nodes_avg", "slo_rate_strict"} <= set(figures)
    assert live["completed"] >= 1 and live["cpu_nodes_avg"] > 0  # how many meet the SLO depends on the machine's load
    detail = live["requests_detail"]  # every request, as the client saw it
    assert len(detail) == n and sum(r["slo_met"] for r in detail) == live["slo_compliant_strict"]
    assert sum(r["outcome"] == "rejected" for r in detail) == live["rejected"]
    dispatcher = live["service"]["dispatcher"]  # the service's own account at the end
    lag = live["service"]["control_plane"]["loop_lag"]  # the service's event-loop lag (issue 24's bound)
    assert lag["count"] > 0 and 0 <= lag["p50_s"] <= lag["p99_s"] <= lag["max_s"]
    assert dispatcher["policy"] == "mesh" and sum(dispatcher["placed_by_kind"].values()) >= live["completed"]
    # the queue `mesh serve --queue-*` set is the service's, and the twin's
    assert (dispatcher["queue_capacity"], dispatcher["queue_timeout_s"]) == (900, 45)
    assert data["replay"]["queue"] == {"capacity": 900, "timeout_s": 45}
    assert "live (mesh)" in run.stdout and "simulated (mesh)" in run.stdout and live["policy"] == "mesh"
    tenants = {t["name"] for t in server.admin("GET", "/admin/tenants")["data"]}
    assert data["live"]["tenant"] not in tenants  # cleaned up


def test_metrics_and_cluster_view(server):
    server.client().completions.create(model="demo/smollm2", prompt="Hello", max_tokens=4)  # an instance serving
    assert server.http("GET", "/metrics", token=server.key)[0] == 401  # a tenant's key does not open it
    metrics = server.http("GET", "/metrics", token=ADMIN)[1]
    for name in ("mesh_ttft_seconds_bucket", "mesh_tpot_seconds_bucket", "mesh_slo_attainment",
                 "mesh_node_queue_length",
                 "mesh_node_instances", "mesh_node_kv_bytes_in_use", "mesh_node_busy_fraction", "mesh_node_up"):
        assert name in metrics, name
    assert 'mesh_ttft_seconds_count{model="demo/smollm2",tenant="demo"}' in metrics
    (demo,) = server.http("GET", "/v1/usage", token=server.key)[1]["data"]
    assert demo["model"] == "demo/smollm2" and demo["requests"]["completed"] > 0 and demo["ttft_s_mean"] > 0
    assert demo["completion_tokens"] > 0 and 0 <= demo["slo"]["attainment"] <= 1
    view = server.admin("GET", "/admin/cluster")
    node = view["nodes"][0]
    assert node["kind"] == "cpu" and node["state"] == "up" and node["memory"]["capacity_bytes"] > 0
    assert node["deadlines"] == "eq1"  # the service's default deadline rule (docs/design.md)
    # The instance that served, once the service's view has read the agent's stats after it
    # (they are polled: the view may predate the request, e.g. on an instance loaded for it).
    deadline = time.monotonic() + 30
    while True:
        node = server.admin("GET", "/admin/cluster")["nodes"][0]
        inst = [i for i in node["instances"] if i["model"] == "demo/smollm2" and (i.get("time_factors") or {}).get(
            "observed", 0) > 0]
        if inst or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert inst and inst[0]["state"] == "ready" and inst[0]["weight_bytes"] > 0, node["instances"]
    drift = inst[0]["time_factors"]  # the profile's drift as the agent learnt it from served iterations
    assert drift["observed"] > 0 and drift["regions"] >= 1 and drift["max_drift"] >= 0
    metrics = server.http("GET", "/metrics", token=ADMIN)[1]
    assert f'mesh_instance_time_factor{{instance="{inst[0]["instance_id"]}",kind="decode"' in metrics
    assert "mesh_instance_profile_drift{" in metrics
    assert server.http("GET", "/healthz")[1]["status"] == "ok"


# ---- faults ---------------------------------------------------------------------------------------------------


def test_killing_the_node_agent_mid_stream(server):
    """The one agent of a single-node service SIGKILLed mid-stream: its request goes back to
    the dispatcher with its progress and waits while the supervisor restarts the agent and
    the model loads there again; the stream then goes on from the next token, to exactly
    its max_tokens, with no error (tests/test_node_loss_e2e.py: two nodes, three kills)."""
    c = server.client(max_retries=0)
    pid = server.agent_pid()
    stream = c.chat.completions.create(model="demo/smollm2", messages=[{"role": "user",
                                                                        "content": "Tell a long story."}],
                                       max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    got, usage, finish = 0, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            got += bool(choice.delta.content)
            finish = choice.finish_reason or finish
        if got == 3 and server.agent_pid() == pid:
            os.kill(pid, signal.SIGKILL)
    assert usage == 40 and finish == "length"
    assert server.agent_pid() != pid
    resumed = server.admin("GET", "/admin/cluster")["dispatcher"]["resumed"]
    assert resumed["exited"] + resumed["connection"] == 1, resumed
    r = c.completions.create(model="demo/smollm2", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert "Paris" in r.choices[0].text
    assert server.admin("GET", "/admin/cluster")["nodes"][0]["restarts"] == 1


@pytest.mark.shared_processes  # the server it starts again is the module fixture's, which stops it
def test_shutdown_drains_streams_and_restart_keeps_everything(server):
    key = _tenant(server, "grace")
    assert server.http("POST", "/v1/models", {"name": "keep", "path": "smollm2.gguf"}, token=key)[0] == 201
    old_demo_key = server.key
    c = server.client()
    stream = c.chat.completions.create(model="demo/smollm2", messages=[{"role": "user", "content": "Count to ten."}],
                                       max_tokens=40, temperature=0, stream=True)
    first = next(iter(stream))
    server.proc.send_signal(signal.SIGTERM)  # the open stream finishes before the server exits
    rest = list(stream)
    assert rest and rest[-1].choices[0].finish_reason in ("stop", "length")
    assert first.choices[0].delta.role == "assistant"
    assert server.proc.wait(60) == 0

    server.start()
    assert server.key != old_demo_key  # a fresh demo key each start; the old one still works
    assert [m.id for m in server.client(old_demo_key).models.list()] == ["demo/smollm2"]
    assert [m.id for m in server.client(key).models.list()] == ["keep"]
    tenants = {t["name"] for t in server.admin("GET", "/admin/tenants")["data"]}
    assert {"demo", "alice", "bob", "grace"} <= tenants and "erin" in tenants
    r = server.client(key).completions.create(model="keep", prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens == 2
