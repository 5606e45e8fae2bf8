"""TensorFlow's ParameterServerStrategy: variables on parameter servers, workers updating them asynchronously.

The cluster (TF_CONFIG): parameter servers and workers are plain `tf.distribute.Server` processes
(`python -m unifit.strategies.tf_server`), and this process, the chief, is the coordinator: the only one that runs
unifit's loop. It schedules each training step on whichever worker is free (`ClusterCoordinator.schedule`); a
worker reads its own endless, shuffled copy of the training data (a per-worker dataset) and applies its gradients
to the variables on the parameter servers without waiting for the others. What follows for the loop:
- a step is one worker's batch and one update: the learning rate is not scaled (one replica per update);
- an epoch is the number of steps one pass over the data takes, scheduled over the workers (each worker shuffles
  on its own, so a sample may be read twice or not at all within an epoch, as in TensorFlow's own examples);
- values are fetched from the workers at the log and epoch boundaries only, and the coordinator waits for every
  scheduled step (`join`) before validation and checkpoints; validation batches are read here and sent one by one,
  so validation metrics are exact;
- a worker that dies is left behind: the coordinator runs its steps elsewhere (a step cut off may run twice) and
  takes the worker back when it restarts; a parameter server that dies ends the run with one line.
Keras 3 counters updated on several workers at once (`optimizer.iterations`, `keras.metrics`) lose updates (their
`assign_add` reads, then writes), so unifit counts steps itself and reduces losses from the fetched values.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from unifit.errors import ConfigError, DistributedError, error_prefix, first_line
from unifit.strategies.tf_distribute import TFDistributeStrategy
from unifit.strategies.watchdog import CollectiveWatchdog

log = logging.getLogger("unifit")


# TF_CONFIG -> (strategy, coordinator): a process connects to its cluster once
_CONNECTED: dict[str, tuple[Any, Any]] = {}


class ParameterServerOptions(BaseModel):
    """trainer.strategy_options for parameter-server (the cluster's size comes from `unifit launch`)."""

    model_config = ConfigDict(extra="forbid")
    max_shards: int = Field(
        1,
        ge=1,
        description="split each variable of at least min_shard_bytes into up to this many shards along its first "
        "axis, placed round-robin over the parameter servers (large embeddings); 1: every variable whole",
    )
    min_shard_bytes: int = Field(256 << 10, ge=1, description="the smallest shard a variable is split into")


class ParameterServerStrategy(TFDistributeStrategy):
    """tf.distribute.ParameterServerStrategy with a ClusterCoordinator in this process (the chief)."""

    name = "parameter-server"
    Options = ParameterServerOptions
    coordinator: Any = None
    per_worker_stream = True  # the engine gives each worker an endless shuffled stream of the training data
    precisions = ("32-true",)  # a float16 loss scale is a counter that workers would update at once

    def claim_process(self) -> None:
        """Connect to the cluster now, when the Trainer is made: TensorFlow's context is reset by the connection,
        so a model built before it (a compiled Keras model passed as the module) would hold stale variables.
        Without a cluster, setup says so (after the module's framework is checked)."""
        if "ps" in os.environ.get("TF_CONFIG", ""):
            self._make()

    def setup(self) -> None:
        super().setup()
        # the coordinator waits for lost workers to come back: one that never does ends the chief in one line
        self.watchdog = CollectiveWatchdog(self.collective_timeout_s, error_prefix(self.rank))

    def _make(self) -> Any:
        key = f"{os.environ.get('TF_CONFIG', '')} {self.options.max_shards} {self.options.min_shard_bytes}"
        if key not in _CONNECTED:  # one connection per process, as TensorFlow allows
            _CONNECTED[key] = self._connect()
        self.coordinator = _CONNECTED[key][1]
        return _CONNECTED[key][0]

    def _connect(self) -> tuple[Any, Any]:
        import tensorflow as tf

        from unifit.strategies.tf_server import cluster_resolver

        resolver = cluster_resolver()
        spec = resolver.cluster_spec().as_dict()
        if not spec.get("ps") or not spec.get("worker"):
            raise ConfigError(
                "trainer.strategy: parameter-server needs a cluster of workers and parameter servers (TF_CONFIG "
                f"with 'worker' and 'ps' tasks; received {os.environ.get('TF_CONFIG')!r}); start it with: unifit "
                "launch --nproc-per-node N --num-ps K -c exp.yaml --trainer.strategy parameter-server"
            )
        wait_for_cluster(spec, self.collective_timeout_s)  # TensorFlow's connect waits forever, deaf to SIGINT
        shards, min_bytes = self.options.max_shards, self.options.min_shard_bytes
        partitioner = (
            tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=min_bytes, max_shards=shards)
            if shards > 1
            else None
        )
        strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        log.info(
            "parameter-server: %d worker(s), %d parameter server(s)%s; this process coordinates",
            len(spec.get("worker", [])),
            len(spec.get("ps", [])),
            f", variables of {min_bytes} bytes or more in up to {shards} shards" if partitioner else "",
        )
        return strategy, coordinator

    def teardown(self) -> None:
        self.coordinator = None
        super().teardown()

    # ---- the engine's seams (KerasTraining) ---------------------------------------------------
    def distribute(self, dist: Any, dataset_fn: Any, training: bool) -> Any:
        """Training: a dataset on every worker (each its own stream). Evaluation: read here, batch by batch.
        The training dataset is built here and handed over as a dataset: TensorFlow rebuilds its graph on each
        worker (a user's tf.data pipeline included; one captured in a function would be a tensor that cannot
        be copied to a worker: "Unable to parse tensor proto")."""
        import tensorflow as tf

        dataset = dataset_fn(tf.distribute.InputContext())
        return self.coordinator.create_per_worker_dataset(dataset) if training else dataset

    def run_step(self, step: Any, argument: Any) -> Any:
        """Scheduled on a free worker; its outputs come back as values fetched when read."""
        remote = self.coordinator.schedule(step, args=(argument,))
        structure = getattr(remote, "_type_spec", None)
        if isinstance(structure, dict):  # the step's named means: each fetched when read
            return {key: _Fetched(remote, key) for key in structure}
        return remote.fetch()  # predictions: each batch's, in order

    def fetch(self, value: Any) -> Any:
        if not isinstance(value, _Fetched):
            return value
        with self.collective_guard("a step's values (no worker finished the step)"):
            return value.value()

    def wait_for_steps(self, what: str) -> None:
        """Every scheduled step done (a parameter server lost: one line)."""

        try:
            with self.collective_guard(f"the scheduled steps (no worker finished them) before {what}"):
                self.coordinator.join()
        except _lost_errors() as exc:
            raise _lost(exc, f"waiting for the scheduled steps before {what}") from None

    def prepare_model(self, model: Any) -> None:
        """A partitioned variable (a Keras variable holding a ShardedVariable) checkpoints and exports as one
        whole variable, the same entry as in a model that is not partitioned: its shards are read and
        concatenated here, on the chief, and a restored value is split over them (any layout restores any)."""
        import tensorflow as tf

        from unifit.strategies.tf_compat import checkpoint_through

        for variable in model.variables:
            sharded = _sharded(variable)
            if sharded is None:
                continue
            log.info("parameter-server: %s in %d shards", variable.path, len(sharded.variables))
            checkpoint_through(
                variable,
                read=lambda sharded=sharded: tf.convert_to_tensor(sharded),
                restore=sharded.assign,
                numpy=lambda sharded=sharded: tf.convert_to_tensor(sharded).numpy(),
            )

    @contextmanager
    def whole_variables(self, model: Any) -> Iterator[None]:
        """Export (Keras' save_weights reads each variable as an array): a partitioned variable holds its
        gathered value meanwhile, then its shards again."""
        import tensorflow as tf

        from unifit.strategies.tf_compat import backing_value, set_backing_value

        swapped = [
            (variable, backing_value(variable)) for variable in model.variables if _sharded(variable) is not None
        ]
        for variable, sharded in swapped:
            set_backing_value(variable, tf.convert_to_tensor(sharded))
        try:
            yield
        finally:
            for variable, sharded in swapped:
                set_backing_value(variable, sharded)

    def gradient_targets(self, variables: list[Any]) -> list[Any]:
        """A partitioned variable's shards stand for it (Keras 3 cannot take a gradient of a ShardedVariable:
        "no attribute 'handle'"); the optimizer keeps its state per shard."""
        targets: list[Any] = []
        for variable in variables:
            sharded = _sharded(variable)
            targets += list(sharded.variables) if sharded is not None else [variable]
        return targets

    # ---- collectives: the coordinator is the only process of unifit's loop --------------------
    def _all_reduce(self, values: np.ndarray, op: str) -> np.ndarray:
        return values


