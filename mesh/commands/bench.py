"""`mesh bench <name>`: benchmarks that print their figures (and write JSON with --json)."""
from __future__ import annotations

import argparse

from mesh.commands import register_all

# Benchmark modules in mesh.bench, each with `register(subparsers)` (which names its subcommand).
BENCHES = ["adapter_turns",
           "closed_loop", "coldstart", "control_plane", "core", "fidelity", "engine", "interference", "learning",
           "many_models",
           "live_scale_out", "weights_multicast", "emulated_weights",
           "replay_speed", "serve_load", "soak", "tokens"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run a benchmark and print its figures")
    benches = parser.add_subparsers(dest="bench", required=True)
    register_all(benches, "mesh.bench", BENCHES)
