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
                exact_moves}
                                             -> {} (issued; an `instance` event follows)
    unload     {instance_id}                 -> {}
    tokenize   {instance_id | (model, path, engine, context_window), prompt | messages} -> {ids}
    describe   {model, path, engine, context_window} -> {weight_bytes, kv_bytes_per_token, context_window}
    admit      {requests: [{request_id, instance_id, prompt_token_ids, sampling, age_s, done?, prompt_len?,
                 first_token_age_s?, compute?}]}
                                             -> {results: [{ok, code, reason}]}; `done`: tokens a moved
                                                request produced elsewhere (the last `done` of its ids),
                                                recomputed here; compute=false: memory check only
    validate   {instance_id, request: R, exclude?: [instance ids]} -> {admit, reason}
    validate_group {instance_id, requests: [R]} -> {admit, reason}
    validate_new {plan: {instance_id, model, weight_bytes, kv_bytes_per_token, context_window, max_batch,
                  slo, expected_load_s, profile}, requests: [R]} -> {admit, reason}
               (R = {request_id, prompt_len, max_tokens, age_s, done, first_token_age_s?}: shadow validation)
    take_back  {request_id, why}             -> {request_id, tokens_out, token_ids, first_token_age_s}
                                                (off the node, not ended)
    abort      {request_id}                  (no reply)
    stats      {}                            -> {instances, memory, queue_length, busy_s, ...}
    shutdown   {}                            -> {} (then the agent exits)
    weights_path {model, file, manifest?}    -> {path, complete?} where a multicast to this node writes the
                                                model's file (mesh.weights.node); `load` it from there
    weights_drop {model}                     -> {dropped} delete the model's received files (it was deleted)

Agent -> control (events):
    tokens     {items: [[request_id, [token ids], text], ...]}   one frame per iteration
    done       {request_id, outcome, reason, detail, tokens_out, ttft_s, tpot_s}
    instance   {instance_id, state: "ready" | "failed", error}
    evicted    {request_id, why, tokens_out, token_ids, first_token_age_s}   the memory subsystem evicted it (6.4): place it again

Reply codes when `ok` is false: see Code. Admission results use the same codes.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Mapping

from engines.protocol import Sampling
from mesh import framing
from mesh.framing import MAX_HEADER_BYTES as MAX_FRAME_BYTES  # noqa: F401 - part of this protocol's API
from mesh.framing import ProtocolError, decode_header, encode_frame  # noqa: F401 - likewise
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


class FrameDecoder(framing.FrameDecoder):
    """Incremental decoder for callers that get bytes in arbitrary pieces (tests, tools)."""

    def __init__(self) -> None:
        super().__init__(TYPE_KEY)


# ---- payloads shared by both sides ---------------------------------------------------------

def sampling_to_dict(s: Sampling) -> dict[str, Any]:
    return {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "stop": list(s.stop), "seed": s.seed, "ignore_eos": s.ignore_eos}


def sampling_from_dict(d: Mapping[str, Any]) -> Sampling:
    """ProtocolError on a malformed sampling object (the control service validated it)."""
    try:
        return Sampling(
            max_tokens=int(d["max_tokens"]),
            temperature=float(d.get("temperature", 0.0)),
            top_p=float(d.get("top_p", 1.0)),
            stop=tuple(str(x) for x in d.get("stop") or ()),
            seed=None if d.get("seed") is None else int(d["seed"]),
            ignore_eos=bool(d.get("ignore_eos", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad sampling object {dict(d)!r}: {exc}") from exc


def slo_to_dict(slo: SLO) -> dict[str, float]:
    return {"ttft_min_s": slo.ttft_min_s, "ttft_s_per_prompt_token": slo.ttft_s_per_prompt_token,
            "tpot_s": slo.tpot_s}


def slo_from_dict(d: Mapping[str, Any]) -> SLO:
    try:
        return SLO(float(d["ttft_min_s"]), float(d["ttft_s_per_prompt_token"]), float(d["tpot_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad SLO object {dict(d)!r}: {exc}") from exc


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
    # engines.openvino_engine.EXACT_RECOMPUTE). Off by default: it costs about 2x in prefill and
    # batched decode on the CPU; a moved stream then loses, repeats and reorders nothing, but its
    # continuation may differ at a near-tie (docs/design.md).
    exact_moves: bool = False

    def to_message(self) -> dict[str, Any]:
        return {"t": "load", **asdict(self)}

    @classmethod
    def from_message(cls, m: Mapping[str, Any]) -> "InstanceSpec":
        try:
            spec = cls(
                instance_id=str(m["instance_id"]), model=str(m["model"]), path=str(m["path"]),
                context_window=None if m.get("context_window") is None else int(m["context_window"]),
                slo=dict(m.get("slo") or slo_to_dict(SLO())), max_num_seqs=int(m.get("max_num_seqs", 64)),
                profile=m.get("profile"), engine=str(m.get("engine", "openvino")),
                expected_load_s=None if m.get("expected_load_s") is None else float(m["expected_load_s"]),
                exact_moves=bool(m.get("exact_moves", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad load message: {exc}") from exc
        slo_from_dict(spec.slo)
        return spec
