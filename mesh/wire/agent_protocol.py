"""The node agent protocol: length-prefixed JSON frames over a byte stream.

Transport: any reliable byte stream (TCP on loopback for the embedded agent, TCP across
machines, or a Unix socket), framed by mesh.framing: each frame is a 4-byte big-endian
unsigned length followed by that many bytes of UTF-8 JSON holding one object (a message); this
protocol has no payloads. Frames longer than MAX_FRAME_BYTES are a protocol error and close
the connection.

Every message has a type `t`. The control service sends requests; a request that carries
an integer `id` gets exactly one reply, of type `reply`: {re: id, ok: true, ...its fields} or
{re: id, ok: false, code, error}; a request without `id` (abort) gets none. The agent also
sends events on its own (tokens, done, instance, evicted (6.4), node (6.3)). Reply codes
when `ok` is false: see Code; admission results use the same codes. Every message and
field is listed in docs/service.md ("The node agent protocol").

Every message is one dataclass here, built by its sender and read back by its
receiver, whose decoder bounds every field and raises ProtocolError on anything else:
- requests (REQUESTS, by type; each a Request naming its reply type, REPLY): Hello, Ping,
  InstanceSpec (`load`), Unload, Tokenize, Describe, Admit (of AdmitEntry), Validate,
  ValidateGroup, ValidateNew (a NewInstance and its Probes), TakeBack, Abort, Stats,
  Shutdown, WeightsPath, WeightsDrop, Forget: `to_message()` / `from_message()`
  (request_from_message picks the type);
- replies (REPLIES): Ack, HelloReply, LoadReply, DescribeReply, TokenizeReply, AdmitReply (of
  AdmitResult), Verdict, Progress (`take_back`), StatsReply, WeightsPathReply,
  WeightsDropReply, ForgetReply, and Failure for ok=false: `to_fields()` / `from_fields()`,
  framed by reply_message / failure_message;
- events (EVENTS): TokensEvent, DoneEvent, InstanceEvent, EvictedEvent, NodeEvent:
  `to_message()` / event_from_message.
"""
from __future__ import annotations

import asyncio
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, ClassVar, Generic, Iterator, Mapping, TypeVar, Union

from mesh import framing
from mesh.engines.detokenize import MAX_STOP_CHARS
from mesh.engines.engine_api import Sampling
from mesh.framing import MAX_HEADER_BYTES as MAX_FRAME_BYTES  # noqa: F401 - part of this protocol's API
from mesh.framing import ProtocolError, encode_frame  # noqa: F401 - likewise
from mesh.policy.kv_demand import RunningMean
from mesh.policy.slo import SLO

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
MIN_LOGPROB = -1e6  # a log probability on the wire (an engine's -inf is sent as this)


def sampling_to_dict(s: Sampling) -> dict[str, Any]:
    return {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "stop": list(s.stop), "seed": s.seed, "ignore_eos": s.ignore_eos, "logprobs": s.logprobs,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty, "json_schema": s.json_schema}


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
            presence_penalty=number_field(d.get("presence_penalty", 0.0), "presence_penalty", -MAX_PENALTY,
                                          MAX_PENALTY),
            frequency_penalty=number_field(d.get("frequency_penalty", 0.0), "frequency_penalty", -MAX_PENALTY,
                                           MAX_PENALTY),
            repetition_penalty=_repetition(d.get("repetition_penalty", 1.0)),
            json_schema=_json_schema(d.get("json_schema")),
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


# ---- decoding helpers for the typed messages ----------------------------------------------

@contextmanager
def malformed(what: str) -> Iterator[None]:
    """Turn what a decoder meets in a malformed message (a missing key, a wrong type, a value
    out of bounds) into a ProtocolError naming the message."""
    try:
        yield
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError, RecursionError) as exc:
        raise ProtocolError(f"bad {what}: {exc}") from exc


