"""A Ray Train driver for tests/test_ray.py, in its own process (Ray's start-up and threads stay out of pytest's):
`python -m tests.probe.ray_driver RUNS.json OUT.json`. RUNS.json: a list of unifit.ray.fit keyword arguments
(config, overrides, num_workers, storage_path, name, max_failures), and optionally "scaling" (a ScalingConfig's
arguments) and "grow_when" (a glob: the cluster starts with one node of 1 CPU, and a second node joins once a file
matches it; without it, one node of 2 CPUs). OUT.json gets, per run, Ray's Result: its metrics, its error, and the
checkpoints it lists."""

from __future__ import annotations

import glob
import json
import sys
import threading
import time
from typing import Any

import ray
from ray.cluster_utils import Cluster
from ray.train import ScalingConfig

import unifit.ray


def _fit_growing(cluster: Cluster, pattern: str, run: dict) -> Any:
    """unifit.ray.fit(**run) while a second node of 1 CPU joins `cluster` once a file matches `pattern` (Ray adds
    nodes from the main thread only: the fit runs in another)."""
    done: dict[str, Any] = {}
    fitting = threading.Thread(target=lambda: done.update(result=unifit.ray.fit(**run)), daemon=True)
    fitting.start()
    while not glob.glob(pattern) and fitting.is_alive():
        time.sleep(0.2)
    if fitting.is_alive():
        cluster.add_node(num_cpus=1)
    fitting.join()
    return done["result"]


def main(runs_file: str, out_file: str) -> None:
    runs = json.loads(open(runs_file).read())
    cluster = None
    if any("grow_when" in run for run in runs):  # a cluster that starts with one node of 1 CPU
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        ray.init(address=cluster.address)
    else:
        ray.init(num_cpus=2, include_dashboard=False)
    results = []
    for run in runs:
        if "scaling" in run:
            scaling = run.pop("scaling")
            workers = tuple(scaling.pop("num_workers"))  # (min, max): a JSON list
            run["scaling_config"] = ScalingConfig(num_workers=workers, **scaling)
        grow_when = run.pop("grow_when", None)
        result = _fit_growing(cluster, grow_when, run) if cluster and grow_when else unifit.ray.fit(**run)
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
    if cluster is not None:
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
