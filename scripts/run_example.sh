#!/usr/bin/env bash
# Install what the example needs, then train the digits example with 2 ddp processes (torchrun).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh" main
cd "$repo"
exec "${UNIFIT_VENV:-$repo/.venv}/bin/unifit" launch --nproc-per-node 2 -c examples/digits/torch.yaml "$@"
