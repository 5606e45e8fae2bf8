#!/usr/bin/env bash
# Install everything the tests need, check lint and types (scripts/lint.sh), then run the whole suite on
# UNIFIT_TEST_WORKERS pytest-xdist workers (2: most tests are launches of 2-8 processes, and one launch's waits
# - start-up, rendezvous, a timeout it tests - are the other's work; whole files per worker, as their fixtures
# are shared; tests/conftest.py orders the longest first).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh" test
cd "$repo"
bash "$repo/scripts/lint.sh"
exec "${UNIFIT_VENV:-$repo/.venv}/bin/python" -m pytest -n "${UNIFIT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
