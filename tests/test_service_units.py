"""Fast unit tests of the service's parts: registry, key hashing, path checks, error format,
request parsing, config, agent protocol framing, adaptive iteration times."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import struct

import pytest

from mesh.engines.engine_api import Sampling
from mesh.modelfiles.sources import TENANT_NOT_FOUND, SourceError, SourceNotFound, inspect_source, resolve_allowed
from mesh.perf.times import AdaptiveTimes, DefaultCpuTimes
from mesh.policy.batching import IterationKind
from mesh.policy.slo import SLO
from mesh.service import errors
from mesh.service.auth import admin_token_ok, bearer_token, hash_key, new_api_key
from mesh.service.config import ConfigError, build_config, read_config_file
from mesh.service.registry import ModelRecord, Registry, RegistryError, new_model_uid
from mesh.service.schema import parse_chat, parse_completion, parse_json
from mesh.service.uploads import receive_upload
from mesh.wire.agent_protocol import (
    MAX_FRAME_BYTES,
    Code,
    FrameDecoder,
    InstanceSpec,
    ProtocolError,
    encode_frame,
    read_frame,
    sampling_from_dict,
    sampling_to_dict,
)

# ---- registry -------------------------------------------------------------------------------


def _model(tenant: str, name: str = "m") -> ModelRecord:
    return ModelRecord(new_model_uid(), tenant, name, "gguf", "/x/m.gguf", 2048, SLO(3.0, 0.001, 0.5), 123)


def test_registry_tenants_keys_models_and_persistence(tmp_path):
    reg = Registry(tmp_path / "r.sqlite3")
    reg.create_tenant("acme")
    with pytest.raises(RegistryError, match="already exists"):
        reg.create_tenant("acme")
    with pytest.raises(RegistryError):
        reg.create_tenant("Bad Name")
    key = new_api_key()
    info = reg.add_key("acme", key.key_hash, key.display, "ci")
    assert reg.tenant_for_key_hash(hash_key(key.key)) == "acme"
    stored = reg.add_model(_model("acme", "team/llama"))
    assert stored.slo == SLO(3.0, 0.001, 0.5) and stored.created_at > 1_600_000_000
    with pytest.raises(RegistryError, match="already exists"):
        reg.add_model(_model("acme", "team/llama"))
    reg.close()

    reg = Registry(tmp_path / "r.sqlite3")  # a restart keeps everything
    assert [t.name for t in reg.tenants()] == ["acme"]
    assert reg.model("acme", "team/llama").uid == stored.uid
    assert reg.tenant_for_key_hash(hash_key(key.key)) == "acme"
    reg.revoke_key(info.id)
    assert reg.tenant_for_key_hash(hash_key(key.key)) is None
    assert reg.keys("acme")[0].revoked_at is not None
    # the raw key is nowhere in the database file
    reg.close()
    assert key.key.encode() not in (tmp_path / "r.sqlite3").read_bytes()


def test_registry_isolation_and_cascade(tmp_path):
    reg = Registry(tmp_path / "r.sqlite3")
    for t in ("a", "b"):
        reg.create_tenant(t)
    reg.add_model(_model("a", "same"))
    reg.add_model(_model("b", "same"))  # the same name in two tenants is fine
    assert reg.model("a", "same").uid != reg.model("b", "same").uid
    assert reg.model("a", "only-b") is None
    key = new_api_key()
    reg.add_key("a", key.key_hash, key.display)
    deleted = reg.delete_tenant("a")
    assert [m.name for m in deleted] == ["same"]
    assert reg.models("a") == [] and reg.tenant_for_key_hash(key.key_hash) is None
    assert reg.model("b", "same") is not None
    with pytest.raises(RegistryError):
        reg.add_model(_model("a", "x"))  # tenant gone
    with pytest.raises(RegistryError):
        reg.add_model(_model("b", "../escape"))


# ---- auth -------------------------------------------------------------------------------------


def test_api_keys_are_random_and_hashed():
    a, b = new_api_key(), new_api_key()
    assert a.key != b.key and a.key.startswith("mesh-") and len(a.key) == 5 + 43
    assert a.key_hash == hashlib.sha256(a.key.encode()).hexdigest()
    assert a.display == a.key[:12] and a.key_hash != b.key_hash


def test_bearer_and_admin_token():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None and bearer_token(None) is None
    assert admin_token_ok("T", "T") and not admin_token_ok("T", "U")
    assert not admin_token_ok("T", None) and not admin_token_ok(None, "T") and not admin_token_ok("", "")


# ---- model sources --------------------------------------------------------------------------------


def test_paths_must_stay_in_the_allowed_folder(tmp_path):
    root = tmp_path / "allowed"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "m.gguf").write_bytes(b"GGUF....")
    outside = tmp_path / "secret.gguf"
    outside.write_bytes(b"GGUF....")
    assert resolve_allowed(root, "sub/m.gguf") == (root / "sub" / "m.gguf").resolve()
    assert resolve_allowed(root, str(root / "sub" / "m.gguf")) == (root / "sub" / "m.gguf").resolve()
    for bad in ("../secret.gguf", "sub/../../secret.gguf", str(outside), "/etc/passwd", "", "sub/\x00"):
        with pytest.raises(SourceError):
            resolve_allowed(root, bad)
    os.symlink(outside, root / "link.gguf")
    with pytest.raises(SourceError, match="inside"):
        resolve_allowed(root, "link.gguf")
    os.symlink(tmp_path, root / "sub" / "up")
    with pytest.raises(SourceError, match="link"):
        resolve_allowed(root, "sub")  # a folder holding a link out
    with pytest.raises(SourceError, match="no paths"):
        resolve_allowed(None, "sub/m.gguf")
    with pytest.raises(SourceError, match="does not exist"):
        resolve_allowed(root, "nope.gguf")



def test_tenants_register_paths_only_in_their_own_folder(tmp_path):
    """A tenant's paths are relative to (and confined to) <allowed>/<tenant>/; whatever the
    reason a path is refused there, the error is the one text a missing file gets."""
    root = tmp_path / "allowed"
    for tenant in ("a", "b"):
        (root / tenant / "dir").mkdir(parents=True)
        (root / tenant / "m.gguf").write_bytes(b"GGUF....")
    (root / "shared.gguf").write_bytes(b"GGUF....")
    os.symlink(root / "a" / "m.gguf", root / "b" / "to-a.gguf")  # inside the allowed folder, not b's
    os.symlink(root / "a", root / "b" / "dir" / "a-folder")  # b's folder holds a link into a's
    assert resolve_allowed(root, "m.gguf", "a") == (root / "a" / "m.gguf").resolve()
    assert resolve_allowed(root, str(root / "b" / "m.gguf"), "b") == (root / "b" / "m.gguf").resolve()
    assert resolve_allowed(root, "a/m.gguf") == (root / "a" / "m.gguf").resolve()  # the operator: anywhere
    messages = set()
    for given in ("missing.gguf", "../a/m.gguf", str(root / "a" / "m.gguf"), "to-a.gguf", "dir", ".",
                  "/etc/passwd", str(root / "shared.gguf"), "a/m.gguf"):
        with pytest.raises(SourceNotFound) as err:
            resolve_allowed(root, given, "b")
        messages.add(str(err.value))
    assert messages == {TENANT_NOT_FOUND}
    with pytest.raises(SourceNotFound) as err:  # a tenant without a folder
        resolve_allowed(root, "m.gguf", "c")
    assert str(err.value) == TENANT_NOT_FOUND
    os.symlink(root, root / "d")  # a tenant's folder that is the allowed folder itself
    with pytest.raises(SourceNotFound):
        resolve_allowed(root, "shared.gguf", "d")

def test_inspect_source_kinds(tmp_path):
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"NOTGGUF")
    with pytest.raises(SourceError, match="GGUF"):
        inspect_source(bad)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    with pytest.raises(SourceError, match="no weights"):
        inspect_source(hf)
    (hf / "model.safetensors").write_bytes(b"x" * 10)
    info = inspect_source(hf)
    assert (info.kind, info.context_length, info.weight_bytes) == ("hf", 2048, 10)
    ir = tmp_path / "ir"
    ir.mkdir()
    (ir / "openvino_model.xml").write_text("<xml/>")
    with pytest.raises(SourceError, match="lacks"):
        inspect_source(ir)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SourceError, match="neither"):
        inspect_source(empty)


async def _chunks(*parts: bytes):
    for p in parts:
        yield p


def test_upload_limit_checksum_and_format(tmp_path):
    data = b"GGUF" + b"x" * 100
    digest = hashlib.sha256(data).hexdigest()
    target = tmp_path / "up" / "m.gguf"
    assert asyncio.run(receive_upload(_chunks(data[:50], data[50:]), target, 1000, digest)) == len(data)
    assert target.read_bytes() == data
    with pytest.raises(errors.ApiError) as e:
        asyncio.run(receive_upload(_chunks(data), tmp_path / "a.gguf", 50, digest))
    assert e.value.status == 413
    with pytest.raises(errors.ApiError) as e:
        asyncio.run(receive_upload(_chunks(data), tmp_path / "b.gguf", 1000, "0" * 64))
    assert e.value.status == 400 and e.value.code == "checksum_mismatch"
    other = b"ZZZZ" + b"x" * 10
    with pytest.raises(errors.ApiError, match="GGUF"):
        asyncio.run(receive_upload(_chunks(other), tmp_path / "c.gguf", 1000, hashlib.sha256(other).hexdigest()))
    with pytest.raises(errors.ApiError, match="sha256"):
        asyncio.run(receive_upload(_chunks(data), tmp_path / "d.gguf", 1000, "nothex"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up"]  # nothing left behind
    assert [p.name for p in (tmp_path / "up").iterdir()] == ["m.gguf"]


# ---- errors -------------------------------------------------------------------------------------


def test_error_format_and_statuses():
    e = errors.model_not_found("x")
    assert e.status == 404 and set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert "does not exist or you do not have access" in e.message
    assert errors.overloaded("r").status == 429 and errors.overloaded("r").headers["Retry-After"] == "1"
    turned = errors.overloaded("cannot meet its SLO: x", 2.2, "reject")
    assert turned.headers["Retry-After"] == "3"
    assert "admission is 'reject'" in turned.message and "3 s" in turned.message
    # every 429 says when to retry, those built without a Retry-After included
    assert errors.over_quota("concurrent_requests", "Over.", 429).response().headers["Retry-After"] == "1"
    assert errors.node_unavailable("x").status == 503
    assert errors.context_too_long(10, 8, "prompt").code == "context_length_exceeded"
    assert errors.too_large(2**20).status == 413
    assert json.loads(e.sse()[len(b"data: "):])["error"]["code"] == "model_not_found"
    from aiohttp import web

    assert errors.from_http_exception(web.HTTPRequestEntityTooLarge(max_size=1, actual_size=2)).status == 413
    assert errors.from_http_exception(web.HTTPNotFound()).code == "not_found"
    assert errors.from_http_exception(web.HTTPMethodNotAllowed("GET", ["POST"])).status == 405


# ---- request parsing ----------------------------------------------------------------------------


def _status(fn, *args) -> tuple[int, str | None]:
    try:
        fn(*args)
    except errors.ApiError as e:
        return e.status, e.param
    return 200, None


def test_parse_chat_and_completion():
    r = parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                    "max_tokens": 5, "temperature": 0, "top_p": 0.5, "stop": "x", "seed": 3, "stream": True,
                    "stream_options": {"include_usage": True}, "user": "ignored"})
    assert r.messages == [{"role": "user", "content": "hi"}] and r.max_tokens == 5 and r.stop == ("x",)
    assert r.temperature == 0.0 and r.seed == 3 and r.stream and r.include_usage
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}],
                       "max_completion_tokens": 7}).max_tokens == 7
    c = parse_completion({"model": "m", "prompt": ["once"]})
    assert c.prompt == "once" and c.max_tokens is None and c.temperature is None and c.top_p is None  # model defaults
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt_token_ids == [1, 2, 3]
    assert parse_completion({"model": "m", "prompt": [[4, 5]]}).prompt_token_ids == [4, 5]
    # what load generators send (guidellm, vLLM's benchmarks): min_tokens where ignore_eos guarantees it
    g = parse_completion({"model": "m", "prompt": "a", "max_tokens": 64, "ignore_eos": True, "min_tokens": 64,
                          "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                          "n": 1, "seed": 0, "response_format": {"type": "text"}, "user": "u1"})
    assert g.ignore_eos and g.max_tokens == 64 and g.include_usage
    # logprobs (each chosen token's), penalties and n choices
    p = parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 0,
                    "presence_penalty": 1, "frequency_penalty": -0.5, "repetition_penalty": 1.3, "n": 3})
    assert p.logprobs and p.n == 3
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1.0, -0.5, 1.3)
    q = parse_completion({"model": "m", "prompt": "a", "logprobs": 0})
    assert q.logprobs and q.n == 1 and q.repetition_penalty == 1.0
    assert not parse_completion({"model": "m", "prompt": "a"}).logprobs
    # alternatives: a chat's top_logprobs, a completion's logprobs count (vLLM nodes serve them)
    t = parse_chat({**CHAT, "logprobs": True, "top_logprobs": 20})
    assert (t.logprobs, t.top_logprobs) == (True, 20) and p.top_logprobs == 0
    assert (q.logprobs, q.top_logprobs) == (True, 0)
    c5 = parse_completion({"model": "m", "prompt": "a", "logprobs": 5})
    assert (c5.logprobs, c5.top_logprobs) == (True, 5)
    assert not parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}], "logprobs": False}).logprobs
    # structured output: the schema's compact JSON; json_object is any object; text is none
    person = {"type": "object", "title": "P", "properties": {"name": {"type": "string", "maxLength": 20},
              "age": {"type": ["integer", "null"], "minimum": 0},
              "tags": {"type": "array", "items": {"enum": ["a", 1]}}},
              "required": ["name"], "additionalProperties": False}
    j = parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}],
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "P", "schema": person, "strict": True}}})
    assert json.loads(j.json_schema) == person
    assert parse_completion({"model": "m", "prompt": "a", "response_format": {"type": "json_object"}}).json_schema == \
        '{"type": "object"}'
    assert parse_completion({"model": "m", "prompt": "a", "response_format": {"type": "text"}}).json_schema is None


CHAT = {"model": "m", "messages": [{"role": "user", "content": "a"}]}


def schema(s: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": s}}}


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "a"}]}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "a"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": "5"}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "temperature": 3}, "temperature"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**CHAT, "stop": [1]}, "stop"),
    ({**CHAT, "seed": -1}, "seed"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "n": 17}, "n"),
    ({**CHAT, "n": 1.5}, "n"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "logprobs": 1}, "logprobs"),
    ({**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ({**CHAT, "frequency_penalty": "x"}, "frequency_penalty"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({**CHAT, "repetition_penalty": 11}, "repetition_penalty"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0]"),
    ({**CHAT, "top_logprobs": 0}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ({**CHAT, **schema({"type": "foo"})}, "response_format"),
    ({**CHAT, **schema({"$ref": "#/x"})}, "response_format"),
    ({**CHAT, **schema({"type": "string", "pattern": "a+"})}, "response_format"),
    ({**CHAT, **schema({
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]})}, "response_format"),
    ({**CHAT, **schema({
        "type": "array", "items": {"anyOf": [{"minLength": -1}]}})}, "response_format"),
    ({**CHAT, "min_tokens": 5}, "min_tokens"),
    ({**CHAT, "min_tokens": 9, "max_tokens": 8,
      "ignore_eos": True}, "min_tokens"),
    ({**CHAT, "min_tokens": "5"}, "min_tokens"),
    ({**CHAT, "user": 7}, "user"),
])
def test_parse_chat_rejects_bad_fields(body, param):
    assert _status(parse_chat, body) == (400, param)


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": [-1]}, "prompt"),
    ({"model": "m", "prompt": {"x": 1}}, "prompt"),
    ({"model": "m", "prompt": "a", "echo": True}, "echo"),
    ({"model": "m", "prompt": "a", "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "a", "logprobs": 6}, "logprobs"),
    ({"model": "m", "prompt": "a", "logprobs": True}, "logprobs"),
])
def test_parse_completion_rejects_bad_fields(body, param):
    assert _status(parse_completion, body) == (400, param)


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b"\xff\xfe", b"null", b'"text"', b'{"prompt": "\\ud800"}'])
def test_parse_json_rejects_non_objects(raw):
    with pytest.raises(errors.ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json"


# ---- config -------------------------------------------------------------------------------------


def test_config_file_env_and_cli(tmp_path, monkeypatch):
    monkeypatch.delenv("MESH_ADMIN_TOKEN", raising=False)
    f = tmp_path / "mesh.toml"
    f.write_text('admin_token = "from-file"\nport = 9000\nkeep_alive_s = 5\n')
    c = build_config(read_config_file(f), {"port": 9100, "host": None})
    assert (c.admin_token, c.port, c.keep_alive_s, c.host) == ("from-file", 9100, 5, "127.0.0.1")
    monkeypatch.setenv("MESH_ADMIN_TOKEN", "from-env")
    assert build_config(read_config_file(f), {}).admin_token == "from-env"
    (tmp_path / "bad.toml").write_text("nonsense = 1\n")
    with pytest.raises(ConfigError, match="unknown settings"):
        read_config_file(tmp_path / "bad.toml")
    (tmp_path / "c.json").write_text("{oops")
    with pytest.raises(ConfigError, match="JSON"):
        read_config_file(tmp_path / "c.json")
    with pytest.raises(ConfigError, match="max_body_mb"):
        build_config({}, {"max_body_mb": -1})
    assert build_config({}, {}).deadlines == "eq1"
    assert build_config({}, {}).exact_moves is False and build_config({"exact_moves": True}, {}).exact_moves
    with pytest.raises(ConfigError, match="exact_moves must be true or false"):
        build_config({"exact_moves": "yes"}, {})
    assert build_config({"deadlines": "PACE"}, {}).deadlines == "pace"
    with pytest.raises(ConfigError, match="deadlines: unknown deadline rule 'soon'; valid: eq1, pace"):
        build_config({"deadlines": "soon"}, {})
    with pytest.raises(ConfigError, match="allowed_dir"):
        build_config({}, {"allowed_dir": str(tmp_path / "missing")})


def test_config_of_nodes_plans_and_remote_agents(tmp_path):
    f = tmp_path / "mesh.toml"
    f.write_text('cpu_nodes = 2\nweights_plan = "chain"\nremote_agents = ["cpu-7=10.0.0.7:7000"]\n')
    c = build_config(read_config_file(f), {})
    assert (c.cpu_nodes, c.weights_plan, c.remote_agents) == (2, "chain", ["cpu-7=10.0.0.7:7000"])
    with pytest.raises(ConfigError, match="cpu_nodes must be an integer from 1 to 64"):
        build_config({}, {"cpu_nodes": 0})
    with pytest.raises(ConfigError, match="weights_plan must be naive, chain or binomial"):
        build_config({}, {"weights_plan": "star"})
    with pytest.raises(ConfigError, match=r"ID=HOST:PORT \(e.g. cpu-7=10.0.0.7:7000\), got 'cpu-7'"):
        build_config({}, {"remote_agents": ["cpu-7"]})
    with pytest.raises(ConfigError, match="must be unique and differ from the local nodes cpu-0..cpu-1: cpu-1, r"):
        build_config({}, {"cpu_nodes": 2, "remote_agents": ["cpu-1=h:1", "r=h:2", "r=h:3"]})


# ---- agent protocol framing --------------------------------------------------------------------------


def test_frames_roundtrip_in_arbitrary_pieces():
    messages = [{"t": "tokens", "items": [["r1", [1, 2], "héllo"]]}, {"t": "ping", "id": 7}]
    data = b"".join(encode_frame(m) for m in messages)
    assert struct.unpack(">I", data[:4])[0] == len(json.dumps(messages[0], separators=(",", ":"),
                                                              ensure_ascii=False).encode())
    dec = FrameDecoder()
    out = []
    for i in range(0, len(data), 3):
        out += dec.feed(data[i:i + 3])
    assert out == messages


def test_frame_errors():
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(struct.pack(">I", MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(struct.pack(">I", 2) + b"[]")  # not an object with a type
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(struct.pack(">I", 3) + b"{x}")

    async def read(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader)

    assert asyncio.run(read(b"")) is None  # clean EOF
    assert asyncio.run(read(encode_frame({"t": "ping"}))) == {"t": "ping"}
    with pytest.raises(ProtocolError, match="inside a frame"):
        asyncio.run(read(encode_frame({"t": "ping"})[:-1]))
    with pytest.raises(ProtocolError, match="header"):
        asyncio.run(read(b"\x00\x00"))


def test_payload_helpers():
    s = Sampling(max_tokens=5, temperature=0.5, top_p=0.9, stop=("a",), seed=4)
    assert sampling_from_dict(sampling_to_dict(s)) == s
    with pytest.raises(ProtocolError):
        sampling_from_dict({"temperature": 1})
    spec = InstanceSpec("i1", "m_1", "/p.gguf", 1024)
    assert InstanceSpec.from_message(spec.to_message()) == spec
    with pytest.raises(ProtocolError):
        InstanceSpec.from_message({"t": "load", "instance_id": "x"})
    assert Code.REFUSED.retryable and Code.BATCH_FULL.retryable and not Code.BAD_REQUEST.retryable


def test_adaptive_times_learn_and_clamp():
    t = AdaptiveTimes(DefaultCpuTimes(), alpha=0.5, prefill_alpha=0.5)
    base = DefaultCpuTimes().decode_s(8, 100)
    for _ in range(30):
        t.observe(IterationKind.DECODE, t.decode_s(8, 100), 2 * base)
    assert t.decode_s(8, 100) == pytest.approx(2 * base, rel=1e-3)
    assert t.prefill_factor == 1.0
    for _ in range(100):
        t.observe(IterationKind.PREFILL, 1.0, 1000.0)
    assert t.prefill_factor == t.max_factor
    t.observe(IterationKind.PREFILL, 0.0, 1.0)  # ignored
    fresh = AdaptiveTimes(DefaultCpuTimes(), prefill_alpha=0.4)
    fresh.observe(IterationKind.PREFILL, 0.1, 5.0, tokens=300)  # one iteration that compiled a shape: 50x
    assert fresh.prefill_factor == pytest.approx(2.0 ** 0.4) and fresh.prefill_regions[8] == pytest.approx(2.0 ** 0.4)
    assert DefaultCpuTimes.for_weights(10 * 98_362_432).scale == pytest.approx(10)


def test_adaptive_times_refine_per_grid_region_and_learn_a_bounded_margin():
    t = AdaptiveTimes(DefaultCpuTimes(), alpha=0.5, prefill_alpha=0.5, margin_after=10)
    base = DefaultCpuTimes()
    for _ in range(30):  # decodes at batch 8, context ~100 run 1.5x the model; elsewhere unknown
        t.observe(IterationKind.DECODE, t.decode_s(8, 100), 1.5 * base.decode_s(8, 100), batch=8, tokens=100)
    assert t.decode_s(8, 100) == pytest.approx(1.5 * base.decode_s(8, 100), rel=1e-3)
    assert t.decode_s(9, 120) == pytest.approx(1.5 * base.decode_s(9, 120), rel=1e-3)  # same cell (8-15 x 64-127)
    for _ in range(30):  # batch 1 at context 1000 runs as modelled: its own region stays near 1
        t.observe(IterationKind.DECODE, t.decode_s(1, 1000), base.decode_s(1, 1000), batch=1, tokens=1000)
    assert t.decode_s(1, 1000) == pytest.approx(base.decode_s(1, 1000), rel=1e-3)
    assert t.decode_s(8, 100) == pytest.approx(1.5 * base.decode_s(8, 100), rel=1e-3)  # not dragged back
    drift = t.drift()
    assert drift["regions"] == 2 and drift["decode_regions"]["8x64"] == pytest.approx(1.5, rel=1e-3)
    assert drift["max_drift"] == pytest.approx(0.5, rel=1e-2)
    # the margin: the 95th percentile of live/predicted - 1 once learnt, bounded
    assert AdaptiveTimes(base).margin is None  # not learnt yet: the node's 10% applies
    m = AdaptiveTimes(base, margin_after=10)
    for k in range(96):  # recomputed every 8 iterations: 96 includes them all
        m.observe(IterationKind.DECODE, 1.0, 1.0 + 0.002 * k)  # ratios 1.0 .. 1.19
    assert m.margin == pytest.approx(0.1805, abs=0.002)
    for _ in range(300):
        m.observe(IterationKind.DECODE, 1.0, 3.0)
    assert m.margin == m.max_margin
    for _ in range(300):
        m.observe(IterationKind.DECODE, 1.0, 0.9)
    assert m.margin == m.min_margin


def test_sampling_defaults_from_models_and_requests(tmp_path):
    from mesh.modelfiles import sampling as sd

    assert sd.from_gguf_metadata({"general.sampling.temp": 0.6, "general.sampling.top_p": 0.95,
                                  "general.sampling.top_k": 20}) == {"temperature": 0.6, "top_p": pytest.approx(0.95)}
    assert sd.from_gguf_metadata({"general.sampling.temp": 9.0, "general.name": "x"}) == {}  # out of range: ignored
    folder = tmp_path / "hf"
    folder.mkdir()
    assert sd.from_generation_config(folder) == {}
    (folder / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 5}')
    assert sd.from_generation_config(folder) == {"temperature": 0.7, "top_p": 0.8}
    (folder / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.7}')
    assert sd.from_generation_config(folder) == {"temperature": 0.0}
    (folder / "generation_config.json").write_text("not json")
    assert sd.from_generation_config(folder) == {}
    assert sd.resolve(None, None, {"temperature": 0.2, "top_p": 0.9}) == (0.2, 0.9)
    assert sd.resolve(0.0, None, {"temperature": 0.2}) == (0.0, 1.0)  # the request wins; OpenAI's top_p
    assert sd.resolve(None, None, None) == (1.0, 1.0)
    with pytest.raises(sd.SamplingDefaultsError, match="top_p"):
        sd.check({"top_p": 0})
    with pytest.raises(sd.SamplingDefaultsError, match="unknown"):
        sd.check({"min_p": 0.1})


def test_demo_gguf_has_no_sampling_metadata_and_the_registry_keeps_defaults(tmp_path, demo_gguf):
    from mesh.modelfiles.sources import inspect_source

    assert inspect_source(demo_gguf).sampling_defaults == {}  # hence the demo's documented defaults
    reg = Registry(tmp_path / "r.sqlite3")
    reg.create_tenant("t")
    reg.add_model(ModelRecord("m_1", "t", "m", "gguf", "/x", 512, SLO(), sampling_defaults={"temperature": 0.2}))
    assert reg.model("t", "m").sampling_defaults == {"temperature": 0.2}
    reg.close()
    assert Registry(tmp_path / "r.sqlite3").model("t", "m").sampling_defaults == {"temperature": 0.2}


def test_a_schema_1_registry_is_upgraded(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE tenants (name TEXT PRIMARY KEY, created_at INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE models (uid TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL, kind TEXT NOT NULL,
            path TEXT NOT NULL, owned_file INTEGER NOT NULL DEFAULT 0, sha256 TEXT,
            weight_bytes INTEGER NOT NULL DEFAULT 0, context_length INTEGER NOT NULL, ttft_min_s REAL NOT NULL,
            ttft_s_per_prompt_token REAL NOT NULL, tpot_s REAL NOT NULL, created_at INTEGER NOT NULL DEFAULT 0,
            UNIQUE (tenant, name));
        INSERT INTO tenants (name) VALUES ('t');
        INSERT INTO models VALUES ('m_1', 't', 'm', 'gguf', '/x', 0, NULL, 7, 512, 2.0, 0.001, 0.25, 0);
    """)
    db.commit()
    db.close()
    reg = Registry(path)
    assert reg.model("t", "m").sampling_defaults == {} and reg.usage("t") == (1, 7)
    reg.set_quota_settings("t", {"models": 2})
    assert reg.quota_settings("t") == {"models": 2}