def text_field(value: Any, name: str) -> str:
    """A string field (ValueError otherwise)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return value


def opt_text(value: Any, name: str) -> str | None:
    return None if value is None else text_field(value, name)


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


def _opt(value: Any, parse: Any, *args: Any) -> Any:
    return None if value is None else parse(value, *args)


# ---- replies: the fields of a `reply` frame {re: id, ok: true, ...} -------------------------
# Each reply type writes its fields with `to_fields()` and is read back with `from_fields()`
# (ProtocolError when malformed); reply_message / failure_message put them in their frame.

REPLY = "reply"  # the type of every reply frame


@dataclass(frozen=True, slots=True)
class Ack:
    """The reply with no fields (ping, unload, shutdown, abort)."""

    def to_fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "Ack":
        return cls()


@dataclass(frozen=True, slots=True)
class Failure:
    """An ok=false reply: why (a Code's value) and what went wrong; a `load` refused for
    memory says by how much."""

    code: str
    error: str
    shortfall_bytes: int | None = None

    def to_fields(self) -> dict[str, Any]:
        out = {"code": self.code, "error": self.error}
        return out if self.shortfall_bytes is None else {**out, "shortfall_bytes": self.shortfall_bytes}

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "Failure":
        with malformed("failure reply"):
            return cls(str(m.get("code")), str(m.get("error", "failed")),
                       _opt(m.get("shortfall_bytes"), count_field, "shortfall_bytes", 0, MAX_BYTES))


@dataclass(frozen=True, slots=True)
class HelloReply:
    """Who the agent is: its node, memory, machine (cpu), process, the deadline rule it runs,
    the device it emulates, where it receives weights ({address, dir}; None: it does not)
    and the instances it already runs (a reconnect finds them)."""

    node_id: str
    kind: str
    memory_bytes: int
    cpu: dict[str, Any]
    pid: int
    protocol: int
    deadlines: str
    emulate: str | None
    weights: dict[str, Any] | None
    instances: list[dict[str, Any]]

    def to_fields(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "HelloReply":
        with malformed("hello reply"):
            return cls(text_field(m["node_id"], "node_id"), text_field(m["kind"], "kind"),
                       count_field(m["memory_bytes"], "memory_bytes", 0, MAX_BYTES), object_field(m["cpu"], "cpu"),
                       count_field(m["pid"], "pid"), count_field(m["protocol"], "protocol"),
                       text_field(m["deadlines"], "deadlines"), opt_text(m.get("emulate"), "emulate"),
                       _opt(m.get("weights"), object_field, "weights"),
                       [object_field(i, "instance") for i in list_field(m["instances"], "instances")])


@dataclass(frozen=True, slots=True)
class LoadReply:
    """`load` issued: the instance's shape as its engine read it (an `instance` event follows)."""

    weight_bytes: int
    kv_bytes_per_token: int
    context_window: int

    def to_fields(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "LoadReply":
        with malformed("load reply"):
            return cls(count_field(m["weight_bytes"], "weight_bytes", 0, MAX_BYTES),
                       count_field(m["kv_bytes_per_token"], "kv_bytes_per_token", 0, MAX_BYTES),
                       count_field(m["context_window"], "context_window", 1))


@dataclass(frozen=True, slots=True)
class DescribeReply:
    """A model's shape before any instance of it runs; an emulated model's profile too
    (mesh.perf.profile's dict: the dispatcher plans with it)."""

    weight_bytes: int
    kv_bytes_per_token: int
    context_window: int
    vocab_size: int | None
    profile: dict[str, Any] | None = None

    def to_fields(self) -> dict[str, Any]:
        out = {"weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
               "context_window": self.context_window, "vocab_size": self.vocab_size}
        return out if self.profile is None else {**out, "profile": self.profile}

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "DescribeReply":
        with malformed("describe reply"):
            return cls(count_field(m["weight_bytes"], "weight_bytes", 0, MAX_BYTES),
                       count_field(m["kv_bytes_per_token"], "kv_bytes_per_token", 0, MAX_BYTES),
                       count_field(m["context_window"], "context_window", 1),
                       _opt(m.get("vocab_size"), count_field, "vocab_size"),
                       _opt(m.get("profile"), object_field, "profile"))


@dataclass(frozen=True, slots=True)
class TokenizeReply:
    ids: list[int]

    def to_fields(self) -> dict[str, Any]:
        return {"ids": self.ids}

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "TokenizeReply":
        with malformed("tokenize reply"):
            return cls(_token_ids(m["ids"], "ids"))


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """One entry's answer in an `admit` reply: ok, or a Code's value and why."""

    ok: bool
    code: str | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"ok": True} if self.ok else {"ok": False, "code": self.code, "reason": self.reason}

    @classmethod
    def from_dict(cls, m: Any) -> "AdmitResult":
        with malformed("admit result"):
            ok = flag_field(m["ok"], "ok")
            return cls(True) if ok else cls(False, opt_text(m.get("code"), "code"), opt_text(m.get("reason"), "reason"))


@dataclass(frozen=True, slots=True)
class AdmitReply:
    results: list[AdmitResult]

    def to_fields(self) -> dict[str, Any]:
        return {"results": [r.to_dict() for r in self.results]}

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "AdmitReply":
        with malformed("admit reply"):
            return cls([AdmitResult.from_dict(r) for r in list_field(m["results"], "results")])


@dataclass(frozen=True, slots=True)
class Verdict:
    """Shadow validation's answer (validate, validate_group, validate_new)."""

    admit: bool
    reason: str

    def to_fields(self) -> dict[str, Any]:
        return {"admit": self.admit, "reason": self.reason}

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "Verdict":
        with malformed("validation reply"):
            return cls(flag_field(m["admit"], "admit"), text_field(m.get("reason") or "", "reason"))


@dataclass(frozen=True, slots=True)
class StatsReply:
    """The node's state as /admin/cluster shows it and the dispatcher reads it between calls
    (memory's budget, busy time): the top-level fields typed, the views under them as the
    agent's modules write them."""

    node_id: str
    kind: str
    uptime_s: float
    instances: list[dict[str, Any]]
    memory: dict[str, Any]
    queue_length: int
    running: int
    tokenizer: dict[str, Any]
    models: list[str]
    busy_s: float
    iterations: int
    kv_bytes_in_use: int
    deadlines: str
    learnt: dict[str, Any]
    parked: dict[str, Any]
    parked_ahead: dict[str, Any]
    emulate: str | None

    def to_fields(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "StatsReply":
        with malformed("stats reply"):
            return cls(
                text_field(m["node_id"], "node_id"), text_field(m["kind"], "kind"),
                number_field(m["uptime_s"], "uptime_s", 0.0, math.inf),
                [object_field(i, "instance") for i in list_field(m["instances"], "instances")],
                object_field(m["memory"], "memory"), count_field(m["queue_length"], "queue_length"),
                count_field(m["running"], "running"), object_field(m["tokenizer"], "tokenizer"),
                [text_field(x, "model") for x in list_field(m["models"], "models")],
                number_field(m["busy_s"], "busy_s", 0.0, math.inf), count_field(m["iterations"], "iterations", 0,
                                                                                2**62),
                count_field(m["kv_bytes_in_use"], "kv_bytes_in_use", 0, MAX_BYTES),
                text_field(m["deadlines"], "deadlines"), object_field(m["learnt"], "learnt"),
                object_field(m["parked"], "parked"), object_field(m["parked_ahead"], "parked_ahead"),
                opt_text(m.get("emulate"), "emulate"))


@dataclass(frozen=True, slots=True)
class WeightsPathReply:
    """Where the node writes the model's file; with a manifest asked about, whether the file
    there already is that model (None: not asked)."""

    path: str
    complete: bool | None = None

    def to_fields(self) -> dict[str, Any]:
        return {"path": self.path} if self.complete is None else {"path": self.path, "complete": self.complete}

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "WeightsPathReply":
        with malformed("weights_path reply"):
            return cls(text_field(m["path"], "path"), _opt(m.get("complete"), flag_field, "complete"))


@dataclass(frozen=True, slots=True)
class WeightsDropReply:
    dropped: bool  # there were files to delete

    def to_fields(self) -> dict[str, Any]:
        return {"dropped": self.dropped}

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "WeightsDropReply":
        with malformed("weights_drop reply"):
            return cls(flag_field(m["dropped"], "dropped"))


@dataclass(frozen=True, slots=True)
class ForgetReply:
    forgot: str  # the model

    def to_fields(self) -> dict[str, Any]:
        return {"forgot": self.forgot}

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "ForgetReply":
        with malformed("forget reply"):
            return cls(text_field(m["forgot"], "forgot"))


def reply_message(re: int, body: Any) -> dict[str, Any]:
    """The frame of an ok=true reply to request `re` (body: a reply type's instance)."""
    return {TYPE_KEY: REPLY, "re": re, "ok": True, **body.to_fields()}


def failure_message(re: Any, failure: Failure) -> dict[str, Any]:
    """The frame of an ok=false reply to request `re`."""
    return {TYPE_KEY: REPLY, "re": re, "ok": False, **failure.to_fields()}


def reply_fields(m: Mapping[str, Any]) -> dict[str, Any]:
    """A reply frame's fields (without t, re, ok)."""
    return {k: v for k, v in m.items() if k not in (TYPE_KEY, "re", "ok")}


# ---- requests: control -> agent ------------------------------------------------------------

R = TypeVar("R")


class Request(Generic[R]):
    """A message the control service sends an agent: its type `T`, the type of its reply
    (`REPLY`), `to_message()` and a validating `from_message()`."""

    __slots__ = ()
    T: ClassVar[str]
    REPLY: ClassVar[Any]

    def to_message(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class InstanceSpec(Request[LoadReply]):
    """What an agent needs to start one model instance (the `load` message)."""

    T: ClassVar[str] = "load"
    REPLY: ClassVar[Any] = LoadReply
    instance_id: str
    model: str  # the model's global id (registry uid); also the engine's model_name
    path: str  # GGUF file or OpenVINO IR folder, as the agent's machine sees it
    context_window: int | None = None  # None: the engine's default
    slo: dict[str, float] = field(default_factory=lambda: slo_to_dict(SLO()))
    max_num_seqs: int = 64
    profile: str | None = None  # a calibration profile file for the iteration times
    engine: str = "openvino"  # "openvino" (CPU); "vllm" (GPU agents)
    expected_load_s: float | None = None  # the dispatcher's predicted cold start (None: the agent's default)
    # Numerics under which a moved or preempted greedy stream, recomputed elsewhere from prompt
    # + produced tokens, continues exactly as it would have (the engine's own setting:
    # mesh.engines.openvino_engine.EXACT_RECOMPUTE). Off by default: it costs about 2x in prefill and
    # batched decode on the CPU; a moved stream then loses, repeats and reorders nothing, but its
    # continuation may differ at a near-tie (docs/design.md).
    exact_moves: bool = False
    # O_avg of the model as the control service holds it (prior, count, total: LLM-Mesh 6.1):
    # one mean per model, shared by every instance of it, as in the replay. None: the agent's prior
    mean_output: tuple[float, int, float] | None = None
    # An emulated instance (engine "emulated"): how long its engine's load takes, the replay's
    # simulated engine's (mesh.control.cluster_view.ClusterView.simulated_load_s); the node's KV cache
    # allocation follows, as in the replay. None: ColdStart's load of its weights.
    emulated_load_s: float | None = None

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, **asdict(self)}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "InstanceSpec":
        try:
            profile = m.get("profile")
            if profile is not None and not isinstance(profile, str):
                raise ValueError(f"profile must be a string, got {type(profile).__name__}")
            spec = cls(
                instance_id=str(m["instance_id"]), model=str(m["model"]), path=str(m["path"]),
                context_window=window(m.get("context_window")),
                slo=dict(m.get("slo") or slo_to_dict(SLO())),
                max_num_seqs=count_field(m.get("max_num_seqs", 64), "max_num_seqs", 1, MAX_BATCH),
                profile=profile, engine=str(m.get("engine", "openvino")),
                expected_load_s=None if m.get("expected_load_s") is None else number_field(
                    m["expected_load_s"], "expected_load_s"),
                exact_moves=bool(m.get("exact_moves", False)),
                mean_output=mean_output_from(m.get("mean_output")),
                emulated_load_s=None if m.get("emulated_load_s") is None else number_field(
                    m["emulated_load_s"], "emulated_load_s"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"bad load message: {exc}") from exc
        slo_from_dict(spec.slo)
        return spec


def window(value: Any) -> int | None:
    """A message's `context_window`: None (the engine's default) or tokens in [1, MAX_COUNT]."""
    return None if value is None else count_field(value, "context_window", 1)


# ---- typed messages at the protocol boundary -----------------------------------------------
# Each side builds these and puts them on the wire with `to_message()`; the receiving side
# reads them back with `from_message()`, which raises ProtocolError on a malformed message.

def _opt_age(value: Any, name: str) -> float | None:
    return None if value is None else _age(value, name)


MAX_LATE_S = 3600.0  # no cold start is longer: a larger late_s is a bad message


def _late(m: Any) -> float:
    """A message's `late_s` (age_s is never negative, so a request served late says how
    late instead of arriving in the future)."""
    try:
        late = float(m.get("late_s", 0.0))
    except (TypeError, ValueError):
        late = math.nan
    if not 0.0 <= late <= MAX_LATE_S:  # NaN fails too
        raise ValueError(f"late_s must be in [0, {MAX_LATE_S:g}] seconds, got {late}")
    return late


@dataclass(frozen=True, slots=True)
class Progress:
    """A running request taken off its node, not ended: the tokens it produced (all of
    them, those it brought there too) and when its first token came, as an age. The reply
    to `take_back` and the body of an `evicted` event: the dispatcher resumes it elsewhere
    (7.1, 6.4)."""

    request_id: str
    tokens_out: int
    token_ids: list[int]
    first_token_age_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_fields(self) -> dict[str, Any]:  # as the reply to take_back
        return self.to_dict()

    @classmethod
    def from_fields(cls, m: Mapping[str, Any]) -> "Progress":
        return cls.from_dict(m)

    @classmethod
    def from_dict(cls, m: Mapping[str, Any]) -> "Progress":
        try:
            ids = _token_ids(m.get("token_ids") or [], "token_ids")
            return cls(text_field(m["request_id"], "request_id"), count_field(m.get("tokens_out") or len(ids),
                                                                              "tokens_out"), ids,
                       _opt_age(m.get("first_token_age_s"), "first_token_age_s"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"bad progress: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Probe:
    """A request as shadow validation sees it (`validate`, `validate_group`, `validate_new`):
    prompt length, output limit, age (time since it arrived: the ST of Eq. 1), tokens it
    already produced elsewhere and, for the pace rule, its first token's age."""

    request_id: str
    prompt_len: int
    max_tokens: int
    age_s: float
    done: int = 0
    first_token_age_s: float | None = None
    late_s: float = 0.0  # served late (a cold model's request, SERVE_LATE): its deadlines move by this

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, m: Any) -> "Probe":
        try:
            return cls(str(m["request_id"]), count_field(m["prompt_len"], "prompt_len"),
                       max(1, count_field(m["max_tokens"], "max_tokens")), _age(m.get("age_s", 0.0), "age_s"),
                       count_field(m.get("done", 0), "done"), _opt_age(m.get("first_token_age_s"), "first_token_age_s"),
                       _late(m))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"bad request entry: {exc}") from exc


@dataclass(frozen=True, slots=True)
class AdmitEntry:
    """One request of an `admit` batch. A request moved here (7.1, 6.4) carries its prompt
    then the tokens it produced elsewhere in `prompt_token_ids`: `done` of them, recomputed
    here; `prompt_len` says where its prompt ends. compute=False: memory check only (the
    baselines, which do not validate)."""

    request_id: str
    instance_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    age_s: float
    done: int = 0
    prompt_len: int | None = None  # None: all ids but the last `done`
    compute: bool = True
    first_token_age_s: float | None = None
    late_s: float = 0.0  # as Probe.late_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "sampling": sampling_to_dict(self.sampling)}

    @classmethod
    def from_dict(cls, m: Any) -> "AdmitEntry":
        try:
            ids = _token_ids(m["prompt_token_ids"], "prompt_token_ids")
            done = count_field(m.get("done", 0), "done")
            prompt_len = count_field(m.get("prompt_len", len(ids) - done), "prompt_len", -MAX_COUNT)
            if not 1 <= prompt_len <= len(ids):
                raise ValueError(f"done={done}, prompt_len={prompt_len} with {len(ids)} token ids")
            return cls(str(m["request_id"]), str(m["instance_id"]), ids, sampling_from_dict(m["sampling"]),
                       _age(m.get("age_s", 0.0), "age_s"), done, prompt_len, bool(m.get("compute", True)),
                       _opt_age(m.get("first_token_age_s"), "first_token_age_s"), _late(m))
        except (KeyError, TypeError, ValueError, AttributeError, ProtocolError) as exc:
            raise ProtocolError(f"bad admit entry: {exc}") from exc


@dataclass(frozen=True, slots=True)
class TokensEvent:
    """Tokens of one iteration: (request id, token ids, text) per request, and their log
    probabilities, one per token id, for a request that asked for them (a fourth element)."""

    T: ClassVar[str] = "tokens"
    items: list[tuple[str, list[int], str] | tuple[str, list[int], str, list[float]]]

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "items": [list(item) for item in self.items]}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "TokensEvent":
        with malformed("tokens event"):
            items = []
            for item in list_field(m["items"], "items"):
                item = list_field(item, "item")
                if len(item) not in (3, 4):
                    raise ValueError(f"a tokens item has 3 or 4 elements, got {len(item)}")
                ids = _token_ids(item[1] or [], "token ids")
                head = (text_field(item[0], "request_id"), ids, text_field(item[2] or "", "text"))
                items.append(head + (_logprobs(item[3], len(ids)),) if len(item) == 4 else head)
            return cls(items)


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """A request ended on the node (outcome and finish reason as the runtime's enums' values)."""

    T: ClassVar[str] = "done"
    request_id: str
    outcome: str
    reason: str | None
    detail: str
    tokens_out: int
    ttft_s: float | None
    tpot_s: float | None

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, **asdict(self)}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "DoneEvent":
        with malformed("done event"):
            return cls(text_field(m["request_id"], "request_id"), text_field(m.get("outcome") or "failed", "outcome"),
                       opt_text(m.get("reason"), "reason"), text_field(m.get("detail") or "", "detail"),
                       count_field(m.get("tokens_out") or 0, "tokens_out"), _opt(m.get("ttft_s"), number_field,
                                                                                 "ttft_s", -MAX_SECONDS),
                       _opt(m.get("tpot_s"), number_field, "tpot_s", -MAX_SECONDS))


@dataclass(frozen=True, slots=True)
class InstanceEvent:
    """An instance finished loading (`ready`: engine loaded and KV cache sized) or failed."""

    T: ClassVar[str] = "instance"
    instance_id: str
    state: str  # "ready" | "failed"
    error: str = ""
    loaded_from: str = ""  # ready: where the engine read the model from ("gguf", "prepared", "ir"; "" unknown)

    def to_message(self) -> dict[str, Any]:
        out = {TYPE_KEY: self.T, "instance_id": self.instance_id, "state": self.state}
        if self.loaded_from:
            out["loaded_from"] = self.loaded_from
        return {**out, "error": self.error} if self.error else out

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "InstanceEvent":
        with malformed("instance event"):
            return cls(text_field(m["instance_id"], "instance_id"), text_field(m["state"], "state"),
                       text_field(m.get("error") or "", "error"), text_field(m.get("loaded_from") or "", "loaded_from"))


@dataclass(frozen=True, slots=True)
class EvictedEvent:
    """The node's memory subsystem evicted a running request (6.4), progress kept: place it
    again (no `done` follows)."""

    T: ClassVar[str] = "evicted"
    why: str
    progress: Progress
    fault: bool = False  # the node failed it (a hung engine): its deadlines restart where it resumes

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "why": self.why, **self.progress.to_dict(), **({"fault": True} if self.fault else {})}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "EvictedEvent":
        with malformed("evicted event"):
            return cls(text_field(m.get("why") or "evicted", "why"), Progress.from_dict(m), m.get("fault") is True)


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """The node's state that the dispatcher reads between calls, as a replay's policy reads
    a LocalNode's: the instance whose iteration is in flight (None: between iterations or
    idle), which preemption skips (LLM-Mesh 7.1), and the memory budget in use (the
    reservation station's optimistic budget, 6.3), by which new instances bin-pack (4)."""

    T: ClassVar[str] = "node"
    stepping: str | None
    budget_bytes: int

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "stepping": self.stepping, "budget_bytes": self.budget_bytes}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "NodeEvent":
        stepping = m.get("stepping")
        if stepping is not None and not isinstance(stepping, str):
            raise ProtocolError(f"bad node event: stepping {shown(stepping)}")
        with malformed("node event"):
            return cls(stepping, count_field(m["budget_bytes"], "budget_bytes", 0, MAX_BYTES))


