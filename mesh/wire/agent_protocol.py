"""The node agent protocol: length-prefixed JSON frames over a byte stream.

Transport: any reliable byte stream (TCP on loopback for the embedded agent, TCP across
machines, or a Unix socket), framed by mesh.framing: each frame is a 4-byte big-endian
unsigned length followed by that many bytes of UTF-8 JSON holding one object (a message); this
protocol has no payloads. Frames longer than MAX_FRAME_BYTES are a protocol error and close
the connection.

Every message has a type `t`. The control service sends requests; a request that carries
an integer `id` gets exactly one reply `{"t": "reply", "re": id, "ok": true, ...}` or
`{"t": "reply", "re": id, "ok": false, "code": ..., "error": ...}`; a request without `id`
(abort) gets none. The agent also sends events on its own (tokens, done, instance).

Control -> agent (see docs/service.md for every field):
    hello      {token, protocol}             -> {node_id, kind, memory_bytes, cpu, pid, instances,
                                                 weights: {address, dir} | null}
    ping       {}                            -> {}
    load       {instance_id, model, path, context_window, slo, max_num_seqs, profile, engine, expected_load_s,
                exact_moves, mean_output, emulated_load_s}
                                             -> {} (issued; an `instance` event follows)
    unload     {instance_id}                 -> {}
    tokenize   {instance_id | (model, path, engine, context_window), prompt | messages, request_id?, tenant?}
                                             -> {ids}; OpenVINO prompts wait in a queue that takes the
                                                tenants in turn; `abort {request_id}` cancels it (dropped
                                                from the queue if it has not run)
    describe   {model, path, engine, context_window, max_num_seqs?, exact_moves?}
               -> {weight_bytes, kv_bytes_per_token, context_window, vocab_size (null: unknown)}
               (an OpenVINO model is then built with those load settings and parked: mesh.node.park_ahead)
    admit      {requests: [{request_id, instance_id, prompt_token_ids, sampling, age_s, done?, prompt_len?,
                 first_token_age_s?, compute?, late_s?}]}
                                             -> {results: [{ok, code, reason}]}; `done`: tokens a moved
                                                request produced elsewhere (the last `done` of its ids),
                                                recomputed here; compute=false: memory check only
    validate   {instance_id, request: R, exclude?: [instance ids]} -> {admit, reason}
    validate_group {instance_id, requests: [R]} -> {admit, reason}
    validate_new {plan: {instance_id, model, weight_bytes, kv_bytes_per_token, context_window, max_batch,
                  slo, expected_load_s, profile}, requests: [R]} -> {admit, reason}
               (R = {request_id, prompt_len, max_tokens, age_s, done, first_token_age_s?, late_s?}: shadow
                validation; age_s: seconds since it arrived (>= 0); late_s: how late it is served
                (placement.SERVE_LATE: its deadlines start when its loading instance is ready))
    take_back  {request_id, why}             -> {request_id, tokens_out, token_ids, first_token_age_s}
                                                (off the node, not ended)
    abort      {request_id}                  (no reply) the request, or its tokenize still under way
    stats      {}                            -> {instances, memory, queue_length, busy_s, ...}
    shutdown   {}                            -> {} (then the agent exits)
    weights_path {model, file, manifest?}    -> {path, complete?} where a multicast to this node writes the
                                                model's file (mesh.weights.receiver); `load` it from there
    weights_drop {model}                     -> {dropped} delete the model's received files (it was deleted)

Agent -> control (events):
    tokens     {items: [[request_id, [token ids], text], ...]}   one frame per iteration
    done       {request_id, outcome, reason, detail, tokens_out, ttft_s, tpot_s}
    instance   {instance_id, state: "ready" | "failed", error}
    evicted    {request_id, why, tokens_out, token_ids, first_token_age_s, fault?}   the memory subsystem evicted it (6.4),
               or (fault: true) the engine watchdog failed its instance: place it again
    node       {stepping, budget_bytes}      what the dispatcher reads of the node between calls, sent when it
                                             changed, after the frames of the iteration that ended: the
                                             instance whose iteration is in flight (null: none) and the memory
                                             budget in use (the reservation station's, 6.3)

Reply codes when `ok` is false: see Code. Admission results use the same codes.

Typed at the boundary (the dataclasses at the end of this module): the events (TokensEvent,
DoneEvent, InstanceEvent, EvictedEvent, NodeEvent), a request off its node (Progress), a request as
shadow validation sees it (Probe, the R above), an admit entry (AdmitEntry) and `load`
(InstanceSpec). Each is built by its sender and read back by its receiver with
`from_message`/`from_dict`, which raise ProtocolError on a malformed message.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, ClassVar, Mapping, Union

from mesh.engines.detokenize import MAX_STOP_CHARS
from mesh.engines.engine_api import Sampling
from mesh import framing
from mesh.framing import MAX_HEADER_BYTES as MAX_FRAME_BYTES  # noqa: F401 - part of this protocol's API
from mesh.framing import ProtocolError, decode_header, encode_frame  # noqa: F401 - likewise
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


def decode_body(body: bytes) -> dict[str, Any]:
    """The message in a frame body; ProtocolError unless it is a JSON object with a type."""
    return decode_header(body, TYPE_KEY)


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


# ---- bounds every field is checked against (issue 32) ----------------------------------------
# A message that decodes may still carry hostile values (a count of 10^25, an age of 1e308, NaN
# from a codec that writes it): each parser below refuses a value outside these bounds with a
# ProtocolError, answered as `protocol`, before it reaches the node's state.
MAX_COUNT = 2**31 - 1  # token ids, token counts, lengths, windows, batch sizes
MAX_BYTES = 2**50  # memory sizes
MAX_SECONDS = 7 * 86400.0  # ages and durations (no request lives a week)
MAX_STOPS = 16  # stop strings of one request (the service lets a tenant give 4)
MAX_BATCH = 1 << 16  # max_num_seqs, max_batch


def count_field(value: Any, name: str, low: int = 0, high: int = MAX_COUNT) -> int:
    """An integer field in [low, high]; a float that is an integer counts (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value:.6g}")
    return int(value)


