"""The agent protocol's frames are fixed: a sample of every message, encoded, is byte for
byte the frame the protocol's hand-written codec wrote (tests/data/agent_frames.json,
captured from it), and sample frames, valid and malformed, read back as they did then (the
same message, or a ProtocolError from the same message's decoder)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mesh.engines.engine_api import Sampling
from mesh.policy.slo import SLO
from mesh.wire import agent_protocol as ap

GOLDEN = Path(__file__).parent / "data" / "agent_frames.json"

PROBE = ap.Probe("r1", 12, 8, 0.5, 2, 0.25, 1.5)
ENTRY = ap.AdmitEntry("r1", "i1", [5, 6, 7, 8], Sampling(max_tokens=4, temperature=0.5, stop=("x",), seed=3,
                                                         logprobs=True, json_schema="{}"), 0.25, 2, 2, False, 0.1, 2.0)
PLAN = ap.NewInstance("i2", "m", 1000, 10, 512, 64, SLO(), 3.5, "p.json", (100.0, 3, 250.0))
PROGRESS = ap.Progress("r1", 3, [1, 2, 3], 0.5)

# Every message type, with its optional fields given and left out.
SAMPLES: dict[str, Any] = {
    "hello": ap.Hello("tok"),
    "hello_none": ap.Hello(None, None),
    "ping": ap.Ping(),
    "stats": ap.Stats(),
    "shutdown": ap.Shutdown(),
    "load": ap.InstanceSpec("i1", "m", "/p/m.gguf"),
    "load_full": ap.InstanceSpec("i1", "m", "/p/m.gguf", 2048, ap.slo_to_dict(SLO(1.0, 0.01, 0.2)), 8, "prof.json",
                                 "vllm", 4.5, True, (120.0, 4, 480.0), 2.5),
    "unload": ap.Unload("i1"),
    "tokenize": ap.Tokenize(instance_id="i", prompt="hi", request_id="r", tenant="t"),
    "tokenize_path": ap.Tokenize(model="m", path="/p", engine="openvino", context_window=512,
                                 messages=[{"role": "user", "content": "hi"}]),
    "describe": ap.Describe("u", "/p"),
    "describe_full": ap.Describe("u", "/p", "vllm", 512, 8, True),
    "admit": ap.Admit([ENTRY, ap.AdmitEntry("r2", "i1", [1], Sampling(max_tokens=1), 0.0, prompt_len=1)]),
    "validate": ap.Validate("i1", PROBE, ["i2", "i3"]),
    "validate_plain": ap.Validate("i1", ap.Probe("r", 1, 1, 0.0)),
    "validate_group": ap.ValidateGroup("i1", [PROBE, PROBE]),
    "validate_new": ap.ValidateNew(PLAN, [PROBE]),
    "validate_new_plain": ap.ValidateNew(ap.NewInstance("i2", "m", 1, 1, 1, 1, SLO(), 0.0), []),
    "take_back": ap.TakeBack("r1"),
    "abort": ap.Abort("r1"),
    "weights_path": ap.WeightsPath("org/m", "f.gguf", {"a": 1}),
    "weights_path_plain": ap.WeightsPath("org/m", "f.gguf"),
    "weights_drop": ap.WeightsDrop("org/m"),
    "forget": ap.Forget("org/m"),
    "ack": ap.Ack(),
    "failure": ap.FailureReply("memory", "short", 10),
    "failure_plain": ap.FailureReply("busy", "serving"),
    "hello_reply": ap.HelloReply("cpu-0", "cpu", 10**9, {"model": "x", "cores": 2}, 42, 1, "eq1", None, None, []),
    "hello_reply_full": ap.HelloReply("cpu-0", "cpu", 10**9, {}, 42, 1, "pace", "a100", {"address": "h:1", "dir": "/d"},
                                      [{"instance_id": "i1"}]),
    "load_reply": ap.LoadReply(100, 10, 2048),
    "describe_reply": ap.DescribeReply(100, 10, 2048, None),
    "describe_reply_full": ap.DescribeReply(100, 10, 2048, 32000, {"prefill": {}}),
    "tokenize_reply": ap.TokenizeReply([1, 2, 3]),
    "admit_reply": ap.AdmitReply([ap.AdmitResult(True), ap.AdmitResult(False, "refused", "full")]),
    "verdict": ap.ValidationReply(False, "too slow"),
    "progress": PROGRESS,
    "stats_reply": ap.StatsReply("cpu-0", "cpu", 12.5, [{"i": 1}], {"budget": 1}, 2, 1, {"q": 0}, ["m"], 3.5, 7, 100,
                                 "eq1", {}, {}, {}, None),
    "weights_path_reply": ap.WeightsPathReply("/d/f.gguf", True),
    "weights_path_reply_plain": ap.WeightsPathReply("/d/f.gguf"),
    "weights_drop_reply": ap.WeightsDropReply(True),
    "forget_reply": ap.ForgetReply("org/m"),
    "tokens": ap.TokensEvent([("r1", [1, 2], "ab"), ("r2", [3], "c", [-0.5])]),
    "tokens_top": ap.TokensEvent([("r3", [4, 5], "de", [-0.5, -1.0], [[("d", -0.5), ("x", -2.0)], [("e", -1.0)]])]),
    "done": ap.DoneEvent("r1", "completed", "stop", "", 5, 0.1, 0.02),
    "done_failed": ap.DoneEvent("r1", "failed", None, "engine error", 0, None, None),
    "instance": ap.InstanceEvent("i1", "ready"),
    "instance_ready": ap.InstanceEvent("i1", "ready", loaded_from="gguf"),
    "instance_failed": ap.InstanceEvent("i1", "failed", error="boom"),
    "evicted": ap.EvictedEvent("memory", PROGRESS),
    "evicted_fault": ap.EvictedEvent("hung", PROGRESS, True),
    "node": ap.NodeEvent("i1", 1000),
    "node_idle": ap.NodeEvent(None, 0),
}

# Frames as a receiver may get them: valid ones with fields left out, and malformed ones.
# (kind, frame): kind names a reply type for a reply's fields, else the frame is a request or an event.
RECEIVED: dict[str, tuple[str, dict[str, Any]]] = {
    "load_minimal": ("", {"t": "load", "instance_id": "i", "model": "m", "path": "/p"}),
    "load_bad_batch": ("", {"t": "load", "instance_id": "i", "model": "m", "path": "/p", "max_num_seqs": 0}),
    "load_bad_slo": ("", {"t": "load", "instance_id": "i", "model": "m", "path": "/p", "slo": {"tpot_s": 1}}),
    "load_bad_profile": ("", {"t": "load", "instance_id": "i", "model": "m", "path": "/p", "profile": 3}),
    "load_no_path": ("", {"t": "load", "instance_id": "i", "model": "m"}),
    "hello_bare": ("", {"t": "hello"}),
    "hello_bad_token": ("", {"t": "hello", "token": 5}),
    "unload_missing": ("", {"t": "unload"}),
    "tokenize_nothing": ("", {"t": "tokenize", "prompt": "hi"}),
    "tokenize_bad_messages": ("", {"t": "tokenize", "path": "/p", "messages": ["x"]}),
    "describe_minimal": ("", {"t": "describe", "model": "m", "path": "/p"}),
    "describe_bad_window": ("", {"t": "describe", "model": "m", "path": "/p", "context_window": 0}),
    "admit_minimal": ("", {"t": "admit", "requests": [{"request_id": "r", "instance_id": "i",
                                                        "prompt_token_ids": [1, 2], "sampling": {"max_tokens": 3}}]}),
    "admit_moved": ("", {"t": "admit", "requests": [{"request_id": "r", "instance_id": "i",
                                                      "prompt_token_ids": [1, 2, 3], "done": 1, "age_s": -2,
                                                      "sampling": {"max_tokens": 3}}]}),
    "admit_bad_prompt_len": ("", {"t": "admit", "requests": [{"request_id": "r", "instance_id": "i",
                                                               "prompt_token_ids": [1], "prompt_len": 4,
                                                               "sampling": {"max_tokens": 3}}]}),
    "admit_bad_sampling": ("", {"t": "admit", "requests": [{"request_id": "r", "instance_id": "i",
                                                             "prompt_token_ids": [1], "sampling": {"top_p": 2}}]}),
    "admit_bad_stop": ("", {"t": "admit", "requests": [{"request_id": "r", "instance_id": "i", "prompt_token_ids": [1],
                                                         "sampling": {"max_tokens": 1, "stop": ["a"] * 20}}]}),
    "admit_not_a_list": ("", {"t": "admit", "requests": 3}),
    "validate_minimal": ("", {"t": "validate", "instance_id": "i", "request": {"request_id": "r", "prompt_len": 3,
                                                                               "max_tokens": 0}}),
    "validate_late": ("", {"t": "validate", "instance_id": "i", "request": {"request_id": "r", "prompt_len": 3,
                                                                            "max_tokens": 2, "late_s": -1}}),
    "validate_bad_age": ("", {"t": "validate", "instance_id": "i", "request": {"request_id": "r", "prompt_len": 3,
                                                                               "max_tokens": 2, "age_s": 1e9}}),
    "validate_group_bare": ("", {"t": "validate_group", "instance_id": "i"}),
    "validate_new_bad_plan": ("", {"t": "validate_new", "plan": {"instance_id": "i"}, "requests": []}),
    "take_back_minimal": ("", {"t": "take_back", "request_id": "r"}),
    "abort_bad": ("", {"t": "abort", "request_id": None}),
    "weights_path_bad_manifest": ("", {"t": "weights_path", "model": "m", "file": "f", "manifest": [1]}),
    "forget_empty": ("", {"t": "forget", "model": ""}),
    "unknown": ("", {"t": "nope"}),
    "tokens_bad_logprobs": ("", {"t": "tokens", "items": [["r", [1, 2], "ab", [-1.0]]]}),
    "tokens_bad_item": ("", {"t": "tokens", "items": [["r", "notalist", ""]]}),
    "tokens_bad_top": ("", {"t": "tokens", "items": [["r", [1], "a", [-1.0], [[["a", -1.0, 3]]]]]}),
    "admit_top_logprobs": ("", {"t": "admit", "requests": [{"request_id": "r", "instance_id": "i",
                                                             "prompt_token_ids": [1],
                                                             "sampling": {"max_tokens": 1, "logprobs": True,
                                                                          "top_logprobs": 5}}]}),
    "done_minimal": ("", {"t": "done", "request_id": "r"}),
    "done_missing": ("", {"t": "done"}),
    "instance_missing": ("", {"t": "instance", "state": "ready"}),
    "evicted_minimal": ("", {"t": "evicted", "request_id": "r", "tokens_out": 2, "token_ids": [4, 5]}),
    "evicted_bad": ("", {"t": "evicted", "why": "x", "token_ids": [1]}),
    "node_bad": ("", {"t": "node", "stepping": 3, "budget_bytes": 1}),
    "node_missing": ("", {"t": "node", "stepping": None}),
    "failure_with_shortfall": ("FailureReply", {"code": "memory", "error": "short", "shortfall_bytes": 5}),
    "failure_bad_shortfall": ("FailureReply", {"code": "memory", "error": "short", "shortfall_bytes": -5}),
    "hello_reply_minimal": ("HelloReply", {"node_id": "n", "kind": "cpu", "memory_bytes": 1, "cpu": {}, "pid": 1,
                                           "protocol": 1, "deadlines": "eq1", "instances": []}),
    "hello_reply_bad": ("HelloReply", {"node_id": "n"}),
    "load_reply_bad": ("LoadReply", {"weight_bytes": 1, "kv_bytes_per_token": 1, "context_window": 0}),
    "describe_reply_minimal": ("DescribeReply", {"weight_bytes": 1, "kv_bytes_per_token": 1, "context_window": 5}),
    "tokenize_reply_bad": ("TokenizeReply", {"ids": [-1]}),
    "admit_reply_minimal": ("AdmitReply", {"results": [{"ok": True}, {"ok": False}]}),
    "admit_reply_bad": ("AdmitReply", {"results": [{"ok": 1}]}),
    "verdict_no_reason": ("ValidationReply", {"admit": True}),
    "verdict_bad": ("ValidationReply", {"admit": "yes"}),
    "progress_bad": ("Progress", {"request_id": "r", "tokens_out": 1, "token_ids": [1], "first_token_age_s": "x"}),
    "stats_reply_bad": ("StatsReply", {"node_id": "n"}),
    "weights_path_reply_bad": ("WeightsPathReply", {"path": "p", "complete": "yes"}),
    "weights_drop_reply_bad": ("WeightsDropReply", {}),
    "forget_reply_bad": ("ForgetReply", {"forgot": 1}),
}


# Where the declared codec reads a frame differently from the hand-written one, on purpose.
_RECEIVED_BEFORE = json.loads(GOLDEN.read_text())["received"]
CHANGED = {"node_bad": "ProtocolError: bad node event: stepping must be a string, got int",
           # fields added since, read as their defaults from frames without them
           "hello_reply_minimal": _RECEIVED_BEFORE["hello_reply_minimal"][:-1] + ", layers=None)",
           "load_minimal": _RECEIVED_BEFORE["load_minimal"][:-1] + ", emulated_layers=None, emulated_partner=None)"}


def frame_of(message: Any) -> str:
    """The frame a sender writes for `message` (a reply as the reply to request 7), as text."""
    if isinstance(message, ap.FailureReply):
        body = ap.failure_message(7, message)
    elif type(message) in ap.REPLIES:
        body = ap.reply_message(7, message)
    else:
        body = message.to_message()
    frame = ap.encode_frame(body)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    return frame[4:].decode()


def read(kind: str, m: dict[str, Any]) -> str:
    """What the receiver reads from `m`: the message's repr, or its ProtocolError."""
    try:
        if kind:
            decoded = getattr(ap, kind).from_fields(m)
        elif m.get("t") in ap.REQUESTS:
            decoded = ap.request_from_message(m)
        else:
            decoded = ap.event_from_message(m)
    except ap.ProtocolError as exc:
        return f"ProtocolError: {exc}"
    return repr(decoded)


