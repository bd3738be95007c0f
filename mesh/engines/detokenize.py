"""Incremental detokenization and stop strings, one token at a time.

Byte-level BPE splits multi-byte characters across tokens; decoding one token alone gives
nothing (OpenVINO drops the partial bytes) or U+FFFD (other tokenizers). `Detokenizer`
decodes a short window of recent tokens and emits only text that is complete, so the
deltas concatenate to the decoded output. `StopMatcher` cuts the text at the first stop
string and holds back a tail that could still become one, so no stop string leaks into a
delta that was already streamed. Both are pure Python around a `decode` callable.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


@dataclass(slots=True)
class Detokenizer:
    """Turns a growing token list into text deltas (the prefix/read offset scheme of vLLM)."""

    decode: Decode
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # start of the window decoded for context
    read_offset: int = 0  # tokens before this are already emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", for a partial character)."""
        self.ids.append(token_id)
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd") or not text.startswith(prefix):
            return ""  # incomplete character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """Text still held back at the end of the output (an incomplete tail, usually "")."""
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.decode(self.ids[self.prefix_offset:]).rstrip("\ufffd")
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if text.startswith(prefix) else ""


MAX_STOP_CHARS = 256  # the longest stop string a request may give (the service and the agent protocol check it)


@dataclass(slots=True)
class StopMatcher:
    """Finds stop strings in streamed text; the stop string itself is never emitted. Each
    `feed` costs O(len(delta) + total stop length): the held tail is shorter than the
    longest stop, and the partial match at its end is found with each stop's KMP table."""

    stops: tuple[str, ...]
    held: str = ""  # text that may be the start of a stop string
    stopped: bool = False
    _tables: tuple[list[int], ...] = ()

    def __post_init__(self) -> None:
        self._tables = tuple(_prefix_table(s) for s in self.stops)

    def feed(self, delta: str) -> str:
        """Return the part of `held + delta` that is safe to emit; sets `stopped` on a match."""
        if self.stopped:
            return ""
        text = self.held + delta
        cut = min((i for i in (text.find(s) for s in self.stops if s) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.held = True, ""
            return text[:cut]
        keep = self._partial_tail(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string
        (linear in the stop's length: the KMP automaton run over the last len(stop) - 1
        characters of `text`)."""
        best = 0
        for stop, table in zip(self.stops, self._tables):
            if len(stop) < 2 or not text or text[-1] not in stop:
                continue
            k = 0
            for ch in text[-(len(stop) - 1):]:
                while k and stop[k] != ch:
                    k = table[k - 1]
                if stop[k] == ch:
                    k += 1
            best = max(best, k)
        return best


def resume_text(detok: Detokenizer, stop: StopMatcher | None, produced: Sequence[int]) -> None:
    """Bring a resumed request's detokenizer and stop matcher to where they were on the node
    that produced `produced` (the tokens it streamed there): each is pushed and fed as it
    was, its text discarded (it was streamed), so what was held back (an incomplete
    character, a tail that may start a stop string) is held back here too."""
    for token in produced:
        delta = detok.push(token)
        if stop is not None:
            stop.feed(delta)
    if stop is not None:
        stop.stopped = False  # (a stop string ends a request where it is found: never in streamed text)


def _prefix_table(pattern: str) -> list[int]:
    """KMP's failure function: table[i] is the length of the longest proper prefix of
    pattern[:i + 1] that is also its suffix."""
    table = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return table
