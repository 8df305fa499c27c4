# Two commands do everything on a fresh machine: `make demo` and `make test` (both run `make setup`).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/build/torch_extensions
export DS_ACCELERATOR ?= cpu

.PHONY: setup demo test test-unit test-integration test-gpu docs clean

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

# the GPU tier (one CUDA GPU; the multigpu tests need two): kernels, aggregators, engine and profile on CUDA
test-gpu: setup
	DS_ACCELERATOR=cuda $(PY) -m pytest tests -m "gpu or multigpu"

docs: setup
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf build runs site
