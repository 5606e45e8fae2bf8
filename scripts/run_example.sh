#!/usr/bin/env bash
# Install what the example needs, then train the digits example with 2 ddp processes (torchrun).
# On a machine with one GPU the two ranks share it (strategy_options share_gpus, said on the first line);
# a machine without GPUs runs them on the CPU (gloo).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh" main
cd "$repo"
venv="${UNIFIT_VENV:-$repo/.venv}"
extra=()
gpus="$("$venv/bin/python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$gpus" = 1 ]; then
  echo "run_example.sh: one GPU for 2 ranks: they share it (--trainer.strategy_options '{share_gpus: true}'); on your own machine launch one rank per GPU" >&2
  extra=(--trainer.strategy_options '{share_gpus: true}')
fi
exec "$venv/bin/unifit" launch --nproc-per-node 2 -c examples/digits/torch.yaml "${extra[@]}" "$@"
