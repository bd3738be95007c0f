"""`GET /openapi.json` describes every route (issue 13 item 5), and schemathesis fuzzes a live
`mesh serve --demo` with it without a single 5xx."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.service.app import build_app
from mesh.service.openapi import OPERATIONS, build_spec, routes


class _Config:
    max_body_bytes = 1 << 20


class _Service:
    config = _Config()


def test_every_route_is_in_the_spec_with_its_methods():
    app = build_app(_Service())
    spec = build_spec(app)
    served = routes(app)
    assert len(served) >= 20 and ("POST", "/v1/chat/completions") in served
    for method, path in served:
        assert path in spec["paths"], path
        op = spec["paths"][path][method.lower()]
        assert op["summary"] != "undocumented", (method, path)
    # nothing described that is not served; every method of every path is a served route
    listed = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert listed == set(served) == set(OPERATIONS)
    # path parameters are declared; bodies of the OpenAI routes come from the parsers' limits
    assert spec["paths"]["/v1/models/{name}"]["get"]["parameters"][0]["name"] == "name"
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["required"] == ["model", "messages"]
    assert spec["paths"]["/admin/tenants"]["post"]["security"] == [{"adminToken": []}]
    json.dumps(spec)  # plain JSON


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(tmp_path_factory, demo_gguf):
    """The real fuzzer against the real server: every OpenAI and REST route, a valid tenant
    key; no 5xx; the server and its node agent still serve a chat afterwards."""
    pytest.importorskip("schemathesis")
    from test_service_e2e import ADMIN, Server

    st = [sys.executable, "-m", "schemathesis.cli"]  # the CLI of the schemathesis this Python imports
    root = tmp_path_factory.mktemp("fuzz")
    allowed = root / "allowed"
    (allowed / "demo").mkdir(parents=True)  # the demo tenant's folder: its paths are relative to it
    shutil.copy(demo_gguf, allowed / "demo" / "smollm2.gguf")
    server = Server(root / "data", allowed, root / "server.log")
    server.start()
    try:
        status, spec = server.http("GET", "/openapi.json")
        assert status == 200 and spec["openapi"].startswith("3.")
        # The fuzzer's copy of the spec, so that its cases reach the engine rather than 404: the
        # generation routes name a copy of the demo model with a 64-token window (or a missing
        # model) and keep generations short (max_tokens <= 4: the demo model on shared cores;
        # the window bounds the cases that break that rule, e.g. no max_tokens, which is up to
        # the window: with the demo's 4096 such a case ran past the fuzzer's 120 s timeout);
        # registrations name the allowed file, a missing one or an escape; model paths name
        # the demo model or a missing one.
        status, short = server.http("POST", "/v1/models", {"name": "short", "path": "smollm2.gguf",
                                                           "context_length": 64}, token=server.key)
        assert status == 201, short
        models = ["demo/smollm2", "demo/none"]
        for path in ("/v1/chat/completions", "/v1/completions"):
            body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            body["properties"]["model"] = {"enum": ["short", "demo/none"]}
            body["properties"]["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
            body["properties"].pop("max_completion_tokens")
            body["required"] = [*body["required"], "max_tokens"]
        reg = spec["paths"]["/v1/models"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        reg["properties"]["path"] = {"enum": ["smollm2.gguf", "missing.gguf", "../smollm2.gguf", "/etc/passwd"]}
        spec["paths"]["/v1/models/{name}"]["get"]["parameters"][0]["schema"] = {"enum": models}
        spec["paths"]["/v1/models/{name}"]["delete"]["parameters"][0]["schema"] = {"enum": ["demo/none", "none"]}
        # The admin routes, fuzzed past their authentication with the admin token, act on a fuzz
        # tenant or a missing one (not the demo tenant, whose key the last check uses).
        for ops in spec["paths"].values():
            for op in ops.values():
                for param in op.get("parameters", []):
                    if param["name"] == "tenant":
                        param["schema"] = {"enum": ["fuzz", "nobody"]}
        server.admin("POST", "/admin/tenants", {"name": "fuzz"})
        local = root / "openapi.json"
        local.write_text(json.dumps(spec))

        def fuzz(token: str, *only: str) -> int:
            cmd = [*st, "run", str(local), "--url", server.url, "-H", f"Authorization: Bearer {token}", *only,
                   "--checks", "not_a_server_error", "--max-examples", "25", "--seed", "1", "--request-timeout",
                   "120", "--workers", "1", "--no-color"]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
            out = run.stdout + run.stderr
            m = re.search(r"(\d+)\s+generated", out)
            print(f"schemathesis {' '.join(only) or '(every route)'}: {m.group(0) if m else 'cases: ?'}")
            print(out[-3000:])
            assert run.returncode == 0, out[-6000:]
            return int(m.group(1)) if m else 0

        assert fuzz(server.key) > 100  # every route with a tenant's key (admin routes: 401)
        assert fuzz(ADMIN, "--include-path-regex", "^/admin") > 100  # admin routes with the admin token
        assert server.proc.poll() is None
        assert server.http("GET", "/healthz")[0] == 200
        reply = server.client().chat.completions.create(
            model="demo/smollm2", max_tokens=8, messages=[{"role": "user",
                                                           "content": "What is the capital of France?"}])
        assert reply.choices[0].message.content
    finally:
        server.stop()
        print(Path(server.log).read_text()[-2000:] if Path(server.log).exists() else "", file=sys.stderr)


def test_sampling_values_below_float32_reach_the_engine_as_the_smallest_positive():
    """Found by schemathesis: top_p=5e-324 passed the (0, 1] check, became 0 in the engine's
    float32 config and failed the admission call (the request then hung)."""
    from mesh.modelfiles.sampling import MIN_POSITIVE, resolve

    assert resolve(5e-324, 5e-324, None) == (MIN_POSITIVE, MIN_POSITIVE)
    assert resolve(0.0, None, None) == (0.0, 1.0)  # greedy stays greedy
    assert resolve(None, None, {"temperature": 0.3}) == (0.3, 1.0)
