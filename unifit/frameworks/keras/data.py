"""What a KerasModule's data methods return: arrays (the engine shards and batches them), or a
tf.data.Dataset that stays a pipeline (`LazyData`): never read into memory, each worker reads its
own part of it (by file when it is built from files, else by element) and unifit batches it per replica.

Elements are (x, y) or (x, y, sample_weight); the engine multiplies the per-example losses by the
weights (docs/keras.md).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import tensorflow as tf

from unifit.errors import ConfigError, first_line

_AUTOSHARD = tf.data.experimental.AutoShardPolicy


def batch_size_of(dataset: Any) -> int | None:
    """The batch size of the last .batch() in a pipeline (per-batch steps after it looked through), or None."""
    from unifit.strategies import tf_compat

    return tf_compat.batch_size_of(dataset)


def unbatched(data: Any) -> tuple[Any, int | None]:
    """(dataset, its batch size): a pipeline the user batched is unbatched (unifit batches per replica
    itself; what ran per batch, a map after .batch(), still runs per batch), anything else is as it was."""
    size = batch_size_of(data) if isinstance(data, tf.data.Dataset) else None
    return (data.unbatch(), size) if size is not None else (data, None)


def x_alone(data: Any) -> tuple[Any, bool]:
    """(data, whether it has targets): x alone (an array, (x,), a pipeline of single elements), as model.fit(x)
    takes it for a model with its own train_step, gets a placeholder target its step never sees."""
    if isinstance(data, tf.data.Dataset):
        if isinstance(data.element_spec, tuple) and len(data.element_spec) != 1:
            return data, True
        batched = batch_size_of(data) is not None

        def placeholder(*x: Any) -> Any:
            x = x[0]
            return x, tf.zeros(tf.shape(tf.nest.flatten(x)[0])[:1]) if batched else tf.constant(0.0)

        return data.map(placeholder), False
    if isinstance(data, (tuple, list)) and len(data) == 1:
        data = data[0]
    if isinstance(data, np.ndarray) or tf.is_tensor(data):
        return (np.asarray(data), np.zeros(len(data), np.float32)), False
    return data, True


def arrays(data: Any, what: str) -> tuple[np.ndarray, ...]:
    """(x, y) or (x, y, sample_weight) arrays; a finite tf.data.Dataset is read into arrays
    (only validate/test/predict still do this; fit keeps a dataset lazy, see LazyData)."""
    if isinstance(data, tf.data.Dataset):
        data = unbatched(data)[0]
        check_dataset(data, what)
        data = tuple(np.stack(column) for column in zip(*data.as_numpy_iterator()))
    if isinstance(data, (tuple, list)) and len(data) > 3:
        raise ConfigError(f"{what}: received {len(data)} arrays; give (x, y) or (x, y, sample_weight)")
    if isinstance(data, (tuple, list)) and len(data) >= 2:
        result = tuple(np.asarray(a) for a in data)
        result = tuple(a.astype(np.float32) if a.dtype == np.float64 else a for a in result)
        if len({len(a) for a in result}) != 1:
            raise ConfigError(
                f"{what}: arrays have different lengths {[len(a) for a in result]}; give arrays of equal length"
            )
        if len(result) == 3 and result[2].ndim != 1:
            raise ConfigError(
                f"{what}: sample weights have shape {result[2].shape}; give one weight per sample (shape (n,))"
            )
        return result
    raise ConfigError(
        f"{what}: received {type(data).__name__}; return a tuple of arrays (x, y[, sample_weight]) or a "
        "tf.data.Dataset of (x, y[, sample_weight])"
    )


def with_class_weight(data: Any, class_weight: dict[int, float], what: str) -> Any:
    """model.fit's class_weight as per-sample weights of the training data (arrays or a pipeline): each sample
    weighs its class's weight (1 for a class not named); the class is the label, or the argmax of a one-hot y."""
    if any(label < 0 for label in class_weight):
        raise ConfigError(
            f"trainer.class_weight: received classes {sorted(class_weight)}; classes are labels 0, 1, ..."
        )
    table = np.ones(max(class_weight) + 1, np.float32)
    for label, weight in class_weight.items():
        table[label] = weight
    if isinstance(data, tf.data.Dataset):
        if len(data.element_spec) == 3:
            raise ConfigError(f"trainer.class_weight: {what} has sample weights too; give one of the two, as model.fit")
        lookup, known = tf.constant(table), len(table)

        def weighted(x: Any, y: Any) -> Any:
            label = _element_label(y)  # a class not named weighs 1
            return x, y, tf.where(label < known, tf.gather(lookup, tf.minimum(label, known - 1)), 1.0)

        return data.map(weighted)
    columns = arrays(data, what)
    if len(columns) == 3:
        raise ConfigError(f"trainer.class_weight: {what} has sample weights too; give one of the two, as model.fit")
    labels = _array_labels(columns[1])
    if labels.max(initial=0) >= len(table):
        table = np.concatenate([table, np.ones(int(labels.max()) + 1 - len(table), np.float32)])
    return (*columns, table[labels])


def _array_labels(y: np.ndarray) -> np.ndarray:
    """Class indices of a label array: integer labels (n,) or (n, 1), or one-hot rows (n, C)."""
    if y.ndim == 2 and y.shape[1] > 1:
        return y.argmax(axis=1)
    return y.reshape(len(y)).astype(np.int64)


def _element_label(y: Any) -> Any:
    """The class index of one element's label: a scalar, shape (1,), or a one-hot row."""
    if y.shape.rank == 1 and y.shape[0] is not None and y.shape[0] > 1:
        return tf.argmax(y, output_type=tf.int32)
    return tf.cast(tf.reshape(y, []), tf.int32)


