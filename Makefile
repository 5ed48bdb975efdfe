# Each target creates .venv when missing and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: run test bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

## The main job on the embedded default (host DRAM + SSD directory; no Redis, no server).
run: $(STAMP)
	$(PY) -m kvstore demo

## Every test.
test: $(STAMP)
	$(PY) -m pytest -q

## Tier benchmarks, each figure beside the limit measured in the same run.
bench: $(STAMP)
	$(PY) -m kvstore bench tiers

lint: $(STAMP)
	$(PY) -m compileall -q kvstore tiers connector tests

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
