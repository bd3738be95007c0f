"""The formats a model comes in, the engine that runs each, and how one becomes another.

A tenant registers one format: a GGUF file or an OpenVINO IR folder (CPU nodes, OpenVINO) or
a Hugging Face folder (GPU nodes, vLLM). `CONVERSIONS` says, for each registered format,
which other kind of node can run it once converted, and by which `mesh.modelfiles.convert`
subcommand; the service runs them in the background (mesh.service.preparation).
"""
from __future__ import annotations

from dataclasses import dataclass

from mesh.policy.dispatch_rules import CPU, GPU

FORMAT_NAMES = {"gguf": "GGUF file", "ir": "OpenVINO IR folder", "hf": "Hugging Face folder",
                "emulated": "emulated model"}
ENGINE_OF_KIND = {CPU: "openvino", GPU: "vllm"}  # CPU nodes run OpenVINO, GPU nodes vLLM
# An emulated model (`mesh serve --emulate`, mesh.engines.emulation): a catalog name, no file; it
# runs on emulated nodes of both kinds, on the emulated engine, and is never converted.
EMULATED = "emulated"


# The request fields beyond plain sampling (mesh.engines.engine_api.Sampling.features) each
# engine honours: a request that uses one goes only to nodes whose engine honours it (the
# dispatcher), and where no kind of the cluster can serve it the service answers 400.
# OpenVINO GenAI gives only the chosen token's log probability, so alternatives
# (`top_logprobs`) are vLLM's alone. LoRA adapters (`adapter`: a request to an adapter registered
# on a base) run on OpenVINO only, from a base's IR folder (mesh.engines.openvino_adapters).
_SAMPLING_FEATURES = frozenset({"logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                "response_format"})
ENGINE_FEATURES: dict[str, frozenset[str]] = {
    "openvino": _SAMPLING_FEATURES | {"adapter"},
    "vllm": _SAMPLING_FEATURES | {"top_logprobs"},
    EMULATED: frozenset(),
}


def unhonoured(engine: str, features: frozenset[str]) -> frozenset[str]:
    """The `features` a request uses that `engine` cannot honour (empty: it can serve it)."""
    return features - ENGINE_FEATURES.get(engine, frozenset())


def engine_for(model_kind: str, node_kind: str) -> str:
    """The engine a node of `node_kind` runs a model registered as `model_kind` with."""
    return EMULATED if model_kind == EMULATED else ENGINE_OF_KIND[node_kind]


@dataclass(frozen=True, slots=True)
class Conversion:
    """How a registered format becomes the format another kind of node runs."""

    source: str  # the registered format
    node_kind: str  # the kind of node the result runs on
    format: str  # the result's format
    command: str | None  # the mesh.modelfiles.convert subcommand; None: not built (`missing` says why)
    missing: str = ""


CONVERSIONS: dict[str, Conversion] = {
    "gguf": Conversion("gguf", GPU, "hf", "gguf-to-hf"),
    "hf": Conversion("hf", CPU, "ir", "hf-to-ir"),
    "ir": Conversion("ir", GPU, "hf", None, "nothing converts an OpenVINO IR folder into a format vLLM loads"),
}