def check_dataset(data: Any, what: str, endless_ok: bool = False) -> None:
    """One line for a dataset unifit cannot batch: not (x, y[, w]) elements, batched, or endless where it cannot
    be (`endless_ok`: training, whose steps_per_epoch the engine then requires, as model.fit does)."""
    spec = data.element_spec
    if isinstance(spec, dict) or (isinstance(spec, tuple) and len(spec) not in (1, 2, 3)):
        shown = f"a tuple of {len(spec)}" if isinstance(spec, tuple) else "dicts"
        raise ConfigError(
            f"{what}: the tf.data.Dataset's elements are {shown}; give elements (x, y) or "
            "(x, y, sample_weight), e.g. dataset.map(lambda d: (d['x'], d['y'])) (x alone: a model with its "
            "own train_step)"
        )
    flat = tf.nest.flatten(spec)
    if (
        batch_size_of(data) is None
        and flat
        and all(getattr(s, "shape", None) is not None and s.shape.rank and s.shape[0] is None for s in flat)
    ):
        raise ConfigError(
            f"{what}: the tf.data.Dataset looks batched (element shapes "
            f"{[tuple(s.shape) for s in flat]}) by something other than .batch(); pass it unbatched "
            "(dataset.unbatch()): unifit batches per replica itself with trainer.batch_size"
        )
    weights = getattr(spec[2], "shape", None) if isinstance(spec, tuple) and len(spec) == 3 else None
    if weights is not None and batch_size_of(data) is not None and weights.rank:
        weights = weights[1:]  # a pipeline batched by .batch(): its elements' weights
    if weights is not None and weights.rank not in (None, 0):
        raise ConfigError(
            f"{what}: sample weights have element shape {tuple(weights)}; give one scalar weight per element"
        )
    if int(data.cardinality()) == tf.data.INFINITE_CARDINALITY and not endless_ok:
        raise ConfigError(
            f"{what}: the tf.data.Dataset is endless (repeat() without a count); remove .repeat(): "
            "unifit evaluates the whole dataset each time (a validation reads N batches of an endless one with "
            "trainer.limit_val_batches: N)"
        )


class LazyData:
    """This worker's part of a tf.data.Dataset, read lazily, never materialised.

    Sharding: by file (AutoShardPolicy.FILE) when the pipeline reads files (list_files, TFRecordDataset,
    TextLineDataset, ...) and there are enough of them, else by element (AutoShardPolicy.DATA: element
    rank, rank + world, ...). The count of this worker's elements is the dataset's cardinality, or, when
    TensorFlow cannot tell it (files, filter, ...), one pass over the part at set-up.
    """

    def __init__(self, dataset: Any, what: str, rank: int, world: int, endless_ok: bool = False) -> None:
        check_dataset(dataset, what, endless_ok)
        dataset = unbatched(dataset)[0]
        self.what = what
        # repeat() without a count: one stream read on across epochs (as model.fit with steps_per_epoch), uncounted
        self.endless = int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY
        self.policy = "none"
        if world > 1:
            dataset, self.policy = _shard(dataset, world, rank)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = _AUTOSHARD.OFF  # sharded here, never again
        self.dataset = dataset.with_options(options)
        known = int(self.dataset.cardinality())
        self.counted = known < 0 and not self.endless
        self.count = (
            known
            if known >= 0 or self.endless
            else int(
                self.dataset.map(lambda *e: tf.constant(1, tf.int64)).reduce(
                    tf.constant(0, tf.int64), lambda a, b: a + b
                )
            )
        )
        spec = dataset.element_spec
        self.weighted = len(spec) == 3
        known_rank = isinstance(spec[0], tf.TensorSpec) and spec[0].shape.rank is not None
        self.x_shape = tuple(spec[0].shape) if known_rank else None  # None: the model builds at its first call

    def batched(self, per_replica: list[int], repeat: bool, skip: int = 0) -> Any:
        """Per-replica batches of sizes `per_replica` (one pass: sum of them elements; the rest of the
        part is not read), every pass (repeat: endless) read anew, so random ops in the pipeline draw anew.
        `skip` elements of the first pass are read and dropped (a mid-epoch resume)."""
        used = sum(per_replica)
        sizes = tf.constant(per_replica, tf.int64)
        ends = tf.cumsum(sizes)
        parts = len(per_replica)
        if self.endless:  # read on: each pass the next `used` elements of the stream
            data = self.dataset
        else:
            data = self.dataset.take(used)
            if repeat:
                data = data.repeat()
        data = data.enumerate()
        if skip:
            data = data.skip(skip)

        def key(i: Any, element: Any) -> Any:
            part = tf.searchsorted(ends, tf.reshape(i % used, [1]), side="right")[0]
            return (i // used) * parts + tf.cast(part, tf.int64)

        def size(k: Any) -> Any:
            return tf.gather(sizes, k % parts)

        data = data.group_by_window(
            key_func=key, window_size_func=size, reduce_func=lambda k, window: window.batch(size(k))
        )
        return data.map(lambda i, element: element).prefetch(tf.data.AUTOTUNE)


def _shard(dataset: Any, world: int, rank: int) -> tuple[Any, str]:
    from unifit.strategies.tf_compat import auto_shard

    reason = ""
    for policy in (_AUTOSHARD.FILE, _AUTOSHARD.DATA):
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = policy
        try:
            return auto_shard(dataset.with_options(options), world, rank), policy.name.lower()
        except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as exc:
            reason = first_line(exc)[:200]
            logging.getLogger("unifit").debug("sharding by file not possible (%s); sharding by element", reason)
    raise ConfigError(
        f"tf.data.Dataset: cannot be sharded over {world} workers ({reason}); build it from files or "
        "from in-memory tensors"
    )
