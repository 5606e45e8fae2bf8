#!/usr/bin/env bash
# The habits CI keeps before the tests (seconds): ruff check, ruff format, mypy on the seams.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bin="${UNIFIT_VENV:-$repo/.venv}/bin"
cd "$repo"
"$bin/ruff" check --quiet .
"$bin/ruff" format --check --quiet .
"$bin/mypy" --config-file pyproject.toml
