"""validate / test / predict for KerasModules (a mixin of KerasEngine; trainer/evaluation.py runs it).

The model is built in the strategy's scope as for fit (no optimizer); each worker takes its own
disjoint shard (rank::world, not trimmed; a tf.data.Dataset for validate/test is read lazily, sharded as
in fit, frameworks/keras/data.py), split into per-replica batches as validation is, so
metrics are exact sample-weighted means. Predictions come back per step from every local replica
in the order the replicas took their parts, which is the shard's order.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Iterator, Sequence

import numpy as np
import tensorflow as tf

from unifit.errors import ConfigError
from unifit.frameworks.keras.data import arrays, unbatched, x_alone
from unifit.frameworks.keras.own_step import OwnStep, build
from unifit.frameworks.keras.precision import make_precision
from unifit.strategies.keras_training import KerasTraining

# stage -> (the data provider's method, the module's step, the metrics' prefix)
_STAGES = {
    "validate": ("val_dataset", "validation_step", "val/"),
    "test": ("test_dataset", "test_step", "test/"),
    "predict": ("predict_dataset", "predict_step", ""),
}


class KerasEvaluation:
    module: Any
    data: Any
    strategy: Any
    training: KerasTraining
    config: Any
    collector: Any
    own: Any  # an OwnStep where the model has its own test_step

    def setup_evaluation(self, stage: str) -> None:
        cfg, strategy = self.config, self.strategy
        self.precision = make_precision(cfg.precision)
        source, step, prefix = _STAGES[stage]
        self._prefix = prefix
        data, presharded = self._stage_data(stage, source)
        data, targets_given = x_alone(data) if stage != "predict" else (data, True)
        batched_by = unbatched(data)[1] if isinstance(data, tf.data.Dataset) else None
        if batched_by is not None and not cfg.batch_size_given:  # the pipeline's batch size, as fit takes it
            cfg = self.config = cfg.adopting_batch_size(batched_by, "the tf.data pipeline's .batch()")
        self._set_up_replicas()
        self.eval_lazy = None
        limit = cfg.limit_val_batches if stage == "validate" else None
        if stage != "predict" and isinstance(data, tf.data.Dataset):  # validate/test: read lazily, as in fit
            # an endless pipeline with limit_val_batches: model.evaluate(..., steps=N)'s first N batches
            self.eval_lazy = self._lazy(data, f"{source}()", presharded, endless_ok=bool(limit))
            count = limit * self.local_batch if self.eval_lazy.endless else self.eval_lazy.count
            self._eval_sizes = self._val_plan(count)
            x_shape = self.eval_lazy.x_shape
        else:
            self.eval_arrays = _inputs(data, f"{source}()") if stage == "predict" else arrays(data, f"{source}()")
            rank, world = (0, 1) if presharded else (strategy.rank, strategy.world_size)
            self._eval_indices = np.arange(rank, len(self.eval_arrays[0]), world)
            self._eval_sizes = self._val_plan(len(self._eval_indices))
            x_shape = self.eval_arrays[0].shape[1:]
        if limit is not None:
            self._eval_sizes = self._eval_sizes[:limit]
        with strategy.collective_guard("creating the model"), self.dist.scope(), self.precision.building():
            self.module.model = model = self.precision.prepare_model(self.module.build_model())
            build(model, x_shape)
            if self.module.own_step:  # its own test_step, with the loss and metrics it was compiled with
                self.module.compile_copy(model, self.module.configure_optimizers())
                self.own = OwnStep(model, self.dist, targets_given)
                self.own.reset_metrics()  # what the model's own fit left in them
        self.training.broadcast_variables(model.variables)  # rank 0's weights everywhere, as fit starts
        if stage == "predict":
            self._eval_fn = tf.function(self._predict_step())
        else:
            self._eval_fn = tf.function(
                self._distributed_step(train=False, prefix=prefix, evaluate=getattr(self.module, step))
            )

    def _predict_step(self) -> Any:
        module = self.module

        def step(batch: Any) -> Any:
            per_replica = self.dist.run(module.predict_step, args=batch[:1])
            return tf.concat(self.dist.experimental_local_results(per_replica), axis=0)  # replica order: shard order

        return step

    def load_weights(self, state: dict[str, Any]) -> None:
        """The model's variables only (the optimizer's, in the files too, are not needed)."""
        with self.strategy.collective_guard("checkpoint restore"):
            read_tf_files(state["tf_files"], tf.train.Checkpoint(model=self.module.model)).expect_partial()

    def eval_batches(self) -> Iterator[Any]:
        if self.eval_lazy is not None:
            iterator = iter(self._lazy_batches(self.eval_lazy, self._eval_sizes, repeat=False))
        else:
            iterator = iter(self._dataset(self.eval_arrays, self._eval_indices, self._eval_sizes, training=False))
        for size in self._eval_sizes:  # the same count on every worker
            with self.strategy.collective_guard("evaluation batch"):
                batch = next(iterator)
            self.collector.batch_count = size
            yield batch

    def eval_step(self, batch: Any, batch_idx: int) -> Any:
        outputs = self.training.run_step(self._eval_fn, batch)
        if isinstance(outputs, dict):  # validate / test: this worker's sample means
            self._collect(self._prefix, outputs)
            return None
        return np.asarray(outputs)

    def eval_indices(self, loader: int = 0) -> Sequence[int]:
        return self._eval_indices[: sum(self._eval_sizes)].tolist()

    eval_loader = 0  # a Keras stage reads one dataset
    eval_loader_count = 1

    def unbatch(self, outputs: Any) -> list[Any]:
        return list(outputs)

    def collate(self, samples: list[Any]) -> Any:
        return np.stack(samples) if samples else np.empty((0,))


def read_tf_files(files: dict[str, bytes], checkpoint: Any) -> Any:
    """Restore `checkpoint` from a checkpoint's tf/ files (name -> bytes); returns the read status."""
    folder = tempfile.mkdtemp(prefix="unifit-tf-restore-")
    try:
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        return checkpoint.read(os.path.join(folder, "ckpt"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _inputs(data: Any, what: str) -> tuple[np.ndarray, ...]:
    """What predict reads: x alone, (x,), (x, y, ...) or a tf.data.Dataset of them; only x is used."""
    if isinstance(data, tf.data.Dataset):
        data = tuple(np.stack(column) for column in zip(*unbatched(data)[0].as_numpy_iterator()))
    if isinstance(data, (tuple, list)):
        data = data[0]
    x = np.asarray(data)
    if x.ndim == 0:
        raise ConfigError(f"{what}: received {type(data).__name__}; return x (an array) or (x, y) arrays")
    return (x.astype(np.float32) if x.dtype == np.float64 else x,)
