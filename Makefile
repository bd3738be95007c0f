# The two commands of the README. Both run the set-up first (idempotent, quick once done):
# it makes the project's own virtual environment .venv from the machine's python3 ($PYTHON
# chooses another) and everything below runs in it, never in the Python it was made from.
.PHONY: setup demo test test-fast bench

VENV := .venv
PY := $(VENV)/bin/python

setup: .setup-done
# The stamp is redone when pyproject.toml or the set-up changes, or .venv is gone.
.setup-done: pyproject.toml scripts/setup.sh $(PY)
	./scripts/setup.sh
	touch .setup-done
$(PY):

# The main job on its embedded default: the service with the demo model, on one CPU node
# agent (and a GPU agent per GPU where CUDA and vLLM are present). Ctrl-C drains and stops.
demo: setup
	MESH_ADMIN_TOKEN=$${MESH_ADMIN_TOKEN:-mesh-admin} $(VENV)/bin/mesh serve --demo --port $${PORT:-8000}

# The whole test suite, slow real-engine tests included (as CI runs it).
test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

bench: setup
	$(VENV)/bin/mesh bench core
