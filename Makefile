# Two commands do everything on a fresh machine: `make demo` and `make test` (both run `make setup`).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/build/torch_extensions
export DS_ACCELERATOR ?= cpu

.PHONY: setup demo test test-unit test-integration test-wheel test-compat test-gpu wheel docs clean

# The oldest DeepSpeed release of the supported range (pyproject.toml): `make test` runs the DeepSpeed-facing
# tests against it after the main suite (the newest, in .venv, is what the main suite runs with)
DEEPSPEED_OLDEST := 0.16.9
DEEPSPEED ?= $(DEEPSPEED_OLDEST)

setup:
	@bash scripts/setup.sh

demo: setup
	@bash launch/demo.sh

test: setup
	$(PY) -m pytest tests --durations=25
	$(PY) -m tests.wheel.check_wheel
	VENV=$(VENV) bash scripts/test_compat.sh $(DEEPSPEED_OLDEST)

test-unit: setup
	$(PY) -m pytest tests/unit

test-integration: setup
	$(PY) -m pytest tests/integration

# the sdist and the wheel built, checked and installed into a fresh venv that runs a smoke test (part of `make test`)
test-wheel: setup
	$(PY) -m tests.wheel.check_wheel

# the DeepSpeed-facing tests (tests/deepspeed_facing.txt) against DeepSpeed $(DEEPSPEED), in a second venv
# build/compat-$(DEEPSPEED)/ built once (its DeepSpeed, the rest from .venv); `make test` runs it for the oldest
test-compat: setup
	VENV=$(VENV) bash scripts/test_compat.sh $(DEEPSPEED)

# the GPU tier (one CUDA GPU; the multigpu tests need two): kernels, aggregators, engine and profile on CUDA,
# in parallel with pytest-xdist where it is installed (one GPU, many workers; tests sharing a module fixture
# stay on one worker by xdist_group), else sequentially
test-gpu: setup
	DS_ACCELERATOR=cuda $(PY) -m pytest tests/gpu -m "gpu or multigpu" \
		$$($(PY) -c "import xdist" 2>/dev/null && echo "-n auto --dist loadgroup")

# dist/pdv_ext-VERSION.tar.gz and dist/pdv_ext-VERSION-py3-none-any.whl (`pip install dist/pdv_ext-*.whl`)
wheel: setup
	$(PY) -m build --outdir dist .

docs: setup
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf build runs site dist