def current() -> dict[str, dict[str, str]]:
    return {"frames": {name: frame_of(m) for name, m in SAMPLES.items()},
            "received": {name: read(kind, m) for name, (kind, m) in RECEIVED.items()}}


def test_every_message_type_has_a_sample() -> None:
    types = set(ap.REQUESTS.values()) | set(ap.REPLIES) | set(ap.EVENTS.values())
    assert types <= {type(m) for m in SAMPLES.values()}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_sample_frame_is_byte_for_byte_as_before(name: str) -> None:
    assert frame_of(SAMPLES[name]) == json.loads(GOLDEN.read_text())["frames"][name]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_sample_frame_reads_back_as_its_message(name: str) -> None:
    message = SAMPLES[name]
    frame = json.loads(frame_of(message))
    kind = type(message).__name__ if type(message) in ap.REPLIES else ""
    assert read(kind, ap.reply_fields(frame) if kind else frame) == repr(message)


@pytest.mark.parametrize("name", sorted(RECEIVED))
def test_a_received_frame_reads_as_before(name: str) -> None:
    expected = json.loads(GOLDEN.read_text())["received"][name]
    assert read(*RECEIVED[name]) == CHANGED.get(name, expected)


if __name__ == "__main__":  # the golden file as the codec writes it now (it was captured from the old one)
    GOLDEN.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
