#!/usr/bin/env bash
# Everything issue #20 asks to measure on a GPU, in one command (a lent GPU machine costs a minute per start):
# the GPU tier of the tests, the kernels' GB/s beside the device copy's, and the profile's predicted vs
# measured step. Outputs go to $OUT (default ./build/gpu-check): pytest.log, kernels.json, profile.json.
#   make test-gpu / a machine with the project's .venv:   bash scripts/gpu_check.sh
#   a lent GPU machine without the venv, carrying the prepared .gpu/ wheels (docs/kernels.md):
#       source .gpu/device-setup.sh && bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT"
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.__version__)" || exit 2
rc=0
"$PY" -m pytest tests -m "gpu or multigpu" -ra -q -p no:cacheprovider > "$OUT/pytest.log" 2>&1 || rc=1
tail -15 "$OUT/pytest.log"
"$PY" -m pdv_ext.cli bench kernels --device cuda --json 2> "$OUT/kernels.err" | tail -1 > "$OUT/kernels.json" || rc=1
cat "$OUT/kernels.json"
"$PY" -m pdv_ext.cli bench profile --device cuda --json 2> "$OUT/profile.err" | tail -1 > "$OUT/profile.json" || rc=1
cat "$OUT/profile.json"
exit $rc
