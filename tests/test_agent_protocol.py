"""Every message of the agent protocol, both ways (mesh.wire.agent_protocol): each request,
reply and event written by its sender, put through the real frame codec and read back by
its receiver, is the same message; and a message carrying a hostile value (huge or negative
numbers, NaN and infinities, deep nesting, wrong types) is a ProtocolError, never another
exception."""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.engines.engine_api import MAX_TOP_LOGPROBS, Sampling
from mesh.framing import decode_header
from mesh.policy.slo import SLO
from mesh.wire import agent_protocol as ap
from mesh.wire.agent_protocol import (
    EVENTS,
    REPLIES,
    REQUESTS,
    TYPE_KEY,
    ProtocolError,
    encode_frame,
    event_from_message,
    failure_message,
    reply_fields,
    reply_message,
    request_from_message,
)

text = st.text(max_size=10)
name = st.text(min_size=1, max_size=10)
count = st.integers(0, ap.MAX_COUNT)
positive = st.integers(1, ap.MAX_COUNT)
nbytes = st.integers(0, ap.MAX_BYTES)
ids = st.lists(count, max_size=6)
seconds = st.floats(0, ap.MAX_SECONDS)
age = st.none() | seconds
window = st.none() | positive
view = st.dictionaries(text, st.none() | st.booleans() | count | text, max_size=3)  # a JSON object shown as it is
sampling = st.builds(Sampling, max_tokens=count, temperature=st.floats(0, 100), top_p=st.floats(0, 1),
                     stop=st.lists(st.text(max_size=8), max_size=4).map(tuple),
                     seed=st.none() | st.integers(0, 2**64 - 1),
                     ignore_eos=st.booleans(), logprobs=st.booleans(),
                     top_logprobs=st.integers(0, MAX_TOP_LOGPROBS), presence_penalty=st.floats(-100, 100),
                     frequency_penalty=st.floats(-100, 100), repetition_penalty=st.floats(1e-3, 100),
                     json_schema=st.none() | st.text(max_size=20), adapter=st.none() | st.text(max_size=20),
                     adapter_scale=st.floats(0, ap.MAX_ADAPTER_SCALE))
slo = st.builds(SLO, st.floats(1e-3, 1e3), st.floats(0, 1.0), st.floats(1e-3, 1e3))
mean_output = st.none() | st.tuples(st.floats(0, ap.MAX_COUNT), st.integers(0, 2**62), st.floats(0, 2.0**62))
probe = st.builds(ap.Probe, text, count, positive, seconds, count, age, st.floats(0, ap.MAX_LATE_S))
progress = st.builds(ap.Progress, text, positive, ids, age)


@st.composite
def admit_entries(draw: Any) -> ap.AdmitEntry:
    token_ids = draw(st.lists(count, min_size=1, max_size=8))
    prompt_len = draw(st.integers(1, len(token_ids)))
    return ap.AdmitEntry(draw(text), draw(text), token_ids, draw(sampling), draw(seconds),
                         draw(st.integers(0, len(token_ids) - prompt_len)), prompt_len, draw(st.booleans()), draw(age),
                         draw(st.floats(0, ap.MAX_LATE_S)))


