"""`mesh` subcommands, one module each; every module has `register(subparsers)`."""
from __future__ import annotations

import argparse
import importlib


def register_all(sub: argparse._SubParsersAction, package: str, names: list[str]) -> None:
    """Import `package.<name>` for each name and let it register its parser. A module not
    written yet is skipped; an import error inside a module is not hidden."""
    for name in names:
        try:
            module = importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
            continue
        module.register(sub)
