"""A stream resumed elsewhere goes on with the text it would have had: `resume_text` brings a
fresh detokenizer and stop matcher to where the first node's were, so a character split
across the resume point, or a stop string that straddles it, comes out whole, once, and the
stop string still ends the request (a byte-level stand-in tokenizer: one byte a token)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.engines.detokenize import Detokenizer, StopMatcher, resume_text


def decode(ids) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def stream(ids: list[int], stops: tuple[str, ...], resume_at: int | None = None) -> tuple[str, bool]:
    """The text a request streams for `ids`, taken off its node after `resume_at` tokens and
    resumed on another (fresh state, replayed); and whether a stop string ended it."""
    detok, stop = Detokenizer(decode), StopMatcher(stops) if stops else None
    out = ""
    for i, token in enumerate(ids):
        if i == resume_at:  # the first node is gone: what it held back went with it
            detok, stop = Detokenizer(decode), StopMatcher(stops) if stops else None
            resume_text(detok, stop, ids[:i])
        delta = detok.push(token)
        out += stop.feed(delta) if stop else delta
        if stop and stop.stopped:
            return out, True
    tail = detok.flush()
    return out + ((stop.feed(tail) + stop.flush()) if stop else tail), False


TEXTS = st.text(alphabet=st.sampled_from("ab é€😀\n"), min_size=1, max_size=24)


@settings(max_examples=200, deadline=None)
@given(TEXTS, st.sampled_from(["", "b é", "😀a", "€€"]), st.data())
def test_a_resumed_stream_has_the_text_of_an_undisturbed_one(text, stop, data):
    ids = list(text.encode())
    stops = (stop,) if stop else ()
    at = data.draw(st.integers(0, len(ids)))
    assert stream(ids, stops, at) == stream(ids, stops)


def test_a_stop_string_straddling_the_resume_point_still_ends_the_request():
    ids = list("say END now".encode())
    assert stream(ids, ("END",), resume_at=6) == ("say ", True)  # "E" held back on the first node
    assert stream(ids, ("END",)) == ("say ", True)