def number_field(value: Any, name: str, low: float = 0.0, high: float = MAX_SECONDS) -> float:
    """A finite number field in [low, high] (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r:.40}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value:.6g}")
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

def sampling_to_dict(s: Sampling) -> dict[str, Any]:
    return {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "stop": list(s.stop), "seed": s.seed, "ignore_eos": s.ignore_eos}


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
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"bad sampling object: {exc}") from exc


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
        raise ProtocolError(f"bad mean_output {state!r:.80}: (prior, count, total) expected: {exc}") from exc


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What an agent needs to start one model instance (the `load` message)."""

    instance_id: str
    model: str  # the model's global id (registry uid); also the engine's model_name
    path: str  # GGUF file or OpenVINO IR folder, as the agent's machine sees it
    context_window: int | None = None  # None: the engine's default
    slo: dict[str, float] = field(default_factory=lambda: slo_to_dict(SLO()))
    max_num_seqs: int = 64
    profile: str | None = None  # a calibration profile file for the iteration times
    engine: str = "openvino"  # "openvino" (CPU); "vllm" comes with GPU agents (issue 6)
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
        return {"t": "load", **asdict(self)}

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

def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


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

    @classmethod
    def from_dict(cls, m: Mapping[str, Any]) -> "Progress":
        try:
            ids = _token_ids(m.get("token_ids") or [], "token_ids")
            return cls(str(m["request_id"]), count_field(m.get("tokens_out") or len(ids), "tokens_out"), ids,
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
            raise ProtocolError(f"bad request entry {m!r}: {exc}") from exc


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
    """Tokens of one iteration: (request id, token ids, text) per request."""

    T: ClassVar[str] = "tokens"
    items: list[tuple[str, list[int], str]]

    def to_message(self) -> dict[str, Any]:
        return {"t": self.T, "items": [list(item) for item in self.items]}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "TokensEvent":
        try:
            return cls([(str(rid), [int(x) for x in ids or ()], str(text or "")) for rid, ids, text in m["items"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad tokens event: {exc}") from exc


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
        return {"t": self.T, **asdict(self)}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "DoneEvent":
        try:
            return cls(str(m["request_id"]), str(m.get("outcome") or "failed"),
                       None if m.get("reason") is None else str(m["reason"]), str(m.get("detail") or ""),
                       int(m.get("tokens_out") or 0), _opt_float(m.get("ttft_s")), _opt_float(m.get("tpot_s")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad done event: {exc}") from exc


@dataclass(frozen=True, slots=True)
class InstanceEvent:
    """An instance finished loading (`ready`: engine loaded and KV cache sized) or failed."""

    T: ClassVar[str] = "instance"
    instance_id: str
    state: str  # "ready" | "failed"
    error: str = ""
    loaded_from: str = ""  # ready: where the engine read the model from ("gguf", "prepared", "ir"; "" unknown)

    def to_message(self) -> dict[str, Any]:
        out = {"t": self.T, "instance_id": self.instance_id, "state": self.state}
        if self.loaded_from:
            out["loaded_from"] = self.loaded_from
        return {**out, "error": self.error} if self.error else out

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "InstanceEvent":
        try:
            return cls(str(m["instance_id"]), str(m["state"]), str(m.get("error") or ""),
                       str(m.get("loaded_from") or ""))
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"bad instance event: {exc}") from exc


@dataclass(frozen=True, slots=True)
class EvictedEvent:
    """The node's memory subsystem evicted a running request (6.4), progress kept: place it
    again (no `done` follows)."""

    T: ClassVar[str] = "evicted"
    why: str
    progress: Progress
    fault: bool = False  # the node failed it (a hung engine): its deadlines restart where it resumes

    def to_message(self) -> dict[str, Any]:
        return {"t": self.T, "why": self.why, **self.progress.to_dict(), **({"fault": True} if self.fault else {})}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "EvictedEvent":
        return cls(str(m.get("why") or "evicted"), Progress.from_dict(m), m.get("fault") is True)


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
        return {"t": self.T, "stepping": self.stepping, "budget_bytes": self.budget_bytes}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "NodeEvent":
        stepping = m.get("stepping")
        if stepping is not None and not isinstance(stepping, str):
            raise ProtocolError(f"bad node event: stepping {stepping!r}")
        try:
            return cls(stepping, int(m["budget_bytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad node event: {exc}") from exc


Event = Union[TokensEvent, DoneEvent, InstanceEvent, EvictedEvent, NodeEvent]
EVENTS: dict[str, type] = {e.T: e for e in (TokensEvent, DoneEvent, InstanceEvent, EvictedEvent, NodeEvent)}


def event_from_message(m: Mapping[str, Any]) -> Event:
    """The typed event in an agent's message; ProtocolError for an unknown or malformed one."""
    kind = EVENTS.get(str(m.get("t")))
    if kind is None:
        raise ProtocolError(f"unknown event {m.get('t')!r}")
    return kind.from_message(m)
