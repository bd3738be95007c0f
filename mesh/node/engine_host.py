"""Engines in an agent: which engine serves an instance, and the iteration times the node's
compute subsystem predicts for it.

CPU agents run OpenVINO instances, each in its own worker process
(`mesh.engines.openvino_process.OpenVINOProcessEngine`: OpenVINO's step holds the GIL, and in
the agent's process it would hold up every admission, validation and ping for the whole
iteration); GPU agents run vLLM instances, also each in a worker (`mesh.engines.vllm_engine`).
`make_engine` picks the factory by `InstanceSpec.engine`. Both report the end of a load to
a callback, so the agent can tell the control service when the instance is ready or failed.

Iteration times (`iteration_times`): a calibration profile (`mesh.perf.profile`)
when the load message names one; otherwise `mesh.perf.times.DefaultCpuTimes`. Both are
wrapped in `mesh.perf.times.AdaptiveTimes`, which corrects them with the iteration times
the node really sees (the agent feeds it the node's iteration records).
"""
from __future__ import annotations

import os
from typing import Any, Callable

from mesh.engines.engine_api import EngineError
from mesh.perf.model import PerformanceModel
from mesh.perf.profile import ProfileError, load_profile
from mesh.perf.times import AdaptiveTimes, DefaultCpuTimes
from mesh.wire.agent_protocol import InstanceSpec

LoadCallback = Callable[[BaseException | None], None]


def _make_openvino(spec: InstanceSpec, on_loaded: LoadCallback) -> Any:
    """An OpenVINO instance computing in its own worker process (mesh.engines.openvino_process):
    the agent's event loop answers the dispatcher while the instance computes."""
    from mesh.engines.openvino_engine import EXACT_RECOMPUTE
    from mesh.engines.openvino_process import OpenVINOProcessEngine

    properties: dict[str, Any] = dict(EXACT_RECOMPUTE) if spec.exact_moves else {}
    # OpenVINO pins its compute threads to cores by default (ENABLE_CPU_PINNING): on cores
    # shared with other work (the service, the tokenizer, other tenants' processes), a pinned
    # thread waits for its core while another is free, and every barrier of the iteration
    # waits for it. Unpinned, the kernel moves it within the node's core set (docs/benchmarking.md).
    properties["ENABLE_CPU_PINNING"] = False
    cores = len(os.sched_getaffinity(0))
    if cores < (os.cpu_count() or cores):  # an agent pinned to its share (--cpus): as many threads as cores
        properties["INFERENCE_NUM_THREADS"] = cores
    return OpenVINOProcessEngine(spec.path, model_name=spec.model, context_window=spec.context_window,
                                 max_num_seqs=spec.max_num_seqs, properties=properties, on_loaded=on_loaded)


def _make_vllm(spec: InstanceSpec, on_loaded: LoadCallback) -> Any:
    """A vLLM instance (mesh.engines.vllm_engine): its own worker process, stepped by this agent's
    node runtime; the device comes from the installed vLLM build ($MESH_VLLM_DEVICE wins;
    a GPU agent's CUDA_VISIBLE_DEVICES pins its GPU). `on_loaded` fires once the engine is
    built, which happens in the KV resize the node runtime issues right after the load."""
    from mesh.engines.vllm_engine import create

    return create(spec.path, model_name=spec.model, context_window=spec.context_window,
                  max_num_seqs=spec.max_num_seqs, on_loaded=on_loaded)


# Engine name -> factory(spec, on_loaded) -> an mesh.engines.engine_api.Engine. GPU agents add "vllm".
ENGINE_FACTORIES: dict[str, Callable[[InstanceSpec, LoadCallback], Any]] = {
    "openvino": _make_openvino,
    "vllm": _make_vllm,
}


def make_engine(spec: InstanceSpec, on_loaded: LoadCallback) -> Any:
    """The engine for one instance; EngineError says what is wrong with the spec."""
    factory = ENGINE_FACTORIES.get(spec.engine)
    if factory is None:
        raise EngineError(f"unknown engine {spec.engine!r}; known: {', '.join(sorted(ENGINE_FACTORIES))}")
    return factory(spec, on_loaded)


def iteration_times(spec: InstanceSpec, weight_bytes: int) -> AdaptiveTimes:
    """The instance's predicted iteration times: its profile if given, else the default."""
    if spec.profile:
        try:
            return AdaptiveTimes(PerformanceModel(load_profile(spec.profile)))
        except ProfileError as exc:
            raise EngineError(f"cannot use profile {spec.profile}: {exc}") from exc
    return AdaptiveTimes(DefaultCpuTimes.for_weights(weight_bytes))
