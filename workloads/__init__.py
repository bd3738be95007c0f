"""Workloads for trace replays: Azure trace loaders and workload generation (LLM-Mesh 8.1).

- `load_function_trace`: Azure Functions 2019 per-minute invocation counts.
- `load_lengths`: Azure LLM inference trace 2023 (arrival times, input/output tokens).
- `build_workload`: sampled functions -> model replicas -> seeded, rate-scaled arrivals.
- `bursty_single_model`: one model at the LLM trace's own arrival times.

See docs/workloads.md.
"""
from workloads.azure_functions import FunctionTrace, TraceFormatError, load_function_trace
from workloads.azure_llm import LengthSample, LengthTrace, load_lengths
from workloads.workload import (
    ARRIVAL_DEFINITIONS,
    ARRIVAL_PROCESSES,
    DEFAULT_TARGET_RPS_PER_FUNCTION,
    Arrival,
    Workload,
    build_workload,
    bursty_single_model,
    default_target_rps,
    model_mix_counts,
    rate_scale_for_target,
    sample_functions,
    stochastic_round,
)

__all__ = [
    "ARRIVAL_DEFINITIONS",
    "ARRIVAL_PROCESSES",
    "DEFAULT_TARGET_RPS_PER_FUNCTION",
    "Arrival",
    "FunctionTrace",
    "LengthSample",
    "LengthTrace",
    "TraceFormatError",
    "Workload",
    "build_workload",
    "bursty_single_model",
    "default_target_rps",
    "load_function_trace",
    "load_lengths",
    "model_mix_counts",
    "rate_scale_for_target",
    "sample_functions",
    "stochastic_round",
]