Event = Union[TokensEvent, DoneEvent, InstanceEvent, EvictedEvent, NodeEvent]
EVENTS: dict[str, type[Event]] = {e.T: e for e in (TokensEvent, DoneEvent, InstanceEvent, EvictedEvent, NodeEvent)}


def event_from_message(m: Mapping[str, Any]) -> Event:
    """The typed event in an agent's message; ProtocolError for an unknown or malformed one."""
    kind = EVENTS.get(str(m.get("t")))
    if kind is None:
        raise ProtocolError(f"unknown event {shown(m.get(TYPE_KEY))}")
    return kind.from_message(m)


# ---- requests: control -> agent (InstanceSpec, the `load`, is above) -------------------------

@dataclass(frozen=True, slots=True)
class Hello(Request[HelloReply]):
    """A connection's first message: the agent token ($MESH_AGENT_TOKEN) and the protocol spoken."""

    T: ClassVar[str] = "hello"
    REPLY: ClassVar[Any] = HelloReply
    token: str | None
    protocol: int | None = PROTOCOL_VERSION

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "token": self.token, "protocol": self.protocol}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "Hello":
        with malformed("hello message"):
            return cls(opt_text(m.get("token"), "token"), _opt(m.get("protocol"), count_field, "protocol"))


@dataclass(frozen=True, slots=True)
class _Bare(Request[Ack]):
    """A request with no fields."""

    REPLY: ClassVar[Any] = Ack

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> Any:
        return cls()


