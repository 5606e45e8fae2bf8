"""keras.metrics.Metric objects of a KerasModule (stateful_metrics()): exact over every replica and worker.

The compiled step hands back this worker's targets and outputs (every local replica's, in order);
the worker's own metric object is updated with them on the host, and at the end of the phase the
metric's variables, which are counts and sums (aggregation 'sum': AUC's confusion counts,
Precision's true/false positives, F1Score's, a Mean's total and count), are added over all workers
before result() is read: the value over the whole dataset, uneven shards included.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unifit.errors import ConfigError


class KerasMetricValue:
    def __init__(self, metric: Any, field: str) -> None:
        not_summed = [v.path for v in metric.variables if getattr(v, "aggregation", "sum") != "sum"]
        if not_summed:
            raise ConfigError(
                f"{field}: {type(metric).__name__} keeps state that cannot be added over workers "
                f"({', '.join(not_summed)}); use a metric whose variables are counts or sums"
            )
        self.metric = metric
        self.name = type(metric).__name__

    def update(self, y: Any, y_pred: Any) -> None:
        self.metric.update_state(y, y_pred)

    def compute_over(self, strategy: Any) -> Any:
        local = [np.asarray(v.numpy()) for v in self.metric.variables]
        flat = np.concatenate([a.astype(np.float64).ravel() for a in local]) if local else np.zeros(0)
        total = strategy.all_reduce_sum(flat)
        offset = 0
        for variable, array in zip(self.metric.variables, local):
            variable.assign(total[offset : offset + array.size].reshape(array.shape).astype(array.dtype))
            offset += array.size
        return np.asarray(self.metric.result())

    def reset(self) -> None:
        self.metric.reset_state()

    def state(self) -> list[Any]:
        """The metric's variables (counts and sums) as nested lists (a mid-epoch checkpoint, JSON)."""
        return [np.asarray(v.numpy()).tolist() for v in self.metric.variables]

    def merge(self, state: list[Any]) -> None:
        """Add a checkpoint's counts and sums to the metric's."""
        for variable, saved in zip(self.metric.variables, state):
            current = np.asarray(variable.numpy())
            variable.assign(current + np.asarray(saved, dtype=current.dtype))
