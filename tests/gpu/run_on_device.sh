#!/usr/bin/env bash
# unifit's own GPU runs (not for users: it writes into benchmarks/results). One call on a lent GPU machine: tests/gpu (every GPU path, logged), then the GPU benchmark (benchmarks/gpu_overhead.py,
# REPS interleaved reps, default 1: ~4-5 min on an H200; the tests take ~2 min side by side), each inside its own time
# limit so both leave results. Results go to $OUT (the device tool
# brings that folder back) or benchmarks/results. Uses the machine's python3 (torch with CUDA); the repository root
# goes on PYTHONPATH. The lent machines' image has no pydantic: carry it as wheels for Python 3.12 (pydantic,
# pydantic_core, annotated_types, typing_inspection, typing_extensions; the device README says how). Usage: [REPS=2] bash tests/gpu/run_on_device.sh [tests-seconds, default 240] [benchmark-seconds, 330]
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
missing=$(python3 - <<'PY'
import importlib.util
need = ["torch", "pydantic", "yaml", "fsspec", "tqdm", "tensorboard", "psutil", "pytest", "pytest_timeout", "lightning"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
[ -n "$missing" ] && echo "run_on_device: missing on this machine: $missing (carry them as wheels: see the device README)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu_name.txt"
# the tests launch their own processes (torchrun --standalone picks free ports): with pytest-xdist they run side by side
parallel=$(python3 -c "import importlib.util as u; print('-n 8' if u.find_spec('xdist') else '')")
timeout "${1:-240}" python3 -m pytest tests/gpu -v -p no:cacheprovider $parallel 2>&1 | tee "$out/gpu_tests.log" | tail -40
tar czf "$out/gpu_zoo.tgz" benchmarks/results/gpu_zoo_*.json 2>/dev/null  # what test_model_zoo_on_one_gpu wrote
timeout "${2:-330}" python3 benchmarks/gpu_overhead.py --reps "${REPS:-1}" --out "$out/gpu_overhead.md" 2>&1 | tail -30