@dataclass(frozen=True, slots=True)
class Ping(_Bare):
    T: ClassVar[str] = "ping"


@dataclass(frozen=True, slots=True)
class Shutdown(_Bare):
    """Stop the agent (it exits once the reply is out)."""

    T: ClassVar[str] = "shutdown"


@dataclass(frozen=True, slots=True)
class Stats(Request[StatsReply]):
    T: ClassVar[str] = "stats"
    REPLY: ClassVar[Any] = StatsReply

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "Stats":
        return cls()


@dataclass(frozen=True, slots=True)
class Unload(Request[Ack]):
    """Stop an instance that serves no request (busy otherwise)."""

    T: ClassVar[str] = "unload"
    REPLY: ClassVar[Any] = Ack
    instance_id: str

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "instance_id": self.instance_id}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "Unload":
        with malformed("unload message"):
            return cls(text_field(m["instance_id"], "instance_id"))


@dataclass(frozen=True, slots=True)
class Describe(Request[DescribeReply]):
    """A model's shape, read by an unloaded engine of it (its `front`); an OpenVINO model is
    then built with these load settings and parked (mesh.node.park_ahead)."""

    T: ClassVar[str] = "describe"
    REPLY: ClassVar[Any] = DescribeReply
    model: str
    path: str
    engine: str = "openvino"
    context_window: int | None = None
    max_num_seqs: int = 64
    exact_moves: bool = False

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, **asdict(self)}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "Describe":
        with malformed("describe message"):
            return cls(text_field(m["model"], "model"), text_field(m["path"], "path"),
                       text_field(m.get("engine") or "openvino", "engine"), window(m.get("context_window")),
                       count_field(m.get("max_num_seqs") or 64, "max_num_seqs", 1, MAX_BATCH),
                       flag_field(m.get("exact_moves", False), "exact_moves"))