def wait_for_the_cluster_of_a_script() -> None:
    """A user's script run as a parameter-server chief (`unifit launch --strategy parameter-server -- SCRIPT.py`):
    every server answering before the script's own ParameterServerStrategy connects, which would wait forever for
    one that never does; trainer.collective_timeout_s' default bounds the wait. Anything else: no wait."""
    from unifit.config.schema import TrainerConfig
    from unifit.strategies.tf_server import chief_named

    config = chief_named(os.environ.get("TF_CONFIG") or "{}")
    if config["cluster"].get("ps") and config["task"].get("type") == "chief":
        wait_for_cluster(config["cluster"], TrainerConfig.model_fields["collective_timeout_s"].default)


def wait_for_cluster(spec: dict[str, list[str]], timeout_s: float) -> None:
    """Every parameter server and worker accepting connections, or a DistributedError naming those that did not
    within `timeout_s` (a host name that does not resolve, a port nobody listens on). TensorFlow's own connect
    retries forever inside C++, where neither a timeout nor SIGINT reaches it."""
    waiting = {f"{kind} {i} at {address}": address for kind in ("ps", "worker") for i, address in enumerate(spec[kind])}
    why: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while waiting:
        for task, address in list(waiting.items()):
            host, _, port = address.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
                del waiting[task]
            except socket.gaierror as exc:
                why[task] = f"{host} does not resolve: {exc.strerror}"
            except OSError as exc:
                why[task] = exc.strerror or type(exc).__name__
        if waiting and time.monotonic() >= deadline:
            raise DistributedError(
                f"parameter-server: waited {timeout_s:g} s for {', '.join(f'{t} ({why[t]})' for t in waiting)}; "
                "start every task of TF_CONFIG's cluster and check that this host reaches their addresses "
                "(trainer.collective_timeout_s sets the wait)"
            )
        if waiting:
            time.sleep(0.5)


def _sharded(variable: Any) -> Any:
    """The ShardedVariable a Keras variable holds, or None."""
    from unifit.strategies.tf_compat import sharded_value

    return sharded_value(variable)


def _lost_errors() -> tuple[type[Exception], ...]:
    import tensorflow as tf

    return (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError)


def _lost(exc: Exception, doing: str) -> DistributedError:
    return DistributedError(
        f"parameter-server: {doing}, a parameter server or the cluster was lost ({type(exc).__name__}: "
        f"{first_line(exc)}); restart the job with --ckpt-path auto to go on from the last checkpoint"
    )


class _Fetched:
    """One output of a scheduled step, fetched from its worker when first read (a log or epoch boundary)."""

    __slots__ = ("_remote", "_key", "_value")

    def __init__(self, remote: Any, key: str) -> None:
        self._remote, self._key, self._value = remote, key, None

    def value(self) -> Any:
        if self._value is None:
            try:
                self._value = self._remote.fetch()[self._key]
            except _lost_errors() as exc:
                raise _lost(exc, "fetching a step's values") from None
        return self._value

    def __float__(self) -> float:
        return float(np.asarray(self.value()).mean())
