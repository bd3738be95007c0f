"""The node agent protocol: length-prefixed JSON frames over a byte stream.

Transport: any reliable byte stream (TCP on loopback for the embedded agent, TCP across
machines, or a Unix socket), framed by mesh.framing: each frame is a 4-byte big-endian
unsigned length followed by that many bytes of UTF-8 JSON holding one object (a message); this
protocol has no payloads. Frames longer than MAX_FRAME_BYTES are a protocol error and close
the connection.

Every message has a type `t`. The control service sends requests (REQUESTS); a request that
carries an integer `id` gets exactly one reply, of type `reply`: {re: id, ok: true, ...its
reply type's fields} or {re: id, ok: false, ...FailureReply's}; a request without `id` (abort)
gets none. The agent also sends events (EVENTS) on its own.

Every message is one dataclass here, declared once (mesh.wire.codec): its annotated fields
say how each crosses the wire and how it is bounded, and the receiver's decoder raises
ProtocolError on anything else. docs/service.md's table of the messages is generated from
these declarations (mesh.wire.protocol_table).
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Annotated, Any, Callable, ClassVar, Generic, Mapping, Sequence, TypeVar, Union

from mesh import framing
from mesh.engines.detokenize import MAX_STOP_CHARS
from mesh.engines.engine_api import MAX_TOP_LOGPROBS, Sampling, TokenLogprob
from mesh.framing import MAX_HEADER_BYTES as MAX_FRAME_BYTES  # noqa: F401 - part of this protocol's API
from mesh.framing import ProtocolError, encode_frame  # noqa: F401 - likewise
from mesh.policy.kv_demand import RunningMean
from mesh.policy.slo import SLO
from mesh.wire.codec import Declared, Wire, listed, nested, nested_list

PROTOCOL_VERSION = 1
READY_PREFIX = "MESH_AGENT_LISTENING "  # the agent prints this + "host:port" once it listens


class Code(str, Enum):
    """Why a request to the agent failed (the `code` of a reply with ok=false)."""

    BAD_REQUEST = "bad_request"  # the input is wrong (tokenizer, context window): not retryable
    NO_INSTANCE = "no_instance"  # the instance is not on the node (unloaded or never loaded)
    NOT_READY = "not_ready"  # the instance is still loading
    BATCH_FULL = "batch_full"  # the instance runs max_num_seqs requests: retry later
    REFUSED = "refused"  # shadow validation or memory said no: retry later
    MEMORY = "memory"  # a load does not fit the node's memory budget
    BUSY = "busy"  # unload of an instance that still serves requests
    UNAUTHORIZED = "unauthorized"  # hello with a wrong token
    PROTOCOL = "protocol"  # malformed or unknown message
    FAILED = "failed"  # the agent failed to do it (engine error)

    @property
    def retryable(self) -> bool:
        return self in (Code.BATCH_FULL, Code.REFUSED, Code.NOT_READY)


TYPE_KEY = "t"  # every message's type


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next message, or None at a clean end of stream (EOF between frames)."""
    frame = await framing.read_frame(reader, TYPE_KEY)
    return None if frame is None else frame[0]


async def read_hello(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """A connection's first message (the hello with the token): small and prompt
    (framing.read_first_frame), or ProtocolError."""
    return await framing.read_first_frame(reader, TYPE_KEY)


class FrameDecoder(framing.FrameDecoder):
    """Incremental decoder for callers that get bytes in arbitrary pieces (tests, tools)."""

    def __init__(self) -> None:
        super().__init__(TYPE_KEY)


# ---- bounds every field is checked against ------------------------------------------------
# A message that decodes may still carry hostile values (a count of 10^25, an age of 1e308, NaN
# from a codec that writes it): each parser below refuses a value outside these bounds with a
# ProtocolError, answered as `protocol`, before it reaches the node's state.
MAX_COUNT = 2**31 - 1  # token ids, token counts, lengths, windows, batch sizes
MAX_BYTES = 2**50  # memory sizes
MAX_SECONDS = 7 * 86400.0  # ages and durations (no request lives a week)
MAX_STOPS = 16  # stop strings of one request (the service lets a tenant give 4)
MAX_BATCH = 1 << 16  # max_num_seqs, max_batch


def shown(value: Any, limit: int = 40) -> str:
    """A value as an error message shows it: short, and never the repr of a deep structure
    or the digits of a huge integer (either can cost more than the message is worth)."""
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)[:limit]


