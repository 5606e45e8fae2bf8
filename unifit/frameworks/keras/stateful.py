"""keras.metrics.Metric objects, exact over every replica and worker: a KerasModule's stateful_metrics(), and
the metrics of a keras.Model that runs its own train_step (frameworks/keras/own_step.py).

A stateful_metrics() object is updated on the host with the targets and outputs the compiled step hands back
(every local replica's, in order). A model's own metric is updated by its step on each replica: under mirrored
and mwms its variables are sync-on-read, one copy per local replica, read here copy by copy. At the end of the
phase the metric's variables, which are counts and sums (aggregation 'sum': AUC's confusion counts,
Precision's true/false positives, F1Score's, a Mean's total and count), are added over the local copies and
over all workers before result() is read: the value over the whole dataset, uneven shards included.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from unifit.errors import ConfigError


def local_parts(dist: Any, variable: Any) -> tuple[Any, ...]:
    """A (Keras) variable's copies in this process: one per local replica for a metric's sync-on-read
    variable under mirrored / mwms, else the variable itself."""
    value = getattr(variable, "value", variable)  # a Keras variable's TensorFlow one
    if dist is None or not isinstance(value, tf.Variable):
        return (variable,)
    return tuple(dist.experimental_local_results(value))


class KerasMetricValue:
    def __init__(self, metric: Any, field: str, dist: Any = None) -> None:
        """`dist`: the tf.distribute.Strategy whose replicas update the metric (its own step), or None (the host)."""
        not_summed = [v.path for v in metric.variables if getattr(v, "aggregation", "sum") != "sum"]
        if not_summed:
            raise ConfigError(
                f"{field}: {type(metric).__name__} keeps state that cannot be added over workers "
                f"({', '.join(not_summed)}); use a metric whose variables are counts or sums"
            )
        self.metric, self.field, self.dist = metric, field, dist
        self.name = type(metric).__name__
        self._reader: Any = None  # a copy outside the strategy, where the replicas' copies cannot be given a sum

    def update(self, y: Any, y_pred: Any) -> None:
        self.metric.update_state(y, y_pred)

    def _local(self) -> list[np.ndarray]:
        """Each variable summed over this process's copies."""
        return [sum(np.asarray(part.numpy()) for part in local_parts(self.dist, v)) for v in self.metric.variables]

    def compute_over(self, strategy: Any) -> Any:
        local = self._local()
        flat = np.concatenate([a.astype(np.float64).ravel() for a in local]) if local else np.zeros(0)
        total = strategy.all_reduce_sum(flat)
        reader = self._result_reader()
        offset = 0
        for variable, array in zip(reader.variables, local):
            variable.assign(total[offset : offset + array.size].reshape(array.shape).astype(array.dtype))
            offset += array.size
        return np.asarray(reader.result())

    def _result_reader(self) -> Any:
        """The metric itself where it has one copy; else a copy of it made outside the strategy."""
        if self.dist is None or all(len(local_parts(self.dist, v)) == 1 for v in self.metric.variables):
            return self.metric
        if self._reader is None:
            try:
                self._reader = type(self.metric).from_config(self.metric.get_config())
            except Exception as exc:  # noqa: BLE001 - the user's own get_config/from_config
                raise ConfigError(
                    f"{self.field}: {self.name}.from_config(get_config()) fails ({type(exc).__name__}: {exc}), and "
                    "unifit needs a copy of it to read its value over the replicas; define get_config()/from_config()"
                ) from None
        return self._reader

    def reset(self) -> None:
        self.metric.reset_state()

    def state(self) -> list[Any]:
        """The metric's variables (counts and sums) as nested lists (a mid-epoch checkpoint, JSON)."""
        return [array.tolist() for array in self._local()]

    def merge(self, state: list[Any]) -> None:
        """Add a checkpoint's counts and sums to the metric's (to its first local copy)."""
        for variable, saved in zip(self.metric.variables, state):
            first = local_parts(self.dist, variable)[0]
            current = np.asarray(first.numpy())
            first.assign(current + np.asarray(saved, dtype=current.dtype))