@dataclass(frozen=True, slots=True)
class Tokenize(Request[TokenizeReply]):
    """A prompt's (or a conversation's) ids, with the tokenizer of a loaded instance
    (`instance_id`) or, before any instance runs there, of the model at `path`. With a
    `request_id`, an Abort of it cancels the job; `tenant` takes its turn in the queue."""

    T: ClassVar[str] = "tokenize"
    REPLY: ClassVar[Any] = TokenizeReply
    instance_id: str | None = None
    model: str | None = None
    path: str | None = None
    engine: str | None = None
    context_window: int | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    request_id: str | None = None
    tenant: str | None = None

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, **{k: v for k, v in asdict(self).items() if v is not None}}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "Tokenize":
        with malformed("tokenize message"):
            messages = m.get("messages")
            out = cls(opt_text(m.get("instance_id"), "instance_id"), opt_text(m.get("model"), "model"),
                      opt_text(m.get("path"), "path"), opt_text(m.get("engine"), "engine"),
                      window(m.get("context_window")),
                      None if messages is None else [object_field(x, "message") for x in list_field(messages,
                                                                                                    "messages")],
                      opt_text(m.get("prompt"), "prompt"), opt_text(m.get("request_id"), "request_id"),
                      opt_text(m.get("tenant"), "tenant"))
            if out.instance_id is None and out.path is None:
                raise ValueError("give the instance_id of a loaded instance or the model's path")
            return out

    def front(self) -> Describe:
        """The model (by path) whose unloaded engine tokenizes when no instance is named."""
        return Describe(self.model or "model", str(self.path), self.engine or "openvino", self.context_window)


