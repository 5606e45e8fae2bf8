#!/usr/bin/env bash
# Install everything the tests need, check lint and types (scripts/lint.sh), then run the whole suite.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh" test
cd "$repo"
bash "$repo/scripts/lint.sh"
exec "${UNIFIT_VENV:-$repo/.venv}/bin/python" -m pytest "$@"
