"""A Ray Train driver for tests/test_ray.py, in its own process (Ray's start-up and threads stay out of pytest's):
`python -m tests.probe.ray_driver RUNS.json OUT.json`. RUNS.json: a list of unifit.ray.fit keyword arguments
(config, overrides, num_workers, storage_path, name, max_failures); OUT.json gets, per run, Ray's Result: its
metrics, its error, and the checkpoints it lists."""

from __future__ import annotations

import json
import sys

import ray

import unifit.ray


def main(runs_file: str, out_file: str) -> None:
    ray.init(num_cpus=2, include_dashboard=False)
    results = []
    for run in json.loads(open(runs_file).read()):
        result = unifit.ray.fit(**run)
        results.append(
            {
                "metrics": result.metrics,
                "error": None if result.error is None else repr(result.error),
                "checkpoint": result.checkpoint and result.checkpoint.path,
                "checkpoints": [c.path for c, _ in result.best_checkpoints or []],
            }
        )
    with open(out_file, "w") as f:
        json.dump(results, f)
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