@dataclass(frozen=True, slots=True)
class Admit(Request[AdmitReply]):
    """Validate and admit each entry in one step of the node's loop (results in order)."""

    T: ClassVar[str] = "admit"
    REPLY: ClassVar[Any] = AdmitReply
    requests: list[AdmitEntry]

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "requests": [e.to_dict() for e in self.requests]}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "Admit":
        with malformed("admit message"):
            return cls([AdmitEntry.from_dict(r) for r in list_field(m["requests"], "requests")])


@dataclass(frozen=True, slots=True)
class Validate(Request[Verdict]):
    """Would the request meet its SLO on the instance, with the instances in `exclude`
    preempted first (shadow validation, 5.3, 6.4, 7.1)?"""

    T: ClassVar[str] = "validate"
    REPLY: ClassVar[Any] = Verdict
    instance_id: str
    request: Probe
    exclude: list[str] = field(default_factory=list)

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "instance_id": self.instance_id, "request": self.request.to_dict(),
                "exclude": list(self.exclude)}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "Validate":
        with malformed("validate message"):
            return cls(text_field(m["instance_id"], "instance_id"), Probe.from_dict(m["request"]),
                       [text_field(i, "exclude") for i in list_field(m.get("exclude") or [], "exclude")])


@dataclass(frozen=True, slots=True)
class ValidateGroup(Request[Verdict]):
    """Would the instance serve all of `requests` (a group moved there together)?"""

    T: ClassVar[str] = "validate_group"
    REPLY: ClassVar[Any] = Verdict
    instance_id: str
    requests: list[Probe]

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "instance_id": self.instance_id, "requests": [r.to_dict() for r in self.requests]}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "ValidateGroup":
        with malformed("validate_group message"):
            return cls(text_field(m["instance_id"], "instance_id"),
                       [Probe.from_dict(r) for r in list_field(m.get("requests") or [], "requests")])