def count_field(value: Any, name: str, low: int = 0, high: int = MAX_COUNT) -> int:
    """An integer field in [low, high]; a float that is an integer counts (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {shown(value)}")
    return int(value)


def number_field(value: Any, name: str, low: float = 0.0, high: float = MAX_SECONDS) -> float:
    """A finite number field in [low, high] (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {shown(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {shown(value)}")
    return float(value)


def _age(value: Any, name: str) -> float:
    """An age in seconds: a negative one counts as 0 (the clocks of two processes are never
    compared), one past MAX_SECONDS or not finite is refused."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        value = 0.0
    return number_field(value, name)


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids")
    return [count_field(x, name) for x in value]


# ---- payloads shared by both sides ---------------------------------------------------------

MAX_PENALTY = 100.0  # presence / frequency penalties in [-MAX_PENALTY, MAX_PENALTY]; repetition in (0, MAX_PENALTY]
MAX_SCHEMA_CHARS = 64 * 1024  # a structured output's JSON schema, as text
MAX_ADAPTER_SCALE = 1e4  # a LoRA adapter's scale (lora_alpha / r)
MIN_LOGPROB = -1e6  # a log probability on the wire (an engine's -inf is sent as this)


def sampling_to_dict(s: Sampling) -> dict[str, Any]:
    return {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "stop": list(s.stop), "seed": s.seed, "ignore_eos": s.ignore_eos, "logprobs": s.logprobs,
            "top_logprobs": s.top_logprobs, "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty, "repetition_penalty": s.repetition_penalty,
            "json_schema": s.json_schema, "adapter": s.adapter, "adapter_scale": s.adapter_scale}


def sampling_from_dict(d: Mapping[str, Any]) -> Sampling:
    """ProtocolError on a malformed sampling object (the control service validated it)."""
    try:
        stop = d.get("stop") or ()
        if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOPS or not all(
                isinstance(x, str) and len(x) <= MAX_STOP_CHARS for x in stop):
            raise ValueError(f"stop must be at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
        return Sampling(
            max_tokens=count_field(d["max_tokens"], "max_tokens"),
            temperature=number_field(d.get("temperature", 0.0), "temperature", 0.0, 100.0),
            top_p=number_field(d.get("top_p", 1.0), "top_p", 0.0, 1.0),
            stop=tuple(stop),
            seed=None if d.get("seed") is None else count_field(d["seed"], "seed", 0, 2**64 - 1),
            ignore_eos=bool(d.get("ignore_eos", False)),
            logprobs=d.get("logprobs") is True,
            top_logprobs=count_field(d.get("top_logprobs", 0), "top_logprobs", 0, MAX_TOP_LOGPROBS),
            presence_penalty=number_field(d.get("presence_penalty", 0.0), "presence_penalty", -MAX_PENALTY,
                                          MAX_PENALTY),
            frequency_penalty=number_field(d.get("frequency_penalty", 0.0), "frequency_penalty", -MAX_PENALTY,
                                           MAX_PENALTY),
            repetition_penalty=_repetition(d.get("repetition_penalty", 1.0)),
            json_schema=_json_schema(d.get("json_schema")),
            adapter=None if d.get("adapter") is None else text_field(d["adapter"], "adapter"),
            adapter_scale=number_field(d.get("adapter_scale", 1.0), "adapter_scale", 0.0, MAX_ADAPTER_SCALE),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"bad sampling object: {exc}") from exc


def _repetition(value: Any) -> float:
    value = number_field(value, "repetition_penalty", 0.0, MAX_PENALTY)
    if value == 0.0:
        raise ValueError("repetition_penalty must be greater than 0")
    return value


def _json_schema(value: Any) -> str | None:
    if value is None:
        return None
    value = text_field(value, "json_schema")
    if len(value) > MAX_SCHEMA_CHARS:
        raise ValueError(f"json_schema is longer than {MAX_SCHEMA_CHARS} characters")
    return value


def _logprobs(value: Any, count: int) -> list[float]:
    """A tokens item's log probabilities: one finite number <= 0 per token id."""
    values = [number_field(v, "logprob", MIN_LOGPROB, 0.0) for v in list_field(value, "logprobs")]
    if len(values) != count:
        raise ValueError(f"{len(values)} logprobs for {count} token ids")
    return values


def _top_logprobs(value: Any, count: int) -> list[list[tuple[str, float]]]:
    """A tokens item's alternatives: per token id, at most MAX_TOP_LOGPROBS (text, log
    probability) pairs."""
    tops = list_field(value, "top_logprobs")
    if len(tops) != count:
        raise ValueError(f"{len(tops)} top_logprobs lists for {count} token ids")
    out = []
    for top in tops:
        top = list_field(top, "top_logprobs")
        if len(top) > MAX_TOP_LOGPROBS:
            raise ValueError(f"{len(top)} alternatives for one token; at most {MAX_TOP_LOGPROBS}")
        pairs = [list_field(pair, "alternative") for pair in top]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError("an alternative is [text, logprob]")
        out.append([(text_field(t, "alternative"), number_field(v, "logprob", MIN_LOGPROB, 0.0)) for t, v in pairs])
    return out


def tokens_item(request_id: str, token_ids: list[int], text: str,
                logprobs: Sequence[TokenLogprob | None] | None) -> tuple[Any, ...]:
    """A TokensEvent item: (request id, token ids, text), then the tokens' log probabilities
    where the request asked for them, then their alternatives where
    any token has some (Sampling.top_logprobs)."""
    item: tuple[Any, ...] = (request_id, token_ids, text)
    given = [lp for lp in logprobs or () if lp is not None]
    if not given:
        return item
    item += ([_on_wire(lp.logprob) for lp in given],)
    if any(lp.top for lp in given):
        item += ([[(t, _on_wire(v)) for t, v in lp.top] for lp in given],)
    return item


def _on_wire(logprob: float) -> float:
    """A log probability as it crosses: -inf is not JSON, and float noise never passes 0."""
    return min(max(logprob, MIN_LOGPROB), 0.0)


def item_logprobs(item: Sequence[Any]) -> list[TokenLogprob] | None:
    """The log probabilities a TokensEvent item carries (`tokens_item`'s), None if none."""
    if len(item) < 4:
        return None
    tops = item[4] if len(item) > 4 else [()] * len(item[3])
    return [TokenLogprob(lp, tuple(top)) for lp, top in zip(item[3], tops)]


def slo_to_dict(slo: SLO) -> dict[str, float]:
    return {"ttft_min_s": slo.ttft_min_s, "ttft_s_per_prompt_token": slo.ttft_s_per_prompt_token,
            "tpot_s": slo.tpot_s}


def slo_from_dict(d: Mapping[str, Any]) -> SLO:
    try:
        return SLO(number_field(d["ttft_min_s"], "ttft_min_s"),
                   number_field(d["ttft_s_per_prompt_token"], "ttft_s_per_prompt_token"),
                   number_field(d["tpot_s"], "tpot_s"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"bad SLO object: {exc}") from exc


def mean_output_to(mean: RunningMean) -> tuple[float, int, float]:
    """O_avg's state on the wire."""
    return (mean.prior, mean.count, mean.total)


def mean_output_from(state: Any) -> tuple[float, int, float] | None:
    """O_avg's state from the wire (None: not given); ProtocolError if malformed."""
    if state is None:
        return None
    try:
        prior, count, total = state
        return (number_field(prior, "prior", 0.0, MAX_COUNT), count_field(count, "count", 0, 2**62),
                number_field(total, "total", 0.0, 2.0**62 * MAX_COUNT))
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"bad mean_output {shown(state)}: (prior, count, total) expected: {exc}") from exc


def layer_steps_field(value: Any, name: str) -> tuple[tuple[float, int], ...]:
    """A loading instance's usable layers over its load: ((seconds after the load starts,
    layers usable from then), ...), both increasing (ValueError otherwise)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a non-empty list of [seconds, layers]")
    steps: list[tuple[float, int]] = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise ValueError(f"{name}: each step is [seconds, layers], got {shown(item)}")
        step = (number_field(item[0], "seconds", 0.0, 1e9), count_field(item[1], "layers", 1, 100_000))
        if steps and not (step[0] >= steps[-1][0] and step[1] > steps[-1][1]):
            raise ValueError(f"{name}: steps must grow, got {shown(item)} after {list(steps[-1])}")
        steps.append(step)
    return tuple(steps)


# ---- field parsers: (wire value, field name) -> value, ValueError when malformed -----------

def text_field(value: Any, name: str) -> str:
    """A string field (ValueError otherwise)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return value


def flag_field(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {type(value).__name__}")
    return value


def object_field(value: Any, name: str) -> dict[str, Any]:
    """A JSON object field, passed on as it is (a view, or a payload another module validates)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    return dict(value)


def list_field(value: Any, name: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def any_text(value: Any, name: str) -> str:
    """Any value, as its text (fields a peer may send as numbers)."""
    return str(value)


def truthy(value: Any, name: str) -> bool:
    """Any value, as its truth."""
    return bool(value)


def true_only(value: Any, name: str) -> bool:
    """True when the value is true itself, False for anything else."""
    return value is True


def at_least_one(value: Any, name: str) -> int:
    """A count, 0 read as 1 (an output limit)."""
    return max(1, count_field(value, name))


def slo_field(value: Any, name: str) -> SLO:
    return slo_from_dict(value)


def window(value: Any, name: str = "context_window") -> int | None:
    """A message's `context_window`: None (the engine's default) or tokens in [1, MAX_COUNT]."""
    return None if value is None else count_field(value, name, 1)


def counted(low: int = 0, high: int = MAX_COUNT) -> Callable[[Any, str], int]:
    return lambda value, name: count_field(value, name, low, high)


def numbered(low: float = 0.0, high: float = MAX_SECONDS) -> Callable[[Any, str], float]:
    return lambda value, name: number_field(value, name, low, high)


MAX_LATE_S = 3600.0  # no cold start is longer: a larger late_s is a bad message


def late_field(value: Any, name: str) -> float:
    """A request's `late_s`: served late, how late (its age is never negative, so a request
    served late says how late instead of arriving in the future)."""
    try:
        late = float(value)
    except (TypeError, ValueError):
        late = math.nan
    if not 0.0 <= late <= MAX_LATE_S:  # NaN fails too
        raise ValueError(f"late_s must be in [0, {MAX_LATE_S:g}] seconds, got {late}")
    return late


def _sampling(value: Any, name: str) -> Sampling:
    try:
        return sampling_from_dict(value)
    except ProtocolError as exc:
        raise ValueError(str(exc)) from exc


def _slo_dict(value: Any, name: str) -> dict[str, float]:
    """A `load`'s SLO, as the dict it travels as, once checked."""
    slo = dict(value or slo_to_dict(SLO()))
    slo_from_dict(slo)
    return slo


def _tokens_items(value: Any, name: str) -> list[Any]:
    items: list[Any] = []
    for item in list_field(value, name):
        item = list_field(item, "item")
        if len(item) not in (3, 4, 5):
            raise ValueError(f"a tokens item has 3 to 5 elements, got {len(item)}")
        ids = _token_ids(item[1] or [], "token ids")
        head: tuple[Any, ...] = (text_field(item[0], "request_id"), ids, text_field(item[2] or "", "text"))
        if len(item) > 3:
            head += (_logprobs(item[3], len(ids)),)
        if len(item) > 4:
            head += (_top_logprobs(item[4], len(ids)),)
        items.append(head)
    return items


def _tokens_dump(items: list[Any]) -> list[list[Any]]:
    return [list(item) for item in items]


# The field kinds messages are declared with.
Text = Annotated[str, Wire(text_field)]
OptText = Annotated[str | None, Wire(text_field, nullable=True)]
AnyText = Annotated[str, Wire(any_text)]
Flag = Annotated[bool, Wire(flag_field)]
Count = Annotated[int, Wire(counted())]
Bytes = Annotated[int, Wire(counted(0, MAX_BYTES))]
Batch = Annotated[int, Wire(counted(1, MAX_BATCH))]
Window = Annotated[int | None, Wire(window, nullable=True)]
TokenIds = Annotated[list[int], Wire(_token_ids)]
Age = Annotated[float, Wire(_age)]
OptAge = Annotated[float | None, Wire(_age, nullable=True)]
Late = Annotated[float, Wire(late_field)]
View = Annotated[dict[str, Any], Wire(object_field)]
OptView = Annotated[dict[str, Any] | None, Wire(object_field, nullable=True)]
MeanOutput = Annotated[tuple[float, int, float] | None, Wire(lambda v, n: mean_output_from(v), nullable=True)]


# ---- replies: the fields of a `reply` frame {re: id, ok: true, ...} -------------------------
# reply_message / failure_message put a reply type's fields (`to_fields()`) in their frame;
# its receiver reads them back with `from_fields()`.

REPLY = "reply"  # the type of every reply frame


@dataclass(frozen=True, slots=True)
class Ack(Declared):
    """The reply with no fields (ping, unload, shutdown, abort)."""


@dataclass(frozen=True, slots=True)
class FailureReply(Declared):
    """An ok=false reply: why (a Code's value) and what went wrong; a `load` refused for
    memory says by how much."""

    WHAT = "failure reply"
    code: AnyText
    error: AnyText = "failed"
    shortfall_bytes: Annotated[int | None, Wire(counted(0, MAX_BYTES), nullable=True, omit=True)] = None


@dataclass(frozen=True, slots=True)
class HelloReply(Declared):
    """Who the agent is: its node, memory, machine (cpu {model, cores, amx}), process, the
    deadline rule it runs, the device it emulates, where it receives weights ({address, dir};
    None: it does not), the instances it already runs (a reconnect finds them) and its layer
    port (mesh.node.layer_host; an emulating agent's lends time to live instances there)."""

    WHAT = "hello reply"
    node_id: Text
    kind: Text
    memory_bytes: Bytes
    cpu: View
    pid: Count
    protocol: Count
    deadlines: Text
    emulate: OptText
    weights: OptView
    instances: Annotated[list[dict[str, Any]], Wire(listed(object_field, "instance"))]
    layers: Annotated[str | None, Wire(text_field, nullable=True, omit=True)] = None  # its layer port, if any


@dataclass(frozen=True, slots=True)
class LoadReply(Declared):
    """`load` issued: the instance's shape as its engine read it (an `instance` event follows)."""

    WHAT = "load reply"
    weight_bytes: Bytes
    kv_bytes_per_token: Bytes
    context_window: Annotated[int, Wire(counted(1))]


@dataclass(frozen=True, slots=True)
class DescribeReply(Declared):
    """A model's shape before any instance of it runs (vocab_size None: unknown); an emulated
    model's profile too (mesh.perf.profile's dict: the dispatcher plans with it)."""

    WHAT = "describe reply"
    weight_bytes: Bytes
    kv_bytes_per_token: Bytes
    context_window: Annotated[int, Wire(counted(1))]
    vocab_size: Annotated[int | None, Wire(counted(), nullable=True)]
    profile: Annotated[dict[str, Any] | None, Wire(object_field, nullable=True, omit=True)] = None


@dataclass(frozen=True, slots=True)
class TokenizeReply(Declared):
    """The prompt's token ids."""

    WHAT = "tokenize reply"
    ids: TokenIds


@dataclass(frozen=True, slots=True)
class AdmitResult(Declared):
    """One entry's answer in an `admit` reply: ok, or a Code's value and why."""

    WHAT = "admit result"
    ok: Flag
    code: Annotated[str | None, Wire(text_field, nullable=True, omit=True)] = None
    reason: Annotated[str | None, Wire(text_field, nullable=True, omit=True)] = None


@dataclass(frozen=True, slots=True)
class AdmitReply(Declared):
    """Each entry's result, in order."""

    WHAT = "admit reply"
    results: Annotated[list[AdmitResult], nested_list(AdmitResult)]


@dataclass(frozen=True, slots=True)
class ValidationReply(Declared):
    """Shadow validation's answer (validate, validate_group, validate_new)."""

    WHAT = "validation reply"
    admit: Flag
    reason: Text = ""


@dataclass(frozen=True, slots=True)
class StatsReply(Declared):
    """The node's state as /admin/cluster shows it and the dispatcher reads it between calls
    (memory's budget, busy time): the top-level fields typed, the views under them as the
    agent's modules write them."""

    WHAT = "stats reply"
    node_id: Text
    kind: Text
    uptime_s: Annotated[float, Wire(numbered(0.0, math.inf))]
    instances: Annotated[list[dict[str, Any]], Wire(listed(object_field, "instance"))]
    memory: View
    queue_length: Count
    running: Count
    tokenizer: View
    models: Annotated[list[str], Wire(listed(text_field, "model"))]
    busy_s: Annotated[float, Wire(numbered(0.0, math.inf))]
    iterations: Annotated[int, Wire(counted(0, 2**62))]
    kv_bytes_in_use: Bytes
    deadlines: Text
    learnt: View
    parked: View
    parked_ahead: View
    emulate: OptText
    # live scaling's counts (mesh.node.runtime): requests completed after an iteration that
    # waited for layers, and those served late for it ({} where none waited)
    live: Annotated[dict[str, Any], Wire(object_field, omit=True)] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WeightsPathReply(Declared):
    """Where the node writes the model's file; with a manifest asked about, whether the file
    there already is that model (None: not asked)."""

    WHAT = "weights_path reply"
    path: Text
    complete: Annotated[bool | None, Wire(flag_field, nullable=True, omit=True)] = None


@dataclass(frozen=True, slots=True)
class WeightsDropReply(Declared):
    """Whether there were received files to delete."""

    WHAT = "weights_drop reply"
    dropped: Flag


@dataclass(frozen=True, slots=True)
class ForgetReply(Declared):
    """The model forgotten."""

    WHAT = "forget reply"
    forgot: Text


def reply_message(re: int, body: Declared) -> dict[str, Any]:
    """The frame of an ok=true reply to request `re` (body: a reply type's instance)."""
    return {TYPE_KEY: REPLY, "re": re, "ok": True, **body.to_fields()}


def failure_message(re: Any, failure: FailureReply) -> dict[str, Any]:
    """The frame of an ok=false reply to request `re`."""
    return {TYPE_KEY: REPLY, "re": re, "ok": False, **failure.to_fields()}


def reply_fields(m: Mapping[str, Any]) -> dict[str, Any]:
    """A reply frame's fields (without t, re, ok)."""
    return {k: v for k, v in m.items() if k not in (TYPE_KEY, "re", "ok")}


# ---- parts of messages ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Progress(Declared):
    """A running request taken off its node, not ended: the tokens it produced (all of
    them, those it brought there too; tokens_out 0: as many as token_ids) and when its first
    token came, as an age. The reply to `take_back` and the body of an `evicted` event: the
    dispatcher resumes it elsewhere (7.1, 6.4)."""

    WHAT = "progress"
    request_id: Text
    tokens_out: Count = 0
    token_ids: TokenIds = field(default_factory=list)
    first_token_age_s: OptAge = None

    def checked(self) -> "Progress":
        return self if self.tokens_out else replace(self, tokens_out=len(self.token_ids))


@dataclass(frozen=True, slots=True)
class Probe(Declared):
    """A request as shadow validation sees it (R in `validate`, `validate_group`,
    `validate_new`): prompt length, output limit, age (time since it arrived: the ST of
    Eq. 1), tokens it already produced elsewhere and, for the pace rule, its first token's
    age; served late (a cold model's request, SERVE_LATE), its deadlines move by late_s;
    best effort (ServedRequest.best_effort), its own first token may be late."""

    WHAT = "request entry"
    request_id: AnyText
    prompt_len: Count
    max_tokens: Annotated[int, Wire(at_least_one)]
    age_s: Age = 0.0
    done: Count = 0
    first_token_age_s: OptAge = None
    late_s: Late = 0.0
    best_effort: Annotated[bool, Wire(truthy)] = False


@dataclass(frozen=True, slots=True)
class AdmitEntry(Declared):
    """One request of an `admit` batch. A request moved here (7.1, 6.4) carries its prompt
    then the tokens it produced elsewhere in `prompt_token_ids`: `done` of them, recomputed
    here; `prompt_len` says where its prompt ends (None: all ids but the last `done`).
    compute=False: memory check only (the baselines, which do not validate)."""

    WHAT = "admit entry"
    request_id: AnyText
    instance_id: AnyText
    prompt_token_ids: TokenIds
    sampling: Annotated[Sampling, Wire(_sampling, dump=sampling_to_dict)]
    age_s: Age = 0.0
    done: Count = 0
    prompt_len: Annotated[int | None, Wire(counted(-MAX_COUNT), nullable=True)] = None
    compute: Annotated[bool, Wire(truthy)] = True
    first_token_age_s: OptAge = None
    late_s: Late = 0.0
    best_effort: Annotated[bool, Wire(truthy)] = False  # (Probe)

    def checked(self) -> "AdmitEntry":
        ids = len(self.prompt_token_ids)
        prompt_len = ids - self.done if self.prompt_len is None else self.prompt_len
        if not 1 <= prompt_len <= ids:
            raise ValueError(f"done={self.done}, prompt_len={prompt_len} with {ids} token ids")
        return replace(self, prompt_len=prompt_len)


@dataclass(frozen=True, slots=True)
class NewInstance(Declared):
    """The instance a `validate_new` plans: its model's shape, batch, SLO, cold start, the
    calibration profile its times come from (None: the default for its weights) and O_avg."""

    WHAT = "validate_new plan"
    instance_id: Text
    model: Text
    weight_bytes: Bytes
    kv_bytes_per_token: Bytes
    context_window: Annotated[int, Wire(counted(1))]
    max_batch: Batch
    slo: Annotated[SLO, Wire(slo_field, dump=slo_to_dict)]
    expected_load_s: Annotated[float, Wire(numbered())]
    profile: OptText = None
    mean_output: MeanOutput = None


# ---- requests: control -> agent ------------------------------------------------------------

R = TypeVar("R")


class Typed(Declared):
    """A message that travels in a frame of its own, under its type `T`: `to_message()`
    writes that frame, `from_message()` reads it back."""

    __slots__ = ()
    T: ClassVar[str]
    KIND: ClassVar[str]  # how an error names it after its type: "message", "event"

    @classmethod
    def what(cls) -> str:
        return f"{cls.T} {cls.KIND}"

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, **self.to_fields()}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> Any:
        return cls.from_fields(m)


class Request(Typed, Generic[R]):
    """A message the control service sends an agent, with the type of its reply (`REPLY`);
    request_from_message reads one back."""

    __slots__ = ()
    KIND: ClassVar[str] = "message"
    REPLY: ClassVar[Any]


@dataclass(frozen=True, slots=True)
class Hello(Request[HelloReply]):
    """A connection's first message: the agent token ($MESH_AGENT_TOKEN) and the protocol spoken."""

    T: ClassVar[str] = "hello"
    REPLY: ClassVar[Any] = HelloReply
    token: OptText
    protocol: Annotated[int | None, Wire(counted(), nullable=True)] = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Ping(Request[Ack]):
    """A heartbeat."""

    T: ClassVar[str] = "ping"
    REPLY: ClassVar[Any] = Ack


@dataclass(frozen=True, slots=True)
class InstanceSpec(Request[LoadReply]):
    """Start one model instance (the `load` message): the model's global id (registry uid;
    also the engine's model_name), its file as the agent's machine sees it, its window,
    SLO, batch, calibration profile, engine ("openvino", "vllm", "emulated"), the
    dispatcher's predicted cold start, exact_moves (EXACT_RECOMPUTE: a moved greedy stream
    continues exactly, at about 2x the compute), the model's O_avg as the service holds it
    ([prior, count, total], 6.1) and, for an emulated instance, how long its engine's load
    takes (the replay's) and, where it serves before its last layer arrives (live scaling,
    mesh.control.load_timing), its usable layers over the load. An `instance` event follows
    the reply."""

    T: ClassVar[str] = "load"
    REPLY: ClassVar[Any] = LoadReply
    instance_id: AnyText
    model: AnyText
    path: AnyText
    context_window: Window = None
    slo: Annotated[dict[str, float], Wire(_slo_dict)] = field(default_factory=lambda: slo_to_dict(SLO()))
    max_num_seqs: Batch = 64
    profile: OptText = None
    engine: AnyText = "openvino"
    expected_load_s: Annotated[float | None, Wire(numbered(), nullable=True)] = None
    exact_moves: Annotated[bool, Wire(truthy)] = False
    mean_output: MeanOutput = None
    emulated_load_s: Annotated[float | None, Wire(numbered(), nullable=True)] = None
    emulated_layers: Annotated[tuple[tuple[float, int], ...] | None,
                               Wire(layer_steps_field, lambda v: [list(s) for s in v], nullable=True,
                                    omit=True)] = None
    # live, its ZigZag partner: {address (its agent's layer port), token, instance_id, link_bytes_per_s}
    emulated_partner: Annotated[dict[str, Any] | None, Wire(object_field, nullable=True, omit=True)] = None


@dataclass(frozen=True, slots=True)
class Unload(Request[Ack]):
    """Stop an instance that serves no request (`busy` otherwise)."""

    T: ClassVar[str] = "unload"
    REPLY: ClassVar[Any] = Ack
    instance_id: Text


@dataclass(frozen=True, slots=True)
class Describe(Request[DescribeReply]):
    """A model's shape, read by an unloaded engine of it (its `front`); an OpenVINO model is
    then built with these load settings and parked (mesh.node.park_ahead)."""

    T: ClassVar[str] = "describe"
    REPLY: ClassVar[Any] = DescribeReply
    model: Text
    path: Text
    engine: Text = "openvino"
    context_window: Window = None
    max_num_seqs: Batch = 64
    exact_moves: Flag = False


OmitText = Annotated[str | None, Wire(text_field, nullable=True, omit=True)]


@dataclass(frozen=True, slots=True)
class Tokenize(Request[TokenizeReply]):
    """A prompt's (or a conversation's) ids, with the tokenizer of a loaded instance
    (`instance_id`) or, before any instance runs there, of the model at `path`. OpenVINO
    prompts wait in the agent's tokenizer queue, which takes the tenants in turn; an Abort
    of `request_id` cancels the job (dropped from the queue, or its ids discarded)."""

    T: ClassVar[str] = "tokenize"
    REPLY: ClassVar[Any] = TokenizeReply
    instance_id: OmitText = None
    model: OmitText = None
    path: OmitText = None
    engine: OmitText = None
    context_window: Annotated[int | None, Wire(window, nullable=True, omit=True)] = None
    messages: Annotated[list[dict[str, Any]] | None, Wire(listed(object_field, "message"), nullable=True,
                                                             omit=True)] = None
    prompt: OmitText = None
    request_id: OmitText = None
    tenant: OmitText = None

    def checked(self) -> "Tokenize":
        if self.instance_id is None and self.path is None:
            raise ValueError("give the instance_id of a loaded instance or the model's path")
        return self

    def front(self) -> Describe:
        """The model (by path) whose unloaded engine tokenizes when no instance is named."""
        return Describe(self.model or "model", str(self.path), self.engine or "openvino", self.context_window)


@dataclass(frozen=True, slots=True)
class Admit(Request[AdmitReply]):
    """Validate and admit each entry in one step of the node's loop (results in order)."""

    T: ClassVar[str] = "admit"
    REPLY: ClassVar[Any] = AdmitReply
    requests: Annotated[list[AdmitEntry], nested_list(AdmitEntry)]


@dataclass(frozen=True, slots=True)
class Validate(Request[ValidationReply]):
    """Would the request meet its SLO on the instance, with the instances in `exclude`
    preempted first (shadow validation, 5.3, 6.4, 7.1)? Changes nothing."""

    T: ClassVar[str] = "validate"
    REPLY: ClassVar[Any] = ValidationReply
    instance_id: Text
    request: Annotated[Probe, nested(Probe)]
    exclude: Annotated[list[str], Wire(listed(text_field, "exclude"))] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ValidateGroup(Request[ValidationReply]):
    """Would the instance serve all of `requests` (a group moved there together)?"""

    T: ClassVar[str] = "validate_group"
    REPLY: ClassVar[Any] = ValidationReply
    instance_id: Text
    requests: Annotated[list[Probe], nested_list(Probe)] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ValidateNew(Request[ValidationReply]):
    """Would a new instance of the planned model, started now with its cold start, serve
    all of `requests`?"""

    T: ClassVar[str] = "validate_new"
    REPLY: ClassVar[Any] = ValidationReply
    plan: Annotated[NewInstance, nested(NewInstance)]
    requests: Annotated[list[Probe], nested_list(Probe)] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TakeBack(Request[Progress]):
    """Take a running request off the node, not ended, with its progress (preemption 7.1);
    no `done` follows. A request whose instance is in the middle of a prefill leaves when
    that iteration ends."""

    T: ClassVar[str] = "take_back"
    REPLY: ClassVar[Any] = Progress
    request_id: Text
    why: Text = "taken back by the control service"


@dataclass(frozen=True, slots=True)
class Abort(Request[Ack]):
    """End a request (failed; a `done` event follows), or cancel its tokenize still under
    way (that tokenize fails, no `done`). Sent without an id: no reply (with one, an empty one)."""

    T: ClassVar[str] = "abort"
    REPLY: ClassVar[Any] = Ack
    request_id: Text


@dataclass(frozen=True, slots=True)
class Stats(Request[StatsReply]):
    """The node's state: its instances (batch, pending, idle time, KV budget / in use /
    allocated, weights, time factors), memory (capacity, budget, pessimistic, free, waiting
    operations), queue, busy time and iterations."""

    T: ClassVar[str] = "stats"
    REPLY: ClassVar[Any] = StatsReply


@dataclass(frozen=True, slots=True)
class Shutdown(Request[Ack]):
    """Stop the agent (it exits once the reply is out)."""

    T: ClassVar[str] = "shutdown"
    REPLY: ClassVar[Any] = Ack


@dataclass(frozen=True, slots=True)
class WeightsPath(Request[WeightsPathReply]):
    """Where a multicast to the node writes the model's file (mesh.weights.receiver); with a
    manifest (mesh.weights.blocks.Manifest's dict, read by the receiving node), also whether
    the file there already is it."""

    T: ClassVar[str] = "weights_path"
    REPLY: ClassVar[Any] = WeightsPathReply
    model: Text
    file: Text
    manifest: Annotated[dict[str, Any] | None, Wire(object_field, nullable=True, omit=True)] = None


@dataclass(frozen=True, slots=True)
class WeightsDrop(Request[WeightsDropReply]):
    """Delete the model's received files (the model was deleted)."""

    T: ClassVar[str] = "weights_drop"
    REPLY: ClassVar[Any] = WeightsDropReply
    model: Text


@dataclass(frozen=True, slots=True)
class Forget(Request[ForgetReply]):
    """The model was deleted: every trace of it on the node goes (`busy` while it has
    instances). An empty model is refused as bad_request."""

    T: ClassVar[str] = "forget"
    REPLY: ClassVar[Any] = ForgetReply
    model: Annotated[str, Wire(text_field, absent="")]


# ---- events: agent -> control --------------------------------------------------------------

class AgentEvent(Typed):
    """A message the agent sends on its own; event_from_message reads one back."""

    __slots__ = ()
    KIND: ClassVar[str] = "event"


@dataclass(frozen=True, slots=True)
class TokensEvent(AgentEvent):
    """Tokens of one iteration, every token of it in one frame: (request id, token ids,
    text) per request, their log probabilities, one per token id, for a request that asked
    for them (a fourth element), and for one that asked for alternatives, per token id its
    most likely tokens as [text, log probability] pairs (a fifth): `tokens_item`."""

    T: ClassVar[str] = "tokens"
    items: Annotated[list[Any], Wire(_tokens_items, dump=_tokens_dump)]


@dataclass(frozen=True, slots=True)
class DoneEvent(AgentEvent):
    """A request ended on the node (outcome and finish reason as the runtime's enums' values:
    completed / failed, stop / length)."""

    T: ClassVar[str] = "done"
    request_id: Text
    outcome: Text = "failed"
    reason: OptText = None
    detail: Text = ""
    tokens_out: Count = 0
    ttft_s: Annotated[float | None, Wire(numbered(-MAX_SECONDS), nullable=True)] = None
    tpot_s: Annotated[float | None, Wire(numbered(-MAX_SECONDS), nullable=True)] = None


@dataclass(frozen=True, slots=True)
class InstanceEvent(AgentEvent):
    """An instance finished loading (`ready`: engine loaded and KV cache sized; loaded_from:
    where the engine read the model from, "gguf", "prepared", "ir", "" unknown) or failed."""

    T: ClassVar[str] = "instance"
    instance_id: Text
    state: Text  # "ready" | "failed"
    loaded_from: Annotated[str, Wire(text_field, omit=True)] = ""
    error: Annotated[str, Wire(text_field, omit=True)] = ""


@dataclass(frozen=True, slots=True)
class EvictedEvent(AgentEvent):
    """The node's memory subsystem evicted a running request (6.4), progress kept, or (fault)
    the node failed it (a hung engine: its deadlines restart where it resumes): place it
    again (no `done` follows)."""

    T: ClassVar[str] = "evicted"
    why: Annotated[str, Wire(text_field, absent="evicted")]
    progress: Annotated[Progress, nested(Progress, inline=True)]
    fault: Annotated[bool, Wire(true_only, omit=True)] = False


@dataclass(frozen=True, slots=True)
class NodeEvent(AgentEvent):
    """The node's state that the dispatcher reads between calls, as a replay's policy reads
    a LocalNode's: the instance whose iteration is in flight (None: between iterations or
    idle), which preemption skips (LLM-Mesh 7.1), and the memory budget in use (the
    reservation station's optimistic budget, 6.3), by which new instances bin-pack (4).
    Sent when either changed, after the frames of what changed it."""

    T: ClassVar[str] = "node"
    stepping: OptText
    budget_bytes: Bytes


Event = Union[TokensEvent, DoneEvent, InstanceEvent, EvictedEvent, NodeEvent]
EVENTS: dict[str, type[Event]] = {e.T: e for e in (TokensEvent, DoneEvent, InstanceEvent, EvictedEvent, NodeEvent)}
REQUESTS: dict[str, Any] = {r.T: r for r in (
    Hello, Ping, InstanceSpec, Unload, Tokenize, Describe, Admit, Validate, ValidateGroup, ValidateNew, TakeBack,
    Abort, Stats, Shutdown, WeightsPath, WeightsDrop, Forget)}
REPLIES: tuple[Any, ...] = (Ack, FailureReply, HelloReply, LoadReply, DescribeReply, TokenizeReply, AdmitReply,
                            ValidationReply, Progress, StatsReply, WeightsPathReply, WeightsDropReply, ForgetReply)


def event_from_message(m: Mapping[str, Any]) -> Event:
    """The typed event in an agent's message; ProtocolError for an unknown or malformed one."""
    kind = EVENTS.get(str(m.get("t")))
    if kind is None:
        raise ProtocolError(f"unknown event {shown(m.get(TYPE_KEY))}")
    return kind.from_message(m)


def request_from_message(m: Mapping[str, Any]) -> Request[Any]:
    """The typed request in a message; ProtocolError for an unknown or malformed one."""
    kind = m.get(TYPE_KEY)
    request = REQUESTS.get(kind) if isinstance(kind, str) else None
    if request is None:
        raise ProtocolError(f"unknown message type {shown(kind, 80)}")
    return request.from_message(m)