# One strategy per message type: a type without one fails test_every_message_type_has_a_strategy.
MESSAGES: dict[type, Any] = {
    # control -> agent
    ap.Hello: st.builds(ap.Hello, st.none() | text, st.none() | count),
    ap.Ping: st.just(ap.Ping()),
    ap.Stats: st.just(ap.Stats()),
    ap.Shutdown: st.just(ap.Shutdown()),
    ap.InstanceSpec: st.builds(ap.InstanceSpec, text, text, text, window, slo.map(ap.slo_to_dict),
                               st.integers(1, ap.MAX_BATCH), st.none() | text, text, st.none() | seconds,
                               st.booleans(), mean_output, st.none() | seconds),
    ap.Unload: st.builds(ap.Unload, text),
    ap.Describe: st.builds(ap.Describe, text, text, name, window, st.integers(1, ap.MAX_BATCH), st.booleans()),
    ap.Tokenize: st.builds(ap.Tokenize, st.none() | text, st.none() | text, text, st.none() | text, window,
                           st.none() | st.lists(view, max_size=3), st.none() | text, st.none() | text,
                           st.none() | text),
    ap.Admit: st.builds(ap.Admit, st.lists(admit_entries(), max_size=3)),
    ap.Validate: st.builds(ap.Validate, text, probe, st.lists(text, max_size=3)),
    ap.ValidateGroup: st.builds(ap.ValidateGroup, text, st.lists(probe, max_size=3)),
    ap.ValidateNew: st.builds(ap.ValidateNew, st.builds(
        ap.NewInstance, text, text, nbytes, nbytes, positive, st.integers(1, ap.MAX_BATCH), slo, seconds,
        st.none() | text, mean_output), st.lists(probe, max_size=3)),
    ap.TakeBack: st.builds(ap.TakeBack, text, name),
    ap.Abort: st.builds(ap.Abort, text),
    ap.WeightsPath: st.builds(ap.WeightsPath, text, text, st.none() | view),
    ap.WeightsDrop: st.builds(ap.WeightsDrop, text),
    ap.Forget: st.builds(ap.Forget, text),
    # agent -> control: replies
    ap.Ack: st.just(ap.Ack()),
    ap.FailureReply: st.builds(ap.FailureReply, st.sampled_from([c.value for c in ap.Code]), text, st.none() | nbytes),
    ap.HelloReply: st.builds(ap.HelloReply, text, st.sampled_from(["cpu", "gpu"]), nbytes, view, count,
                             st.just(ap.PROTOCOL_VERSION), st.sampled_from(["eq1", "pace"]), st.none() | text,
                             st.none() | view, st.lists(view, max_size=2)),
    ap.LoadReply: st.builds(ap.LoadReply, nbytes, nbytes, positive),
    ap.DescribeReply: st.builds(ap.DescribeReply, nbytes, nbytes, positive, st.none() | count, st.none() | view),
    ap.TokenizeReply: st.builds(ap.TokenizeReply, ids),
    ap.AdmitReply: st.builds(ap.AdmitReply, st.lists(
        st.just(ap.AdmitResult(True)) | st.builds(ap.AdmitResult, st.just(False), st.none() | text, st.none() | text),
        max_size=3)),
    ap.ValidationReply: st.builds(ap.ValidationReply, st.booleans(), text),
    ap.Progress: progress,
    ap.StatsReply: st.builds(ap.StatsReply, text, text, seconds, st.lists(view, max_size=2), view, count, count, view,
                             st.lists(text, max_size=3), seconds, count, nbytes, text, view, view, view,
                             st.none() | text),
    ap.WeightsPathReply: st.builds(ap.WeightsPathReply, text, st.none() | st.booleans()),
    ap.WeightsDropReply: st.builds(ap.WeightsDropReply, st.booleans()),
    ap.ForgetReply: st.builds(ap.ForgetReply, text),
    # agent -> control: events
    ap.TokensEvent: st.builds(ap.TokensEvent, st.lists(st.tuples(text, ids, text) | ids.flatmap(
        lambda i: st.tuples(text, st.just(i), text, st.lists(st.floats(ap.MIN_LOGPROB, 0), min_size=len(i),
                                                             max_size=len(i)))) | ids.flatmap(
        lambda i: st.tuples(text, st.just(i), text, st.lists(st.floats(ap.MIN_LOGPROB, 0), min_size=len(i),
                                                             max_size=len(i)),
                            st.lists(st.lists(st.tuples(text, st.floats(ap.MIN_LOGPROB, 0)), max_size=MAX_TOP_LOGPROBS),
                                     min_size=len(i), max_size=len(i)))), max_size=3)),
    ap.DoneEvent: st.builds(ap.DoneEvent, text, st.sampled_from(["completed", "failed"]),
                            st.none() | st.sampled_from(["stop", "length"]), text, count, age, age),
    ap.InstanceEvent: st.builds(ap.InstanceEvent, text, st.sampled_from(["ready", "failed"]), text, text),
    ap.EvictedEvent: st.builds(ap.EvictedEvent, name, progress, st.booleans()),
    ap.NodeEvent: st.builds(ap.NodeEvent, st.none() | text, nbytes),
}