@dataclass(frozen=True, slots=True)
class NewInstance:
    """The instance a `validate_new` plans: its model's shape, batch, SLO, cold start, the
    calibration profile its times come from (None: the default for its weights) and O_avg."""

    instance_id: str
    model: str
    weight_bytes: int
    kv_bytes_per_token: int
    context_window: int
    max_batch: int
    slo: SLO
    expected_load_s: float
    profile: str | None = None
    mean_output: tuple[float, int, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "model": self.model, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token, "context_window": self.context_window,
                "max_batch": self.max_batch, "slo": slo_to_dict(self.slo), "expected_load_s": self.expected_load_s,
                "profile": self.profile, "mean_output": self.mean_output}

    @classmethod
    def from_dict(cls, p: Any) -> "NewInstance":
        with malformed("validate_new plan"):
            return cls(text_field(p["instance_id"], "instance_id"), text_field(p["model"], "model"),
                       count_field(p["weight_bytes"], "weight_bytes", 0, MAX_BYTES),
                       count_field(p["kv_bytes_per_token"], "kv_bytes_per_token", 0, MAX_BYTES),
                       count_field(p["context_window"], "context_window", 1),
                       count_field(p["max_batch"], "max_batch", 1, MAX_BATCH), slo_from_dict(p["slo"]),
                       number_field(p["expected_load_s"], "expected_load_s"), opt_text(p.get("profile"), "profile"),
                       mean_output_from(p.get("mean_output")))


