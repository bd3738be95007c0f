"""Tenants' LoRA adapters on a shared base, end to end: the real `mesh serve --demo` with its
OpenVINO CPU agent, the demo model's IR (conftest.demo_ir) registered by the operator as a base,
adapters the test makes (mesh.modelfiles.lora.write_adapter) registered for two tenants on it,
and the OpenAI SDK.

- the zero adapter answers exactly the base's greedy text; a random one changes it, the same
  way twice;
- 8 adapters of 2 tenants, asked at once, are served from one base instance (the node holds
  one instance of the base, no instance per adapter), each with its own adapter's answer;
- bad registrations get 400s (403, 404) that say what is wrong.

The service runs with `--exact-moves` (EXACT_RECOMPUTE: f32, an f16 KV cache), so a request
alone and in a batch compute alike on any CPU: with the plugin's defaults on a CPU with bf16
(AVX-512 BF16, AMX), a batch may turn a near-tie the other way. How soon an adapter's first
token comes on the warm base is printed, a measurement (`mesh bench adapters` times it).
"""
from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mesh.modelfiles.lora import CONFIG, BaseLinears, write_adapter
from test_service_e2e import ADMIN, Server

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

ASK = dict(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16, temperature=0)
BASE = "smol-ir"


def _link_tree(source: Path, target: Path) -> None:
    """The IR folder inside the allowed folder: hard links where the file system allows (546 MB)."""
    try:
        shutil.copytree(source, target, copy_function=os.link)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)


def _tenant(server: Server, name: str) -> str:
    server.admin("POST", "/admin/tenants", {"name": name})
    return server.admin("POST", f"/admin/tenants/{name}/keys", {"label": "test"})["key"]


def _answer(server: Server, key: str, model: str) -> str:
    return server.client(key).chat.completions.create(model=model, **ASK).choices[0].message.content


def _first_token_s(server: Server, key: str, model: str) -> float:
    """Seconds to the first streamed token of a chat request."""
    started = time.monotonic()
    for chunk in server.client(key).chat.completions.create(model=model, stream=True, **ASK):
        if chunk.choices and chunk.choices[0].delta.content:
            return time.monotonic() - started
    raise AssertionError(f"{model} streamed no token")


def _ready_instances(server: Server) -> list[tuple[str, str]]:
    return [(n["node_id"], i["model"]) for n in server.admin("GET", "/admin/cluster")["nodes"]
            for i in n["instances"] if i["state"] == "ready"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_ir):
    root = tmp_path_factory.mktemp("adapters-e2e")
    allowed = root / "allowed"
    _link_tree(demo_ir, allowed / "shared" / "smollm2-ir")
    base = BaseLinears.of_folder(demo_ir)
    for tenant in ("alice", "bob"):
        for i in range(4):
            seed = {"alice": 1, "bob": 11}[tenant] + i
            write_adapter(allowed / tenant / f"tune{i}", base, seed=seed, std=0.1)
    write_adapter(allowed / "alice" / "zero", base, seed=None)
    server = Server(root / "data", allowed, root / "serve.log", ("--exact-moves",))
    server.start()
    try:
        keys = {t: _tenant(server, t) for t in ("alice", "bob")}
        # fp32 weights on two shared cores: a loose SLO, served late rather than turned away (not what is tested)
        server.admin("POST", "/admin/tenants/demo/models", {"name": BASE, "path": "shared/smollm2-ir",
                                                            "slo": {"ttft_s": 30, "tpot_s": 2}, "admission": "late"})
        for tenant in ("alice", "bob"):
            for i in range(4):
                made = server.admin("POST", f"/admin/tenants/{tenant}/models",
                                    {"name": f"tune{i}", "base": BASE, "base_tenant": "demo",
                                     "path": f"{tenant}/tune{i}"})
                assert made["mesh"]["kind"] == "lora" and made["mesh"]["base"] == BASE, made
        server.admin("POST", "/admin/tenants/alice/models",
                     {"name": "zero", "base": BASE, "base_tenant": "demo", "path": "alice/zero"})
        yield server, keys, allowed
    finally:
        assert server.stop() == 0
        shutil.rmtree(root, ignore_errors=True)  # a GB of adapters and caches (pyproject's tmp_path note)


