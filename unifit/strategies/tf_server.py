"""A parameter server or worker of a parameter-server cluster: a `tf.distribute.Server` for its TF_CONFIG task.

    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' python -m unifit.strategies.tf_server

`unifit launch --num-ps K` starts these itself; on Kubernetes (TFJob) or SageMaker, run this in the PS and Worker
replicas and `unifit fit` in the Chief. The process serves until it is stopped, or until its parent (the launch
that started it) ends, so no server outlives its job; one started by a launch ignores SIGTERM and SIGINT (the launch
stops it once the chief, which needs it to checkpoint, has ended).

SageMaker's `parameter_server` distribution names the coordinator's task "master" (TensorFlow 1's name), which
TensorFlow 2's ParameterServerStrategy refuses: every process here reads it as "chief" (`cluster_resolver`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

END_WITH_PARENT = "UNIFIT_END_WITH_PARENT"  # set by the launch that started this process: end when it ends


def end_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: this process gets `sig` when the process that started it ends (even by kill -9)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def chief_named(raw: str) -> dict[str, Any]:
    """TF_CONFIG `raw` as a dict, with a "master" task (TensorFlow 1's name, SageMaker's) renamed "chief"."""
    config = json.loads(raw)
    cluster, task = dict(config.get("cluster") or {}), dict(config.get("task") or {})
    if "master" in cluster and "chief" not in cluster:
        cluster["chief"] = cluster.pop("master")
        task["type"] = "chief" if str(task.get("type")).lower() == "master" else task.get("type")
    return {**config, "cluster": cluster, "task": task}


def cluster_resolver(raw: str | None = None) -> Any:
    """A resolver for TF_CONFIG (`raw`, default the environment's), with a "master" task read as "chief"."""
    import tensorflow as tf

    config = chief_named(os.environ.get("TF_CONFIG", "{}") if raw is None else raw)
    cluster, task = config["cluster"], config["task"]
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster),
        task_type=str(task.get("type", "")).lower() or None,
        task_id=int(task.get("index", 0)),
        rpc_layer=config.get("rpc_layer") or "grpc",
    )


def main() -> int:
    if os.environ.get(END_WITH_PARENT) == "1":
        # the launch that started it stops it (SIGKILL: a server has nothing to save), after the chief ended: a
        # SIGTERM or Ctrl-C sent to the whole job (SLURM's scancel, a terminal, `timeout`) also reaches this
        # process, and the chief needs every server while it writes its last checkpoint
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        end_with_parent(signal.SIGKILL)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    resolver = cluster_resolver()
    if resolver.task_type not in ("ps", "worker"):
        print(
            f"unifit: error: TF_CONFIG task type {resolver.task_type!r}: this module serves 'ps' and 'worker' tasks; "
            "run `unifit fit` in the chief",
            file=sys.stderr,
        )
        return 2
    # a worker's server with one inter-op thread never returns its first step (TensorFlow's default is one per
    # core): at least 2
    threads = max(2, os.cpu_count() or 1)
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer,
        config=tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads),
        start=True,
    )
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
