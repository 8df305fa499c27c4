#!/usr/bin/env bash
# `make test-compat DEEPSPEED=X.Y.Z`: the DeepSpeed-facing tests (the list in tests/deepspeed_facing.txt)
# against another DeepSpeed release, in a second virtual environment build/compat-X.Y.Z/.
#
# That environment holds only `deepspeed==X.Y.Z` (and any dependency of it that the main .venv lacks or
# holds in a version it refuses); everything else - torch 2.13.0 CPU, pydantic, pytest, ... - comes from
# the main .venv, whose site-packages a .pth file puts on sys.path *after* its own (so its DeepSpeed wins).
# pdv_ext itself runs from this checkout (PYTHONPATH). Built once and reused: build/compat-X.Y.Z/.ready
# records what it was built against and is checked on every run; `rm -rf build/compat-X.Y.Z` rebuilds.
# JIT-built ops (DeepSpeed's shm op, pdv's CPU kernels) get their own cache in the environment, so that two
# DeepSpeed versions never rebuild each other's op in one shared folder.
#
#   scripts/test_compat.sh X.Y.Z [pytest args...]     (PDV_COMPAT_BUILD_ONLY=1: build, run nothing)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
DS_VERSION="${1:?usage: scripts/test_compat.sh DEEPSPEED_VERSION [pytest args...]}"
shift
MAIN_VENV="$(cd "${VENV:-.venv}" && pwd)"
MAIN_PY="$MAIN_VENV/bin/python"
ENV_DIR="$ROOT/build/compat-$DS_VERSION"
PY="$ENV_DIR/bin/python"
LIST="$ROOT/tests/deepspeed_facing.txt"
log() { printf '[test-compat %s] %s\n' "$DS_VERSION" "$*"; }
pip_quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
t0=$SECONDS

[ -x "$MAIN_PY" ] || { log "no main virtual environment at $MAIN_VENV: run \`make setup\` first"; exit 1; }
MAIN_SITE="$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
export TORCH_EXTENSIONS_DIR="$ENV_DIR/torch_extensions"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
stamp="deepspeed=$DS_VERSION main_site=$MAIN_SITE"

# --- the environment (cached) ----------------------------------------------------------------------
ready() {
  [ -x "$PY" ] && [ "$(cat "$ENV_DIR/.ready" 2>/dev/null)" = "$stamp" ] && "$PY" - "$DS_VERSION" "$ENV_DIR" <<'EOF' >/dev/null 2>&1
import sys, importlib.metadata as md, deepspeed, torch, pdv_ext
assert md.version("deepspeed") == sys.argv[1] and deepspeed.__file__.startswith(sys.argv[2]), deepspeed.__file__
EOF
}
if ready; then
  log "environment $ENV_DIR ready (cached)"
else
  log "building $ENV_DIR"
  rm -rf "$ENV_DIR"
  mkdir -p "$(dirname "$ENV_DIR")"
  # the same interpreter as the main environment (torch's wheel there is built for it)
  "$("$MAIN_PY" -c 'import sys; print(sys._base_executable)')" -m venv --without-pip "$ENV_DIR"
  SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # pip (and setuptools, for DeepSpeed's sdist) from the main environment: `python -m pip` with the
  # .pth below in place; first DeepSpeed alone (its sdist built with the main environment's torch and
  # setuptools: DS_ACCELERATOR=cpu makes its setup.py import torch)
  PIP=(pip_quiet "$PY" -m pip install -q --disable-pip-version-check --no-warn-script-location)
  PYTHONPATH="$MAIN_SITE" "${PIP[@]}" --no-deps --ignore-installed --no-build-isolation "deepspeed==$DS_VERSION"
  printf '%s\n' "$MAIN_SITE" > "$SITE/zz-main-venv.pth"
  # dependencies of this DeepSpeed: those the main environment satisfies stay there, the rest land here
  "${PIP[@]}" "deepspeed==$DS_VERSION"
  # JIT ops built once here, not by ranks racing under a test's timeout
  (cd "$ENV_DIR" && "$PY" -c "
from pdv_ext import kernels
r = kernels.prebuild_jit_ops(log=lambda m: print('[test-compat]', m))
[print(f'[test-compat] JIT op {k}: {v}') for k, v in r.items() if v != 'built']") || true
  echo "$stamp" > "$ENV_DIR/.ready"
  ready || { log "the environment does not import deepspeed $DS_VERSION from $ENV_DIR"; exit 1; }
  log "built in $((SECONDS - t0)) s"
fi
log "$("$PY" -c 'import torch, deepspeed, pydantic; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "pydantic", pydantic.__version__)' 2>/dev/null | tail -1)"
[ "${PDV_COMPAT_BUILD_ONLY:-0}" = 1 ] && exit 0

# --- the DeepSpeed-facing tests --------------------------------------------------------------------
# one path or glob a line; '#' starts a comment; a plain path that is missing is an error (the list must
# follow renames), a glob may match nothing
tests=()
while read -r entry; do
  entry="${entry%%#*}"; entry="${entry//[[:space:]]/}"
  [ -n "$entry" ] || continue
  if [[ "$entry" == *[\*\?\[]* ]]; then
    for f in $entry; do [ -e "$f" ] && tests+=("$f"); done
  elif [ -e "$entry" ]; then
    tests+=("$entry")
  else
    log "$LIST names $entry, which does not exist"; exit 1
  fi
done < "$LIST"
# an empty list would let pytest run the whole suite (testpaths)
[ ${#tests[@]} -gt 0 ] || { log "$LIST lists no test file"; exit 1; }
t1=$SECONDS
rc=0
"$PY" -m pytest "${tests[@]}" "$@" || rc=$?
log "tests took $((SECONDS - t1)) s, $((SECONDS - t0)) s in all (exit $rc)"
exit $rc