@dataclass(frozen=True, slots=True)
class ValidateNew(Request[Verdict]):
    """Would a new instance of the planned model, started now with its cold start, serve
    all of `requests`?"""

    T: ClassVar[str] = "validate_new"
    REPLY: ClassVar[Any] = Verdict
    plan: NewInstance
    requests: list[Probe]

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "plan": self.plan.to_dict(), "requests": [r.to_dict() for r in self.requests]}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "ValidateNew":
        with malformed("validate_new message"):
            return cls(NewInstance.from_dict(m["plan"]),
                       [Probe.from_dict(r) for r in list_field(m.get("requests") or [], "requests")])


@dataclass(frozen=True, slots=True)
class TakeBack(Request[Progress]):
    """Take a running request off the node, not ended, with its progress (preemption 7.1)."""

    T: ClassVar[str] = "take_back"
    REPLY: ClassVar[Any] = Progress
    request_id: str
    why: str = "taken back by the control service"

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "request_id": self.request_id, "why": self.why}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "TakeBack":
        with malformed("take_back message"):
            return cls(text_field(m["request_id"], "request_id"),
                       text_field(m.get("why") or "taken back by the control service", "why"))


@dataclass(frozen=True, slots=True)
class Abort(Request[Ack]):
    """End a request (failed), or cancel its tokenize still under way. Sent without an id:
    no reply (with one, an empty one)."""

    T: ClassVar[str] = "abort"
    REPLY: ClassVar[Any] = Ack
    request_id: str

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "request_id": self.request_id}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "Abort":
        with malformed("abort message"):
            return cls(text_field(m["request_id"], "request_id"))


@dataclass(frozen=True, slots=True)
class WeightsPath(Request[WeightsPathReply]):
    """Where a multicast to the node writes the model's file (mesh.weights.receiver); with a
    manifest (mesh.weights.blocks.Manifest's dict, read by the receiving node), also whether
    the file there already is it."""

    T: ClassVar[str] = "weights_path"
    REPLY: ClassVar[Any] = WeightsPathReply
    model: str
    file: str
    manifest: dict[str, Any] | None = None

    def to_message(self) -> dict[str, Any]:
        out = {TYPE_KEY: self.T, "model": self.model, "file": self.file}
        return out if self.manifest is None else {**out, "manifest": self.manifest}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "WeightsPath":
        with malformed("weights_path message"):
            return cls(text_field(m["model"], "model"), text_field(m["file"], "file"),
                       _opt(m.get("manifest"), object_field, "manifest"))


@dataclass(frozen=True, slots=True)
class WeightsDrop(Request[WeightsDropReply]):
    """Delete the model's received files (the model was deleted)."""

    T: ClassVar[str] = "weights_drop"
    REPLY: ClassVar[Any] = WeightsDropReply
    model: str

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "model": self.model}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "WeightsDrop":
        with malformed("weights_drop message"):
            return cls(text_field(m["model"], "model"))


@dataclass(frozen=True, slots=True)
class Forget(Request[ForgetReply]):
    """The model was deleted: every trace of it on the node goes (its instances are unloaded
    first). An empty model is refused as bad_request."""

    T: ClassVar[str] = "forget"
    REPLY: ClassVar[Any] = ForgetReply
    model: str

    def to_message(self) -> dict[str, Any]:
        return {TYPE_KEY: self.T, "model": self.model}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "Forget":
        with malformed("forget message"):
            return cls(text_field(m.get("model") or "", "model"))


REQUESTS: dict[str, Any] = {r.T: r for r in (
    Hello, Ping, InstanceSpec, Unload, Tokenize, Describe, Admit, Validate, ValidateGroup, ValidateNew, TakeBack,
    Abort, Stats, Shutdown, WeightsPath, WeightsDrop, Forget)}
REPLIES: tuple[Any, ...] = (Ack, Failure, HelloReply, LoadReply, DescribeReply, TokenizeReply, AdmitReply, Verdict,
                            Progress, StatsReply, WeightsPathReply, WeightsDropReply, ForgetReply)


def request_from_message(m: Mapping[str, Any]) -> Request[Any]:
    """The typed request in a message; ProtocolError for an unknown or malformed one."""
    kind = m.get(TYPE_KEY)
    request = REQUESTS.get(kind) if isinstance(kind, str) else None
    if request is None:
        raise ProtocolError(f"unknown message type {shown(kind, 80)}")
    return request.from_message(m)
