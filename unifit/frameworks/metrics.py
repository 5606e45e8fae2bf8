"""Collect what `self.log` receives during a phase and average it exactly over all ranks.

Each value is weighted by the number of samples it describes, so the result is
sum(value x count) / sum(count) over every batch of every rank, exact with uneven shards.
Keys are reduced in sorted order so ranks never mix values; a key logged on some ranks but
not on others (which processed batches) is an error on every rank, not a silent mix.
Nothing here syncs with the device per step: values are kept as they come and turned into
numbers once, at the end of the phase.

Metrics that are not means (AUROC, F1, precision at k...) are logged as stateful metric objects
(a torchmetrics `Metric`, a keras.metrics.Metric), which each framework wraps: their states are
combined over every rank at the end of the phase and computed once, which gives the value over
the whole dataset, uneven shards included.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from unifit.errors import ConfigError, DistributedError

STATEFUL = "__stateful__"  # the key of the metric objects' states in a collector's state_dict


class MetricCollector:
    def __init__(self, to_numpy: Callable[[list[Any]], np.ndarray]) -> None:
        self._to_numpy = to_numpy
        self._entries: dict[str, tuple[list[Any], list[int]]] = {}
        self._stateful: dict[str, Any] = {}  # name -> a metric object the module updates itself
        self._resumed: dict[str, Any] = {}  # name -> a stateful metric's state from a mid-epoch checkpoint
        self._last_totals: dict[str, float] = {}
        self.batch_count = 1  # samples in the current batch: the default weight of self.log

    def last_total(self, name: str) -> float:
        """Samples counted for `name` over all ranks in the last reduce."""
        return self._last_totals.get(name, 0.0)

    def reset(self) -> None:
        self._entries = {}
        for metric in self._stateful.values():
            metric.reset()
        self._stateful = {}
        self._resumed = {}

    def add(self, name: str, value: Any, count: int) -> None:
        if is_stateful(value):  # its own states accumulate; the object is computed at the end
            if name in self._resumed:  # the epoch's batches before a mid-epoch checkpoint count too
                value.merge(self._resumed.pop(name))
            self._stateful[name] = value
            return
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = ([], [])
        entry[0].append(value)
        entry[1].append(count)

    def state_dict(self) -> dict[str, Any]:
        """The phase so far (a mid-epoch checkpoint): each entry's means and counts, and under
        STATEFUL each metric object's state (merged into the object when it is logged again)."""
        out: dict[str, Any] = {}
        for name, (values, counts) in self._entries.items():
            means = self._to_numpy(values).astype(np.float64).reshape(len(counts), -1).mean(axis=1)
            out[name] = ([float(v) for v in means], list(counts))
        if self._stateful:
            out[STATEFUL] = {name: metric.state() for name, metric in self._stateful.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self._resumed = dict(state.pop(STATEFUL, {}))
        self._entries = {name: (list(values), list(counts)) for name, (values, counts) in state.items()}

    def latest(self, name: str) -> Any:
        entry = self._entries.get(name)
        return entry[0][-1] if entry else None

    def reduce(self, strategy: Any) -> dict[str, float]:
        """Sample-weighted means over every rank (a collective: call on all ranks)."""
        local_keys = sorted([*self._entries, *self._stateful])
        all_keys = strategy.all_gather_object(local_keys)
        stateful = {key: self._stateful[key] for key in _agreed_keys(all_keys) if key in self._stateful}
        computed = {key: _computed_over_ranks(key, metric, strategy) for key, metric in sorted(stateful.items())}
        keys = [key for key in _agreed_keys(all_keys) if key not in stateful]
        sums = np.zeros(2 * len(keys), dtype=np.float64)
        for i, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None:
                continue
            values = self._to_numpy(entry[0]).astype(np.float64).reshape(len(entry[1]), -1).mean(axis=1)
            counts = np.asarray(entry[1], dtype=np.float64)
            sums[i] = float(np.dot(values, counts))
            sums[len(keys) + i] = float(counts.sum())
        totals = strategy.all_reduce_sum(sums)
        self.reset()
        self._last_totals = {key: float(totals[len(keys) + i]) for i, key in enumerate(keys)}
        means = {
            key: float(totals[i] / totals[len(keys) + i]) for i, key in enumerate(keys) if totals[len(keys) + i] > 0
        }
        return {**means, **computed}


def is_stateful(value: Any) -> bool:
    """A metric object computed over every rank's states (frameworks/torch/stateful.py, frameworks/keras/stateful.py)."""
    return hasattr(value, "compute_over") and hasattr(value, "reset")


def _computed_over_ranks(name: str, metric: Any, strategy: Any) -> float:
    value = metric.compute_over(strategy)
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(
            f"metric {name!r}: {metric.name} computes a {type(value).__name__}, not one number; log a "
            "metric that gives a scalar (e.g. average='macro')"
        ) from None


def _agreed_keys(all_keys: list[list[str]]) -> list[str]:
    """Keys every rank that logged anything logged; raise naming the first disagreement."""
    active = [(rank, set(keys)) for rank, keys in enumerate(all_keys) if keys]
    union = sorted(set().union(*(keys for _, keys in active))) if active else []
    for key in union:
        missing = [rank for rank, keys in active if key not in keys]
        if missing:
            present = [rank for rank, keys in active if key in keys]
            raise DistributedError(
                f"metric '{key}' was logged on ranks {present} but not on ranks {missing}; "
                "log every metric on every rank (metrics are averaged over all ranks)"
            )
    return union