def through_the_wire(message: dict[str, Any]) -> dict[str, Any]:
    """What the receiver decodes: the sender's frame, through the frame codec."""
    return decode_header(encode_frame(message)[4:], TYPE_KEY)


def round_trip(message: Any) -> Any:
    """Write a message as its sender does and read it back as its receiver does."""
    kind = type(message)
    if kind in REQUESTS.values():
        return request_from_message(through_the_wire({"id": 7, **message.to_message()}))
    if kind is ap.FailureReply:
        frame = through_the_wire(failure_message(7, message))
        assert frame["ok"] is False and frame["re"] == 7
        return ap.FailureReply.from_fields(reply_fields(frame))
    if kind in REPLIES:
        frame = through_the_wire(reply_message(7, message))
        assert frame["ok"] is True and frame["re"] == 7 and frame[TYPE_KEY] == ap.REPLY
        return kind.from_fields(reply_fields(frame))
    return event_from_message(through_the_wire(message.to_message()))


def test_every_message_type_has_a_strategy() -> None:
    assert set(MESSAGES) == set(REQUESTS.values()) | set(REPLIES) | set(EVENTS.values())


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(*MESSAGES.values()))
def test_every_message_reads_back_as_written(message: Any) -> None:
    assert round_trip(message) == message


def test_the_wire_format_is_unchanged() -> None:
    """The frames the senders wrote as dicts before the protocol was typed, byte for byte."""
    def frame(m: dict[str, Any]) -> bytes:
        return encode_frame(m)

    assert frame(ap.Hello("tok").to_message()) == frame({"t": "hello", "token": "tok", "protocol": 1})
    assert frame(ap.Abort("r1").to_message()) == frame({"t": "abort", "request_id": "r1"})
    assert frame(ap.TakeBack("r1", "why").to_message()) == frame({"t": "take_back", "request_id": "r1", "why": "why"})
    assert frame(ap.WeightsPath("org/m", "f.gguf", {"a": 1}).to_message()) == frame(
        {"t": "weights_path", "model": "org/m", "file": "f.gguf", "manifest": {"a": 1}})
    assert frame(ap.Describe("u", "/p", "openvino", 512, 8, True).to_message()) == frame(
        {"t": "describe", "model": "u", "path": "/p", "engine": "openvino", "context_window": 512, "max_num_seqs": 8,
         "exact_moves": True})
    assert frame(ap.Tokenize(instance_id="i", prompt="hi", request_id="r", tenant="t").to_message()) == frame(
        {"t": "tokenize", "instance_id": "i", "prompt": "hi", "request_id": "r", "tenant": "t"})
    assert frame(reply_message(3, ap.AdmitReply([ap.AdmitResult(True), ap.AdmitResult(False, "refused", "full")]))) == \
        frame({"t": "reply", "re": 3, "ok": True, "results": [{"ok": True}, {"ok": False, "code": "refused",
                                                                               "reason": "full"}]})
    assert frame(failure_message(4, ap.FailureReply("memory", "short", 10))) == frame(
        {"t": "reply", "re": 4, "ok": False, "code": "memory", "error": "short", "shortfall_bytes": 10})


# ---- hostile values ------------------------------------------------------------------------

HOSTILE = (st.sampled_from([10**30, -10**30, 2**63, -1, -2**63 - 1, 1e308, -1e308, float("nan"), float("inf"),
                            float("-inf"), True, "", "x" * 100, {}, [], [[[[[[[[[[[]]]]]]]]]]], {"a": {"b": {"c": {}}}},
                            [None], [float("nan")], [10**30], [-1]])
           | st.recursive(st.none() | st.integers() | st.floats() | st.text(max_size=4),
                          lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids,
                                                                                    max_size=2), max_leaves=6))


