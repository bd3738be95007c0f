"""`mesh bench replay`: wall time of a trace replay, per policy.

The target: a 30-minute, 128-function Llama-2-7B replay on 4 CPU + 4 GPU nodes
finishes in at most 60 s of wall time per policy on a 2-core machine. Also reported: the
simulated iterations per wall second and the shadow validations made.
"""
from __future__ import annotations

import argparse
import time

from mesh.bench.report import emit
from mesh.commands.replay import DEFAULT_POLICIES, configure
from mesh.commands.replay import register as register_replay
from mesh.replay.driver import run_policy

TARGET_WALL_S = 60.0


def run(argv: list[str], policies: list[str]) -> dict[str, float | str]:
    parser = argparse.ArgumentParser(prog="mesh bench replay")
    register_replay(parser.add_subparsers())
    args = parser.parse_args(["replay", "--no-progress", *argv])
    setup = configure(args)
    out: dict[str, float | str] = {"requests": len(setup["workload"])}
    for name in policies:
        cpu0 = time.process_time()
        result = run_policy(setup["workload"], name, setup["config"], setup["catalog"], setup["prior"])
        iterations = sum(n.iterations for n in result.nodes)
        out[f"{name}_wall_s"] = result.wall_s
        out[f"{name}_cpu_s"] = time.process_time() - cpu0
        out[f"{name}_iterations_per_s"] = iterations / result.wall_s
        out[f"{name}_validations"] = result.policy_stats.validations
        out[f"{name}_meets_target"] = "yes" if result.wall_s <= TARGET_WALL_S else "no"
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay",
                       help=f"replay wall time per policy (target <= {TARGET_WALL_S:g} s for 128 x 7B, 30 min)")
    p.add_argument("--functions", type=int, default=128)
    p.add_argument("--minutes", type=int, default=30)
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=lambda a: emit(
        f"mesh bench replay ({a.functions} functions x {a.minutes} min, {a.model})",
        run(["--functions", str(a.functions), "--minutes", str(a.minutes), "--model", a.model, "--seed", str(a.seed)],
            [x.strip() for x in a.policies.split(",") if x.strip()]),
        a.json,
    ))
