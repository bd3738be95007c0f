"""The agent protocol's typed messages: what one side writes, the other reads back; a
malformed message is a ProtocolError, never a KeyError or a half-read object."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.engines.engine_api import Sampling
from mesh.wire.agent_protocol import (
    AdmitEntry,
    DoneEvent,
    EvictedEvent,
    InstanceEvent,
    Probe,
    Progress,
    ProtocolError,
    TokensEvent,
    event_from_message,
)

ids = st.lists(st.integers(0, 1 << 20), max_size=8)
ages = st.none() | st.floats(0, 1e4)
text = st.text(max_size=12)


def wire(message: dict) -> dict:
    """What the other side decodes: the message through JSON."""
    return json.loads(json.dumps(message))


@given(st.one_of(
    st.builds(TokensEvent, st.lists(st.tuples(text, ids, text), max_size=4)),
    st.builds(DoneEvent, text, st.sampled_from(["completed", "failed"]), st.none() | st.sampled_from(["stop",
                                                                                                      "length"]),
              text, st.integers(0, 4096), ages, ages),
    st.builds(InstanceEvent, text, st.sampled_from(["ready", "failed"]), text),
    st.builds(EvictedEvent, text.filter(bool), st.builds(Progress, text, st.integers(1, 64), ids, ages)),
))
def test_every_event_reads_back_as_written(event):
    assert event_from_message(wire(event.to_message())) == event


@given(st.builds(Probe, text, st.integers(1, 4096), st.integers(1, 4096), st.floats(0, 1e4), st.integers(0, 64), ages,
                 st.floats(0, 3600)))
def test_a_probe_reads_back_as_written(probe):
    assert Probe.from_fields(wire(probe.to_fields())) == probe


@pytest.mark.parametrize("late", [-1.0, float("nan"), 1e9, "soon"])
def test_a_request_served_late_says_how_late_within_bounds(late):
    """A cold model's request served late (SERVE_LATE) carries late_s, not a negative age
    (ages are clamped at 0, which had made every late admission on a real agent fail)."""
    probe = Probe("r", 10, 5, 0.0, late_s=2.5).to_fields()
    assert Probe.from_fields(probe).late_s == 2.5
    with pytest.raises(ProtocolError, match="late_s"):
        Probe.from_fields(probe | {"late_s": late})
    entry = AdmitEntry("r", "i", [1, 2], Sampling(max_tokens=1), 0.0, 0, 2, late_s=2.5).to_fields()
    assert AdmitEntry.from_fields(wire(entry)).late_s == 2.5
    with pytest.raises(ProtocolError, match="late_s"):
        AdmitEntry.from_fields(entry | {"late_s": late})


def test_an_admit_entry_reads_back_and_checks_where_its_prompt_ends():
    entry = AdmitEntry("r1", "i1", [5, 6, 7, 8], Sampling(max_tokens=4, temperature=0.5, stop=("x",)), 0.25, 2, 2,
                       False, 0.1)
    assert AdmitEntry.from_fields(wire(entry.to_fields())) == entry
    moved = wire(entry.to_fields()) | {"prompt_len": 9}
    with pytest.raises(ProtocolError, match="prompt_len=9 with 4 token ids"):
        AdmitEntry.from_fields(moved)


@pytest.mark.parametrize("message,match", [
    ({"t": "tokens", "items": [["r", "notalist", ""]]}, "bad tokens event"),
    ({"t": "done"}, "bad done event"),
    ({"t": "instance", "state": "ready"}, "bad instance event"),
    ({"t": "evicted", "why": "x", "token_ids": [1]}, "bad progress"),
    ({"t": "reply"}, "unknown event"),
])
def test_a_malformed_event_is_a_protocol_error(message, match):
    with pytest.raises(ProtocolError, match=match):
        event_from_message(message)


def test_a_default_read_from_the_wire_is_each_message_own():
    """A list or dict a missing field reads as is made afresh for each message: one receiver
    changing its message's leaves every other message's as it was."""
    first = Progress.from_fields({"request_id": "r1"})
    first.token_ids.append(7)
    assert Progress.from_fields({"request_id": "r2"}).token_ids == []
