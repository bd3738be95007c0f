"""The `mesh` command line. Each subcommand lives in mesh.commands.<name>."""
from __future__ import annotations

import argparse
import sys

from mesh.commands import register_all

# Subcommand modules, in the order `mesh --help` lists them.
COMMANDS = ["replay", "bench", "info", "calibrate", "models", "serve"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    register_all(sub, "mesh.commands", COMMANDS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