def test_the_zero_adapter_reproduces_the_base_and_a_random_one_changes_it_the_same_way(served):
    server, keys, _ = served
    base = _answer(server, server.key, BASE)
    zero = _answer(server, keys["alice"], "zero")
    tuned = _answer(server, keys["alice"], "tune0")
    again = _answer(server, keys["alice"], "tune0")
    print(f"\nbase {base!r}\nzero {zero!r}\ntune0 {tuned!r}")
    assert "Paris" in base
    assert zero == base
    assert tuned != base and again == tuned
    first = _first_token_s(server, keys["bob"], "tune2")  # an adapter never asked before, its base warm
    print(f"an adapter's first request on the warm base: first token after {first:.2f} s")
    assert [i for i in _ready_instances(server) if i[1] != "demo/smollm2"] == [("cpu-0", BASE)]  # no load for it
    listed = {m.id for m in server.client(keys["alice"]).models.list().data}
    assert {"zero", "tune0", "tune3"} <= listed and "tune0" in {m.id for m in server.client(keys["bob"]).models.list()}


def test_eight_adapters_of_two_tenants_are_served_from_one_base_instance(served):
    server, keys, _ = served
    asked = [(t, f"tune{i}") for t in ("alice", "bob") for i in range(4)]
    alone = {a: _answer(server, keys[a[0]], a[1]) for a in asked}
    assert len(set(alone.values())) > 1  # the adapters differ
    with ThreadPoolExecutor(len(asked) * 2) as pool:  # all at once, twice each
        together = list(pool.map(lambda a: (a, _answer(server, keys[a[0]], a[1])), asked * 2))
    for a, text in together:
        assert text == alone[a], (a, text, alone[a])
    ready = _ready_instances(server)  # --demo keeps its GGUF model warm beside
    assert [i for i in ready if i[1] != "demo/smollm2"] == [("cpu-0", BASE)]  # one instance: the base's weights once
    usage = server.http("GET", "/v1/usage", token=keys["bob"])[1]
    assert {m["model"] for m in usage["data"]} >= {"tune0", "tune3"}, usage  # counted under bob's adapters


@pytest.mark.parametrize("body, status, code, says", [
    ({"base": "nope", "base_tenant": "demo", "path": "alice/tune0"}, 400, "base_not_found", "No base model 'nope'"),
    ({"base": "demo/smollm2", "base_tenant": "demo", "path": "alice/tune0"}, 400, "unsupported_base", "GGUF"),
    ({"base": BASE, "base_tenant": "demo", "path": "alice/missing"}, 404, "model_source_not_found", ""),
    ({"base": BASE, "base_tenant": "demo", "path": "alice/not-peft"}, 400, "invalid_adapter",
     "no adapter_config.json"),
    ({"base": BASE, "base_tenant": "demo", "path": "alice/wrong-rank"}, 400, "invalid_adapter",
     "the base and r=16 need [16, 576]"),
])
def test_bad_adapter_registrations_say_what_is_wrong(served, body, status, code, says):
    server, keys, allowed = served
    (allowed / "alice" / "not-peft").mkdir(exist_ok=True)
    (allowed / "alice" / "not-peft" / "model.bin").write_bytes(b"\0" * 64)
    wrong = allowed / "alice" / "wrong-rank"
    if not wrong.exists():
        shutil.copytree(allowed / "alice" / "tune0", wrong)
        (wrong / CONFIG).write_text('{"peft_type": "LORA", "r": 16, "lora_alpha": 16}')
    got, answer = server.http("POST", "/admin/tenants/alice/models", {"name": "bad", **body}, token=ADMIN)
    assert got == status and answer["error"]["code"] == code and says in answer["error"]["message"], answer


def test_a_tenant_may_not_take_another_tenants_model_as_its_base(served):
    server, keys, _ = served
    got, answer = server.http("POST", "/v1/models", {"name": "mine", "base": BASE, "base_tenant": "demo",
                                                     "path": "tune0"}, token=keys["alice"])
    assert got == 403 and answer["error"]["param"] == "base_tenant", answer
    got, answer = server.http("POST", "/v1/models", {"name": "mine", "base": "nope", "path": "tune0"},
                              token=keys["alice"])
    assert got == 400 and answer["error"]["code"] == "base_not_found", answer



def test_a_deleted_adapter_is_gone_and_its_base_stays(served):
    server, keys, _ = served
    assert server.http("GET", "/v1/models/tune3", token=keys["bob"])[1]["mesh"]["kind"] == "lora"
    status, body = server.http("DELETE", "/v1/models/tune3", token=keys["bob"])
    assert status == 200 and body["deleted"] is True, body
    with pytest.raises(openai.NotFoundError):
        _answer(server, keys["bob"], "tune3")
    assert "tune3" not in {m.id for m in server.client(keys["bob"]).models.list().data}
    assert _answer(server, keys["bob"], "tune2")  # the base and the other adapters serve on
    assert ("cpu-0", BASE) in _ready_instances(server)
