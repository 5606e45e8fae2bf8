"""TensorFlow's private API, in one place: each use named for what it does.

unifit reaches into TensorFlow only where it has no public form (checked with TensorFlow 2.21): the sharded
variables of a parameter-server model, a variable's checkpoint hooks and value, tf.data's auto-sharding and the
batch size a pipeline's last .batch() was given. A release that moves one breaks a function here, and
tests/test_tf_compat.py, which checks every name on the installed TensorFlow, rather than a strategy.
Import it where it is used (inside functions): a PyTorch run never loads TensorFlow.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = [
    "made_with_collective_keys_from",
    "sharded_value",
    "checkpoint_through",
    "backing_value",
    "set_backing_value",
    "auto_shard",
    "batch_size_of",
]

# tf.data's batching datasets (.batch(), .padded_batch(), .batch(num_parallel_calls=...)), whose batch size
# unifit reads to unbatch a pipeline the user batched (keras-io's habit, image_dataset_from_directory's default)
_BATCHING = ("_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset")
# what may follow the .batch() and still leave whole batches of its elements (an .unbatch(), a flat_map or
# anything else unknown ends the search: that pipeline is taken as it is)
_PER_BATCH = (
    "_MapDataset",
    "_ParallelMapDataset",
    "_PrefetchDataset",
    "CacheDataset",
    "_ShuffleDataset",
    "_TakeDataset",
    "_RepeatDataset",
    "_SkipDataset",
    "_FilterDataset",
    "_OptionsDataset",
    "_AssertCardinalityDataset",
    "_IgnoreErrorsDataset",
)


def sharded_value(variable: Any) -> Any:
    """The ShardedVariable a Keras variable holds (a partitioned variable under parameter servers), or None."""
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    value = getattr(variable, "value", None)
    return value if isinstance(value, ShardedVariable) else None


def checkpoint_through(
    variable: Any, read: Callable[[], Any], restore: Callable[[Any], Any], numpy: Callable[[], Any]
) -> None:
    """`variable` saves what `read()` gives and restores through `restore(value)` (tf.train.Checkpoint's trackable
    hooks), and its numpy() is `numpy()` (Keras' get_weights)."""
    variable._serialize_to_tensors = lambda: {"VARIABLE_VALUE": read()}
    variable._restore_from_tensors = lambda restored: restore(restored["VARIABLE_VALUE"])
    variable.numpy = numpy


def backing_value(variable: Any) -> Any:
    """What a Keras variable holds (its value is read from it): a tf.Variable, or a ShardedVariable."""
    return variable._value


def set_backing_value(variable: Any, value: Any) -> None:
    variable._value = value


def auto_shard(dataset: Any, workers: int, index: int) -> Any:
    """tf.distribute's own auto-sharding (by file, or by element, per the dataset's options) for one worker."""
    from tensorflow.python.distribute import input_ops

    return input_ops.auto_shard_dataset(dataset, workers, index, workers)


def batch_size_of(dataset: Any) -> int | None:
    """The batch size of a pipeline's last .batch(), looking through the per-batch steps after it, or None."""
    node = dataset
    while type(node).__name__ in _PER_BATCH:
        node = getattr(node, "_input_dataset", None)
    return int(node._batch_size) if type(node).__name__ in _BATCHING else None


def made_with_collective_keys_from(cls: Any, base: int, **kwargs: Any) -> Any:
    """A MirroredStrategy (or a subclass) whose collective keys start at `base`, not at TensorFlow's fixed first
    ones: its set-up reads the base before __init__ runs, so it is set on the object first."""
    strategy = cls.__new__(cls)
    strategy._collective_key_base = base
    strategy.__init__(**kwargs)
    return strategy
