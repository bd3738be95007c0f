# The two commands of the README. Both run the set-up first (idempotent, quick once done).
.PHONY: setup demo test test-fast bench

setup: .setup-done
.setup-done: pyproject.toml scripts/setup.sh
	./scripts/setup.sh
	touch .setup-done

# The main job on its embedded default: the service with the demo model, on one CPU node
# agent (and a GPU agent per GPU where CUDA and vLLM are present). Ctrl-C drains and stops.
demo: setup
	MESH_ADMIN_TOKEN=$${MESH_ADMIN_TOKEN:-mesh-admin} mesh serve --demo --port $${PORT:-8000}

# The whole test suite, slow real-engine tests included (as CI runs it).
test: setup
	python3 -m pytest

test-fast: setup
	python3 -m pytest -m "not slow"

bench: setup
	mesh bench core
