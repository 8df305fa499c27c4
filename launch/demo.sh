#!/usr/bin/env bash
# `make demo`: the deepspeed launcher runs the GPT pipeline demo on 4 CPU ranks (pipe 2 x data 2),
# then plots its metrics. Extra arguments go to train_gpt.py (e.g. --steps 50).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
export OMP_NUM_THREADS=1 DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
port=$("$VENV/bin/python" -c "from pdv_ext.spawn import free_port; print(free_port())")
out="${PDV_DEMO_OUT:-runs/demo}"
"$VENV/bin/deepspeed" --num_gpus 4 --master_port "$port" launch/train_gpt.py \
  --deepspeed_config launch/configs/demo.json --out "$out" "$@"
"$VENV/bin/pdv" plot metrics "$out/metrics.csv" --out "$out/metrics.png"
echo "[demo] plot: $out/metrics.png"
