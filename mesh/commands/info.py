"""`mesh info`: this machine's CPU, matrix extensions, OpenVINO precisions and vLLM."""
from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="show CPU, AMX, OpenVINO and vLLM details")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mesh.hardware import hardware_report  # imports openvino: only when asked

    report = hardware_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    ov, vllm = report["openvino"], report["vllm"]
    rows = [
        ("CPU", report["cpu"]),
        ("cores", str(report["cores"])),
        ("AMX", "yes" if report["amx"] else "no"),
        ("matrix extensions", " ".join(report["matrix_extensions"]) or "none"),
        ("OpenVINO", ov["version"] or f"unavailable ({ov['error']})"),
        ("  capabilities", " ".join(ov["optimization_capabilities"]) or "-"),
        ("  inference precision", ov["inference_precision"] or "-"),
        ("  KV cache precision", ov["kv_cache_precision"] or "-"),
        ("vLLM", f"{vllm['version'] or '?'} ({vllm['device'] or '?'})" if vllm["installed"]
         else "not installed"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
