# Two commands do everything on a fresh machine: `make demo` and `make test` (both run `make setup`).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/build/torch_extensions
export DS_ACCELERATOR ?= cpu

.PHONY: setup demo test test-unit test-integration docs clean

setup:
	@bash scripts/setup.sh

demo: setup
	@bash launch/demo.sh

test: setup
	$(PY) -m pytest tests

test-unit: setup
	$(PY) -m pytest tests/unit

test-integration: setup
	$(PY) -m pytest tests/integration

docs: setup
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf build runs site
