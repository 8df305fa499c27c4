#!/usr/bin/env bash
# Everything issue #20 asks to measure on a GPU, in one command (a lent GPU machine costs a minute per start):
# the kernels' GB/s beside the device copy's, the profile's predicted vs measured step, and the GPU tier of
# the tests - in that order, so that a run cut short by the machine's per-command limit still has the
# figures. Outputs go to $OUT (default ./build/gpu-check): kernels.json, profile.json, pytest.log, their logs
# (*.err, each line with its time) and clocks.csv (the card's clocks and power every 0.5 s).
#   make test-gpu / a machine with the project's .venv:   bash scripts/gpu_check.sh
#   a lent GPU machine without the venv, carrying the prepared .gpu/ wheels (docs/kernels.md):
#       source .gpu/device-setup.sh && bash scripts/gpu_check.sh
#   PARTS="kernels profile" (or "tests") runs a subset; PYTEST_ARGS adds pytest arguments (e.g. "-k kernels").
# Budget: all three parts in one call of at most 300 s (a lent machine allows 10 minutes a command): the tier
# runs tests/gpu in parallel with pytest-xdist where it is installed (-n auto --dist loadgroup; XDIST=0 runs
# it sequentially), and each part's seconds go to $OUT/timings.json, so a run shows where the time went.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-build/gpu-check}
PARTS=${PARTS:-kernels profile tests}
mkdir -p "$OUT"
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.__version__)" || exit 2
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%T.%3N)" "$line"; done; }  # log lines get times
# the card's clocks, power and load through the run (nvidia-smi, every 0.5 s), to set beside the logs' times:
# an idle GPU waits at a low clock, and a long run can slow under its power limit
clock_pid=""
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 500 > "$OUT/clocks.csv" 2>/dev/null & clock_pid=$!
fi
trap '[ -n "$clock_pid" ] && kill $clock_pid 2>/dev/null' EXIT
rc=0
XDIST_ARGS=""
if [ "${XDIST:-1}" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then XDIST_ARGS="-n auto --dist loadgroup"; fi
timings=""
for part in $PARTS; do
  t0=$(date +%s)
  case $part in
    kernels)
      "$PY" -m pdv_ext.cli bench kernels --device cuda --json 2> >(stamp > "$OUT/kernels.err") | tail -1 > "$OUT/kernels.json" || rc=1
      cat "$OUT/kernels.json" ;;
    profile)
      "$PY" -m pdv_ext.cli bench profile --device cuda --json 2> >(stamp > "$OUT/profile.err") | tail -1 > "$OUT/profile.json" || rc=1
      cat "$OUT/profile.json" ;;
    tests)
      # shellcheck disable=SC2086
      "$PY" -m pytest tests/gpu -m "gpu or multigpu" -ra -q -p no:cacheprovider --durations=15 $XDIST_ARGS \
        ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1 || rc=1
      tail -30 "$OUT/pytest.log" ;;
    *) echo "gpu_check: unknown part '$part' (kernels, profile, tests)" >&2; exit 2 ;;
  esac
  timings="$timings${timings:+, }\"$part\": $(( $(date +%s) - t0 ))"
  echo "gpu_check: $part took $(( $(date +%s) - t0 )) s"
done
echo "{$timings}" > "$OUT/timings.json"
exit $rc
