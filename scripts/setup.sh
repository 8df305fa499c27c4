#!/usr/bin/env bash
# One-shot, idempotent set-up of everything pdv_ext needs on a fresh machine:
# system packages (Open MPI, g++, ninja, cmake) through apt when missing, a .venv with the pinned
# CPU torch, DeepSpeed, mpi4py, Horovod (PyTorch + Gloo + MPI), test tools, and pdv_ext itself (editable).
# GPU users: create .venv and install your CUDA torch into it first; an importable torch is kept.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
VENV="${VENV:-$ROOT/.venv}"
TORCH_VERSION="${PDV_TORCH_VERSION:-2.13.0}"
HOROVOD_VERSION="${PDV_HOROVOD_VERSION:-0.28.1}"
log() { printf '[setup] %s\n' "$*"; }

# --- system packages -------------------------------------------------------------------------------
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || need+=(libopenmpi-dev)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v make >/dev/null 2>&1 || need+=(make)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v tc >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    log "missing system packages: ${need[*]} (not root or no apt-get): install them and re-run"
    exit 1
  fi
fi

# --- virtual environment ---------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=(pip_quiet "$PY" -m pip install -q --disable-pip-version-check)
# pip's notes about unreachable local indexes of some machines are noise here
pip_quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
export TORCH_EXTENSIONS_DIR="$ROOT/build/torch_extensions"
mkdir -p "$TORCH_EXTENSIONS_DIR"

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  log "installing torch==$TORCH_VERSION (CPU wheel on this platform)"
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
py_has() { "$PY" -c "import $1" >/dev/null 2>&1; }
if ! py_has deepspeed || ! py_has mpi4py || ! py_has sklearn || ! py_has pytest_timeout || ! py_has mkdocs || ! py_has triton \
   || ! py_has build; then
  log "installing deepspeed, mpi4py and tools"
  "${PIP[@]}" -r "$ROOT/requirements-dev.txt"
fi

# --- Horovod (PyTorch + Gloo + MPI), built with C++17 ---------------------------------------------
if ! "$PY" -c "import horovod.torch" >/dev/null 2>&1 && [ "${PDV_SKIP_HOROVOD:-0}" != 1 ]; then
  log "building horovod==$HOROVOD_VERSION (a few minutes the first time; pip caches the wheel)"
  HOROVOD_CMAKE="$ROOT/scripts/horovod_cmake.sh" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
  HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 MAKEFLAGS=-j2 \
    "${PIP[@]}" --no-build-isolation "horovod[pytorch]==$HOROVOD_VERSION" \
    > "$ROOT/build/horovod-build.log" 2>&1 || { tail -40 "$ROOT/build/horovod-build.log"; exit 1; }
fi

# --- pdv_ext itself ---------------------------------------------------------------------------------
# pyproject.toml is read by the venv's own setuptools (no build isolation): it needs >= 77 (PEP 639 license)
if ! "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" >/dev/null 2>&1; then
  log "upgrading setuptools (>= 77 reads pyproject.toml's license fields)"
  "${PIP[@]}" "setuptools>=77"
fi
# (re-)install when missing, when pyproject.toml changed, or when the installed metadata's version is not
# pdv_ext.__version__ (the one place the version is written)
if ! "$PY" -c "import sys, pdv_ext, importlib.metadata as m; sys.exit(m.version('pdv_ext') != pdv_ext.__version__)" \
     >/dev/null 2>&1 || [ pyproject.toml -nt "$VENV/.pdv-installed" ]; then
  log "installing pdv_ext (editable)"
  "${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"
  touch "$VENV/.pdv-installed"
fi
# JIT ops built here once, not by ranks racing under a test's timeout (and a killed build's lock cleared)
"$PY" -c "from pdv_ext import kernels; r = kernels.prebuild_jit_ops(log=lambda m: print('[setup]', m)); [print(f'[setup] JIT op {k}: {v}') for k, v in r.items() if v != 'built']"
log "ready: $("$PY" -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)' 2>/dev/null)"
