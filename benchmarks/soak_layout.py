"""The soak suite's run and checks (tests/test_soak.py: 30 epochs, checkpoints, TensorBoard, metrics.csv, NaN
guard, threads / descriptors / RSS sampled per epoch) for a layout that is not a row of the CI matrix.

    .venv/bin/python benchmarks/soak_layout.py STRATEGY NPROC 'STRATEGY_OPTIONS' OUT_DIR
    e.g. model-parallel 4 '{"tensor_parallel": 2, "plan": {"net.0": "colwise", "net.2": "rowwise"}}' /tmp/soak

Prints, per rank, the steps trained and (start, warm-up, largest after the warm-up, end) of each resource, and
what grew past the suite's tolerances (nothing, in a healthy run). The data is sized for NPROC replicas: a layout
with fewer replicas (tensor parallelism) trains proportionally more steps per rank.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import test_soak as soak  # noqa: E402
from tests.helpers import StrategyCase, run_unifit  # noqa: E402


def main() -> None:
    strategy, nproc, options, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    case = StrategyCase(strategy, strategy, "torch", nproc, options)
    started = time.time()
    result = run_unifit(*soak.soak_args(case, out), timeout=1800)
    print(f"exit {result.returncode} after {time.time() - started:.0f} s")
    if result.returncode:
        print(result.stderr[-3000:])
    for path in sorted((out / "resources").glob("resources_*.json")):
        run = json.loads(path.read_text())
        numbers, grew = soak.leaks(run["samples"], soak.tolerances(strategy))
        spans = {key: (n["start"], n["warm"], n["max_after"], n["end"]) for key, n in numbers.items()}
        print(f"rank {run['rank']}: {run['samples'][-1]['step']} steps, {spans}, grew: {grew or 'nothing'}")


if __name__ == "__main__":
    main()
