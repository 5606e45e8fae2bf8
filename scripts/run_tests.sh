#!/usr/bin/env bash
# Install everything the tests need, then run the whole suite.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh" test
cd "$repo"
exec "${UNIFIT_VENV:-$repo/.venv}/bin/python" -m pytest "$@"
