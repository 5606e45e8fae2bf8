"""TensorFlow's tf.distribute strategies (mirrored, mwms) behind unifit's Strategy core.

The Keras engine builds the model inside `tf_strategy.scope()` and runs its compiled step with
`tf_strategy.run`. unifit's own collectives (metric sums, barriers, object exchange) go through
the same strategy's cross-replica ops, so no second communication library is needed.

Across worker processes (mwms) a collective that never completes is ended by unifit's one
watchdog thread, not by TensorFlow's `CommunicationOptions(timeout_seconds=...)`: TensorFlow
starts a new thread per collective op that sleeps for the whole timeout, so every training step
(several collectives) left about 4.5 threads behind for collective_timeout_s, thousands in all,
until pthread_create failed. A worker that dies is still noticed by TensorFlow's coordination
service, whose error aborts the collectives.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import subprocess
import sys
from abc import abstractmethod
from typing import Any, ContextManager

import numpy as np
from pydantic import BaseModel, ConfigDict, PositiveInt

from unifit.errors import ConfigError, DistributedError, error_prefix, first_line
from unifit.strategies.base import Strategy
from unifit.strategies.keras_training import KerasTraining
from unifit.strategies.watchdog import CollectiveWatchdog

_TF_STARTED = (
    "TensorFlow started before the Trainer was made (a model, layer, tensor or tf.data pipeline was "
    "built first); make the Trainer at the top of the script, before anything else uses TensorFlow"
)


class TFDistributeStrategy(Strategy, KerasTraining):
    """Built on tf.distribute, so it is itself its Keras training part (`tf_strategy` builds and runs the step)."""

    tf_strategy: Any = None
    watchdog: CollectiveWatchdog | None = None
    _gather_fn: Any = None  # the compiled all-gather behind all_reduce_max, made at its first use

    def setup(self) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self.claim_process()
        self.tf_strategy = self._make()
        if self.world_size > 1:
            self.watchdog = CollectiveWatchdog(self.collective_timeout_s, error_prefix(self.rank))

    def teardown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None

    def collective_guard(self, what: str) -> ContextManager[Any]:
        """Ends this worker with one line if `what` waits on the others longer than collective_timeout_s."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.guard(f"{what} on rank {self.rank}")

    @abstractmethod
    def _make(self) -> Any:
        """Create the tf.distribute.Strategy."""

    # ---- collectives: only used across worker processes (mwms) ---------------------------
    def _all_reduce(self, values: np.ndarray, op: str) -> np.ndarray:
        if self.world_size == 1:
            return values
        import tensorflow as tf

        strategy = self.tf_strategy
        local_replicas = max(1, len(strategy.extended.worker_devices))
        x = np.asarray(values, dtype=np.float64)
        if x.size == 0:  # nothing to reduce (every rank alike): TensorFlow's collective crashes on an empty tensor
            return x
        try:
            with self.collective_guard(f"all_reduce {op.lower()}"):
                if op == "SUM":  # each local replica holds x / local replicas, so the sum counts it once
                    per_replica = strategy.experimental_distribute_values_from_function(
                        lambda ctx: tf.constant(x / local_replicas)
                    )
                    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None).numpy()
                if self._gather_fn is None:
                    self._gather_fn = tf.function(
                        lambda v: strategy.run(
                            lambda y: tf.distribute.get_replica_context().all_gather(y[tf.newaxis], axis=0), args=(v,)
                        )
                    )
                result = self._gather_fn(
                    strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant(x))
                )
                return strategy.experimental_local_results(result)[0].numpy().max(axis=0)
        except tf.errors.OpError as exc:
            raise DistributedError(
                f"{self.name}: a collective across workers failed ({type(exc).__name__}: "
                f"{first_line(exc)}); a worker is gone or unreachable: check the worker "
                "addresses (TF_CONFIG)"
            ) from None

    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        return self._all_reduce(values, "SUM")

    def all_reduce_max(self, values: np.ndarray) -> np.ndarray:
        return self._all_reduce(values, "MAX")

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Objects travel as bytes in a [world, length] buffer that an all-reduce sum fills in."""
        if self.world_size == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        lengths = self.all_reduce_sum(self._slot(np.array([len(data)], dtype=np.float64), 1))
        width = int(lengths.max())
        rows = self.all_reduce_sum(self._slot(np.pad(data, (0, width - len(data))).astype(np.float64), width))
        return [pickle.loads(rows[r, : int(lengths[r, 0])].astype(np.uint8).tobytes()) for r in range(self.world_size)]

    def _slot(self, row: np.ndarray, width: int) -> np.ndarray:
        buffer = np.zeros((self.world_size, width), dtype=np.float64)
        buffer[self.rank] = row
        return buffer

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.all_gather_object(obj if self.rank == src else None)[src]

    def barrier(self, name: str) -> None:
        try:
            with self.collective_guard(f"barrier '{name}'"):  # the outermost guard names the wait
                self.all_reduce_sum(np.zeros(1))
        except DistributedError as exc:
            raise DistributedError(f"barrier '{name}' on rank {self.rank}: {exc}") from None


class MirroredOptions(BaseModel):
    """trainer.strategy_options for mirrored."""

    model_config = ConfigDict(extra="forbid")
    devices: PositiveInt | None = None  # GPUs to use (default all), or logical CPU devices to split the CPU into


class MirroredStrategy(TFDistributeStrategy):
    """tf.distribute.MirroredStrategy: one process, every local device."""

    name = "mirrored"
    Options = MirroredOptions

    def claim_process(self) -> None:
        """Split the CPU into `devices` logical devices, which TensorFlow allows only before it starts."""
        self._devices()

    def _devices(self) -> list[str]:
        import tensorflow as tf

        wanted = self.options.devices
        gpus = tf.config.list_physical_devices("GPU") if self.accelerator != "cpu" else []
        if self.accelerator == "gpu" and not gpus:
            raise ConfigError("trainer.accelerator: received 'gpu', but TensorFlow sees no GPU; use 'auto' or 'cpu'")
        if gpus:
            if wanted and wanted > len(gpus):
                raise ConfigError(
                    f"trainer.strategy_options.devices: received {wanted}, but only {len(gpus)} GPUs are "
                    f"visible; set devices to at most {len(gpus)} (or leave it out to use all)"
                )
            return [f"/gpu:{i}" for i in range(wanted or len(gpus))]
        count = wanted or 1
        cores = os.cpu_count() or 1
        if count > cores:
            raise ConfigError(
                f"trainer.strategy_options.devices: received {count}, but this machine has {cores} "
                f"CPU cores; set devices to at most {cores} logical CPU devices"
            )
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        except RuntimeError:
            have = len(tf.config.list_logical_devices("CPU"))
            if have != count:
                raise ConfigError(
                    f"trainer.strategy_options.devices: {count} logical CPUs were asked for, but "
                    f"{_TF_STARTED} (it started with {have})"
                ) from None
        return [f"/cpu:{i}" for i in range(count)]

    def _make(self) -> Any:
        import tensorflow as tf

        return _fresh_collective_keys(tf.distribute.MirroredStrategy, devices=self._devices())


_strategies_made = itertools.count()


def _fresh_collective_keys(cls: Any, **kwargs: Any) -> Any:
    """A tf.distribute strategy whose collective keys no earlier one in this process used.

    Every MirroredStrategy numbers its collective groups from 1 and instances from 100, and
    TensorFlow's runtime keeps what it learnt about each (group, instance) for the life of the
    process: a second fit in one process whose step all-reduces other shapes (another model, a
    precision that adds a collective) failed with "Shape mismatch in the collective instance 100".
    """
    from unifit.strategies.tf_compat import made_with_collective_keys_from

    return made_with_collective_keys_from(cls, 1000 * next(_strategies_made), **kwargs)


# TensorFlow sets up its collectives once per process: the MultiWorkerMirroredStrategy made first (when
# the Trainer was made) serves every fit of this process
_MWMS: dict[str, Any] = {}


class MWMSStrategy(TFDistributeStrategy):
    """tf.distribute.MultiWorkerMirroredStrategy: one process per worker, cluster from TF_CONFIG."""

    name = "mwms"

    def claim_process(self) -> None:
        """Create the strategy now: TensorFlow configures collectives only at program start-up."""
        self._make()

    def _make(self) -> Any:
        key = os.environ.get("TF_CONFIG", "")
        if key not in _MWMS:
            _MWMS[key] = self._connect()
        return _MWMS[key]

    def _connect(self) -> Any:
        import logging

        import tensorflow as tf

        if self.world_size > 1 and "TF_CONFIG" not in os.environ:  # e.g. `srun unifit fit`: each would train alone
            raise ConfigError(
                f"trainer.strategy: mwms: this process is one of {self.world_size} ({self.env.source}), but TF_CONFIG "
                "is not set, so each would train alone; start the workers with: unifit launch --nproc-per-node N "
                "(it writes TF_CONFIG), see docs/clusters.md"
            )
        if self.world_size == 1 and "TF_CONFIG" not in os.environ:
            logging.getLogger("unifit").warning(
                "mwms: TF_CONFIG is not set, running a single worker; start N workers with: "
                "unifit launch --nproc-per-node N -c <experiment.yaml>"
            )
        # no timeout_seconds: TensorFlow would start a sleeping thread per collective (see the module docstring)
        options = tf.distribute.experimental.CommunicationOptions()
        # TensorFlow waits without a limit (holding the GIL) for every worker to connect: a watchdog
        # process ends this one with a clear message if that takes longer than collective_timeout_s
        watchdog = self._watchdog()
        try:
            return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        except RuntimeError as exc:
            if "must be configured at program startup" in str(exc):
                raise ConfigError(f"trainer.strategy: mwms: {_TF_STARTED}") from None
            raise
        finally:
            watchdog.kill()
            watchdog.wait()

    def _watchdog(self) -> subprocess.Popen:
        message = (
            f"{error_prefix(self.rank)}mwms: not every worker connected within "
            f"{self.collective_timeout_s:g}s, a worker is gone or unreachable; check the worker addresses in "
            f"TF_CONFIG ({os.environ.get('TF_CONFIG', '')}) and that every worker was started"
        )
        code = (
            "import os, signal, sys, time\n"
            f"time.sleep({self.collective_timeout_s!r})\n"
            f"print({message!r}, file=sys.stderr, flush=True)\n"
            f"os.kill({os.getpid()}, signal.SIGKILL)\n"
        )
        return subprocess.Popen([sys.executable, "-c", code])