def decode_any(kind: type, m: dict[str, Any]) -> Any:
    """Read `m` as the receiver of a `kind` reads it."""
    if kind in REQUESTS.values():
        return request_from_message(m)
    if kind in REPLIES:
        return kind.from_fields(m)
    return event_from_message(m)


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@settings(max_examples=600, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(*MESSAGES.values()), st.data())
def test_a_hostile_value_in_any_field_is_a_protocol_error(message: Any, data: Any) -> None:
    """One field (or a field of an entry in a list) of a valid message replaced by a hostile
    value, written as JSON that NaN and infinities may be written into: the frame codec or
    the receiver raises ProtocolError, or the receiver reads a message that a sender could
    write (its frame encodes); nothing else."""
    kind = type(message)
    m = message.to_message() if hasattr(message, "to_message") else message.to_fields()
    target = m
    lists = [k for k, v in m.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
    if lists and data.draw(st.booleans()):  # an entry's field: an admit entry, a probe, a result
        target = m[data.draw(st.sampled_from(lists))][0]
    keys = [k for k in target if k != TYPE_KEY]
    if keys:
        target[data.draw(st.sampled_from(keys))] = data.draw(HOSTILE)
    frame = m if TYPE_KEY in m else {TYPE_KEY: ap.REPLY, "re": 1, "ok": True, **m}
    try:
        received = decode_header(json.dumps(frame, allow_nan=True).encode(), TYPE_KEY)
        decoded = decode_any(kind, received if TYPE_KEY in m else reply_fields(received))
    except ProtocolError:
        return
    encode_frame(decoded.to_message() if hasattr(decoded, "to_message") else reply_message(1, decoded))


@pytest.mark.parametrize("kind", sorted(set(MESSAGES) - {ap.Ack, ap.Ping, ap.Stats, ap.Shutdown}, key=str))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 10**30, -10**30, {"a": 1}, nested(5000), [[{}]]])
def test_a_message_whose_every_field_is_hostile_is_a_protocol_error(kind: type, bad: Any) -> None:
    """Every field of a message given the same hostile value, in memory (NaN and 5,000-deep
    nesting, as a codec that writes them would hand them over): ProtocolError."""
    m = {"t": getattr(kind, "T", None), **{f: bad for f in kind.__dataclass_fields__}}
    if kind is ap.TokensEvent:
        m["items"] = [["r", bad, bad]] if isinstance(bad, list) else bad
    if kind is ap.EvictedEvent:
        m.update({"request_id": bad, "tokens_out": bad, "token_ids": bad, "first_token_age_s": bad})
    with pytest.raises(ProtocolError):
        decode_any(kind, m)


def test_deep_nesting_on_the_wire_is_a_protocol_error() -> None:
    body = b'{"id":1,"t":"admit","requests":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ProtocolError):
        request_from_message(decode_header(body, TYPE_KEY))
    body = json.dumps({"id": 1, "t": "validate_group", "instance_id": "i", "requests": nested(300)}).encode()
    with pytest.raises(ProtocolError):
        request_from_message(decode_header(body, TYPE_KEY))


def test_the_docs_table_is_the_declared_messages() -> None:
    """docs/service.md's tables of the messages are what mesh.wire.protocol_table writes from
    the declarations (`python -m mesh.wire.protocol_table docs/service.md` rewrites them)."""
    from pathlib import Path

    from mesh.wire.protocol_table import protocol_table, with_table

    doc = (Path(__file__).parent.parent / "docs" / "service.md").read_text()
    assert with_table(doc) == doc
    assert "| `admit` | `requests` [{`request_id`, `instance_id`, `prompt_token_ids`, `sampling`" in protocol_table()
