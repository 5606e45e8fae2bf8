"""Collect what `self.log` receives during a phase and reduce it exactly over all ranks.

By default each value is weighted by the number of samples it describes, so the result is
sum(value x count) / sum(count) over every batch of every rank, exact with uneven shards.
`reduce_fx` "sum", "max" or "min" reduce over every step of every rank instead (Lightning's
`self.log(..., reduce_fx=..., sync_dist=True)`); a `rank_zero_only` value is rank 0's alone.
Keys are reduced in sorted order so ranks never mix values; a key logged on some ranks but
not on others (which processed batches), or with another reduce_fx, is an error on every rank,
not a silent mix. Nothing here syncs with the device per step: values are kept as they come and
turned into numbers once, at the end of the phase.

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
SAMPLES = "__samples__"  # the key of the samples trained on in a collector's state_dict
KINDS = "__kinds__"  # the key of the keys' reductions that are not the default in a collector's state_dict
REDUCTIONS = ("mean", "sum", "max", "min")
RANK_ZERO = "@rank0"  # a kind's suffix: the value of rank 0 alone (reduced over its own steps)
_OBJECT = "object"  # the kind of a stateful metric


class MetricCollector:
    def __init__(self, to_numpy: Callable[[list[Any]], np.ndarray]) -> None:
        self._to_numpy = to_numpy
        self._entries: dict[str, tuple[list[Any], list[int]]] = {}
        self._kinds: dict[str, str] = {}  # name -> its reduction, where not "mean"
        self._stateful: dict[str, Any] = {}  # name -> a metric object the module updates itself
        self._resumed: dict[str, Any] = {}  # name -> a stateful metric's state from a mid-epoch checkpoint
        self._last_totals: dict[str, float] = {}
        self._samples = 0  # samples the engine trained on in this phase (count_samples)
        self._last_samples = 0.0
        self.batch_count = 1  # samples in the current batch: the default weight of self.log

    def last_total(self, name: str) -> float:
        """Samples counted for `name` over all ranks in the last reduce."""
        return self._last_totals.get(name, 0.0)

    def count_samples(self, count: int) -> None:
        """The engine trained on `count` more samples (whatever its step logs: a GAN's has no loss)."""
        self._samples += count

    @property
    def last_samples(self) -> float:
        """Samples counted over all ranks in the last reduce."""
        return self._last_samples

    def reset(self) -> None:
        self._entries = {}
        self._samples = 0
        self._kinds = {}
        for metric in self._stateful.values():
            metric.reset()
        self._stateful = {}
        self._resumed = {}

    def add(
        self,
        name: str,
        value: Any,
        count: int,
        reduce_fx: str = "mean",
        rank_zero_only: bool = False,
        keep_last: bool = False,
    ) -> None:
        """Record `value` for `name` (weighted by `count` samples for "mean"); `reduce_fx` is one of REDUCTIONS.
        keep_last: the phase's value is the last one recorded (weighted by every count), as model.fit logs what
        a model's own step returns when it is no metric's result."""
        if is_stateful(value):  # its own states accumulate; the object is computed at the end
            if name in self._resumed:  # the epoch's batches before a mid-epoch checkpoint count too
                value.merge(self._resumed.pop(name))
            self._stateful[name] = value
            return
        kind = reduce_fx + (RANK_ZERO if rank_zero_only else "")
        if self._kinds.get(name, "mean") != kind and name in self._entries:
            raise ConfigError(
                f"self.log({name!r}): logged with reduce_fx={_fx(self._kinds.get(name, 'mean'))} and now "
                f"{_fx(kind)} in the same phase; log one key with one reduce_fx"
            )
        if kind != "mean":
            self._kinds[name] = kind
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = ([], [])
        if keep_last and entry[0]:
            entry[0][:], entry[1][:] = [value], [entry[1][0] + count]
            return
        entry[0].append(value)
        entry[1].append(count)

    def state_dict(self) -> dict[str, Any]:
        """The phase so far (a mid-epoch checkpoint): each entry's means and counts, under STATEFUL each
        metric object's state (merged into the object when it is logged again), under KINDS the reductions."""
        out: dict[str, Any] = {
            name: ([float(v) for v in self._means(name)], list(counts)) for name, (_, counts) in self._entries.items()
        }
        if self._stateful:
            out[STATEFUL] = {name: metric.state() for name, metric in self._stateful.items()}
        if self._kinds:
            out[KINDS] = dict(self._kinds)
        if self._samples:
            out[SAMPLES] = self._samples
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self._resumed = dict(state.pop(STATEFUL, {}))
        self._kinds = dict(state.pop(KINDS, {}))
        self._samples = int(state.pop(SAMPLES, 0))
        self._entries = {name: (list(values), list(counts)) for name, (values, counts) in state.items()}

    def latest(self, name: str) -> Any:
        entry = self._entries.get(name)
        return entry[0][-1] if entry else None

    def reduce(self, strategy: Any) -> dict[str, float]:
        """Every key reduced over every rank (a collective: call on all ranks)."""
        mine = {key: self._kinds.get(key, "mean") for key in self._entries}
        mine.update({key: _OBJECT for key in self._stateful})
        # max, min and rank 0's values travel with the keys: one gather of small Python objects
        local = {key: self._local(key, kind) for key, kind in mine.items() if kind not in ("mean", "sum", _OBJECT)}
        gathered = strategy.all_gather_object((mine, local))
        kinds = _agreed_kinds([ranks_kinds for ranks_kinds, _ in gathered])
        gathered = [each for rank, each in enumerate(gathered) if strategy.reports_metrics(rank)]
        out: dict[str, float] = {}
        for key, kind in kinds.items():
            if kind.endswith(RANK_ZERO):
                if key in gathered[0][1]:
                    out[key] = gathered[0][1][key]
            elif kind in ("max", "min"):
                values = [values[key] for _, values in gathered if key in values]
                out[key] = max(values) if kind == "max" else min(values)
        stateful = sorted(key for key, kind in kinds.items() if kind == _OBJECT and key in self._stateful)
        out.update({key: _computed_over_ranks(key, self._stateful[key], strategy) for key in stateful})
        summed = [key for key, kind in kinds.items() if kind in ("mean", "sum")]
        sums = np.zeros(2 * len(summed) + 1, dtype=np.float64)
        sums[-1] = self._samples
        for i, key in enumerate(summed):
            if key in self._entries:
                means, counts = self._means(key), np.asarray(self._entries[key][1], dtype=np.float64)
                sums[i] = float(np.dot(means, counts)) if kinds[key] == "mean" else float(means.sum())
                sums[len(summed) + i] = float(counts.sum())
        totals = strategy.all_reduce_sum(sums if strategy.reports_metrics(strategy.rank) else np.zeros_like(sums))
        self.reset()
        self._last_samples = float(totals[-1])
        self._last_totals = {key: float(totals[len(summed) + i]) for i, key in enumerate(summed)}
        for i, key in enumerate(summed):
            count = totals[len(summed) + i]
            if kinds[key] == "sum":
                out[key] = float(totals[i])
            elif count > 0:
                out[key] = float(totals[i] / count)
        return out

    def _means(self, name: str) -> np.ndarray:
        """Each logged value as one number (the mean of a tensor that holds several)."""
        values, counts = self._entries[name]
        return self._to_numpy(values).astype(np.float64).reshape(len(counts), -1).mean(axis=1)

    def _local(self, name: str, kind: str) -> float:
        """This rank's reduction of `name` over its own steps."""
        means, counts = self._means(name), np.asarray(self._entries[name][1], dtype=np.float64)
        fx = kind.removesuffix(RANK_ZERO)
        if fx == "mean":
            return float(np.dot(means, counts) / counts.sum()) if counts.sum() > 0 else float(means.mean())
        return float({"sum": np.sum, "max": np.max, "min": np.min}[fx](means))


def is_stateful(value: Any) -> bool:
    """A metric object computed over every rank's states (frameworks/torch/stateful.py, frameworks/keras/stateful.py)."""
    return hasattr(value, "compute_over") and hasattr(value, "reset")


def _fx(kind: str) -> str:
    fx = kind.removesuffix(RANK_ZERO)
    return f"{fx!r}, rank_zero_only=True" if kind.endswith(RANK_ZERO) else repr(fx)


def _computed_over_ranks(name: str, metric: Any, strategy: Any) -> float:
    value = metric.compute_over(strategy)
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(
            f"metric {name!r}: {metric.name} computes a {type(value).__name__}, not one number; log a "
            "metric that gives a scalar (e.g. average='macro')"
        ) from None


def _agreed_kinds(all_kinds: list[dict[str, str]]) -> dict[str, str]:
    """Every key, in sorted order, with the reduction every rank agrees on; raise naming the first
    disagreement: a key logged on some ranks but not on others (that logged anything), or reduced
    differently. A rank_zero_only key needs rank 0 alone."""
    active = [(rank, kinds) for rank, kinds in enumerate(all_kinds) if kinds]
    union = sorted(set().union(*(kinds for _, kinds in active))) if active else []
    agreed: dict[str, str] = {}
    for key in union:
        seen = {kinds[key] for _, kinds in active if key in kinds}
        if len(seen) > 1:
            raise DistributedError(
                f"metric '{key}' was logged with different reductions on different ranks "
                f"({', '.join(sorted(map(_fx, seen)))}); log it the same way on every rank"
            )
        kind = seen.pop()
        missing = [rank for rank, kinds in active if key not in kinds]
        if missing and not kind.endswith(RANK_ZERO):
            present = [rank for rank, kinds in active if key in kinds]
            raise DistributedError(
                f"metric '{key}' was logged on ranks {present} but not on ranks {missing}; "
                "log every metric on every rank (metrics are reduced over all ranks), or pass "
                "rank_zero_only=True for a value of rank 0 alone"
            )
        agreed[key] = kind
    return agreed
