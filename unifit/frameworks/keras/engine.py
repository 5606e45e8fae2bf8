"""Runs a KerasModule: one compiled step under the strategy's tf.distribute.Strategy.

Data: arrays are shuffled with seed + epoch (the same permutation everywhere), each worker takes
its own slice (rank::world, trimmed to equal length so every worker runs the same number of
steps, as MWMS needs) and serves it through distribute_datasets_from_function in per-replica
batches (no TensorFlow auto-sharding or rebatching on top). Validation shards are disjoint and
not trimmed. No replica ever gets an empty batch (some kernels fail on one, e.g. oneDNN's conv):
the last steps are split so that every replica gets at least one sample (see `step_sizes`), and
under MWMS every worker validates in the same number of steps, so none runs out before the others.

A tf.data.Dataset stays a pipeline (data.py LazyData): each worker reads its part (by file, else by
element), counted once when its cardinality is unknown, batched per replica by the same step plan;
training reads `take(n).repeat()` through one iterator, one pass per epoch, so random ops in the
pipeline draw anew every epoch. A third element (sample weights) multiplies the per-example losses.

Precision (frameworks/keras/precision.py) builds the model under its dtype policy and scales the
loss; trainer.compile hands each replica's forward, loss and gradients to XLA (jit_compile), while
gradient reduction and the optimizer's update, which hold the collectives (Horovod's ops have no
XLA kernel on CPU), stay outside it, so compiling works alike under every strategy.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from unifit.errors import ConfigError, first_line  # noqa: E402
from unifit.frameworks.base import Engine  # noqa: E402
from unifit.frameworks.keras.data import LazyData, unbatched, with_class_weight, x_alone  # noqa: E402
from unifit.frameworks.keras.data import arrays as _arrays  # noqa: E402
from unifit.frameworks.keras.evaluation import KerasEvaluation, read_tf_files  # noqa: E402
from unifit.frameworks.keras.history import FitHistory  # noqa: E402
from unifit.frameworks.keras.lr import LearningRateControl, with_policy  # noqa: E402
from unifit.frameworks.keras.own_step import OwnStep, build, built_for, metric_leaves  # noqa: E402
from unifit.frameworks.keras.precision import make_precision  # noqa: E402
from unifit.frameworks.keras.stateful import KerasMetricValue  # noqa: E402
from unifit.frameworks.lr_policy import LRPolicy  # noqa: E402
from unifit.frameworks.rng import host_rng_state, seed_host, set_host_rng_state  # noqa: E402

_TF_PREFIX = "tf/"


class KerasEngine(KerasEvaluation, Engine):
    # what setup() makes, in one place: the tf.distribute strategy and replica counts, the data and
    # its per-epoch plan, the model's optimizer and lr policy, the compiled steps and the counters
    dist: Any  # the tf.distribute.Strategy the step runs under
    local_replicas: int
    local_batch: int
    per_worker: bool
    precision: Any
    train_arrays: Any
    train_lazy: Any
    train_presharded: bool
    val_arrays: Any
    val_lazy: Any
    _val_indices: Any
    _train_sizes: Any
    _val_sizes: Any
    _batches: int
    optimizer: Any
    schedule: Any
    step_optimizer: Any  # the optimizer, or a LossScaleOptimizer around it (16-mixed)
    policy: LRPolicy
    _train_fn: Any
    _val_fn: Any
    _train_iter: Any
    _train_next: Any
    _untried: set[str]  # compiled steps not yet called (XLA compiles at the first call)
    _steps: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stateful: dict[str, dict[str, KerasMetricValue]] = {}  # per phase (prefix), made at first use
        self.own: OwnStep | None = None  # a keras.Model's own train_step / test_step, where it has one
        self.extra_optimizers: dict[str, Any] = {}  # its other optimizers (a GAN's), by attribute
        self._history = FitHistory()  # what fit returns

    def setup(self) -> None:
        cfg, strategy = self.config, self.strategy
        if cfg.accumulations() != {1}:
            raise ConfigError(
                "trainer.accumulate_grad_batches: Keras modules train with 1 and no accumulation_schedule (gradient accumulation "
                "is implemented for PyTorch modules only); raise batch_size instead"
            )
        if cfg.compile == "blocks":
            raise ConfigError(
                "trainer.compile: blocks compiles a PyTorch model's blocks one by one; a Keras model's step is "
                "compiled whole by XLA: set compile: true"
            )
        if cfg.activation_checkpointing.mode != "none":
            raise ConfigError(
                f"trainer.activation_checkpointing: {cfg.activation_checkpointing.mode} recomputes a PyTorch module's "
                "blocks; a Keras model recomputes its layers when built inside keras.RematScope(mode='full'): set "
                "activation_checkpointing: none"
            )
        if cfg.data_on_device is True:
            raise ConfigError(
                "trainer.data_on_device: true places a PyTorch module's in-memory tensors on its GPU; a Keras module's "
                "data goes through tf.data, which TensorFlow's strategies place: leave it auto"
            )
        allowed, name = self.training.precisions, self.strategy.name
        if allowed and cfg.precision not in allowed:
            raise ConfigError(
                f"trainer.precision: {cfg.precision}: {name} trains Keras modules in {', '.join(allowed)} only; "
                f"set trainer.precision: {allowed[0]}"
            )
        self.precision = make_precision(cfg.precision)
        train, presharded = self._rank_data(self.data.train_dataset())
        train, self.targets_given = x_alone(train)  # a model with its own step may take x alone
        train, batched_by = unbatched(train)
        if cfg.class_weight:
            train = with_class_weight(train, cfg.class_weight, "train_dataset()")
        cfg = self.config = self._adopt_batch_size(batched_by)
        self._set_up_replicas()
        self.train_presharded = presharded
        self.train_lazy = self.val_lazy = None
        self.train_arrays = self.val_arrays = None
        self._train_iter, self._train_next = None, None
        if isinstance(train, tf.data.Dataset):  # a pipeline: read lazily, each worker its own part
            self.train_lazy = lazy = self._lazy(train, "train_dataset()", presharded, endless_ok=True)
            if lazy.endless:  # as model.fit: an endless stream needs steps_per_epoch, and is read on across epochs
                if not cfg.limit_train_batches:
                    raise ConfigError(
                        "train_dataset(): the tf.data pipeline is endless (repeat() without a count); give "
                        "steps_per_epoch (Trainer.fit(..., steps_per_epoch=N) or trainer.limit_train_batches: N), "
                        "as model.fit needs it, or remove .repeat()"
                    )
                self.per_worker = cfg.limit_train_batches * self.local_batch
            else:
                self.per_worker = min(self._counts(lazy.count))
            how = {"file": "sharded by file", "data": "sharded by element", "none": "not sharded"}[lazy.policy]
            counted = "endless" if lazy.endless else "counted" if lazy.counted else "cardinality"
            logging.getLogger("unifit").info(
                f"rank {strategy.rank}: train_dataset() is a tf.data pipeline, read lazily, {how}: {lazy.count} "
                f"samples here ({counted}), {self.per_worker} used per epoch"
            )
        else:
            self.train_arrays = _arrays(train, "train_dataset()")
            n = len(self.train_arrays[0])
            self.per_worker = n if presharded else n // strategy.world_size
            if presharded:
                self.per_worker = -int(strategy.all_reduce_max(np.array([-n]))[0])
        used = self.per_worker - (self.per_worker % self.local_batch if cfg.drop_last else 0)
        if used == 0:
            raise ConfigError(
                f"trainer.batch_size: {cfg.batch_size} x {self.local_replicas} local replicas leaves no "
                f"training batch ({self.per_worker} samples per worker); lower batch_size"
            )
        if used < self.local_replicas:
            raise ConfigError(
                f"train_dataset(): {used} samples per worker cannot give each of its "
                f"{self.local_replicas} replicas one; give more samples or use fewer devices"
            )
        self._train_sizes = step_sizes(used, self._steps_for([used]), self.local_batch, self.local_replicas)
        self._batches = len(self._train_sizes)
        if cfg.limit_train_batches:
            self._batches = min(self._batches, cfg.limit_train_batches)
        self.module.stepping_batches = self._fit_length(self._batches)
        cfg = self.config  # max_steps: with the epochs it spans
        # a data provider need not have validation data (TensorFlow's parameter-server tutorial's has none)
        val_dataset = getattr(self.data, "val_dataset", None)
        val, val_presharded = self._rank_data(val_dataset() if val_dataset is not None else None)
        val = x_alone(val)[0] if val is not None and not self.targets_given else val
        if val is not None and cfg.limit_val_batches != 0 and isinstance(val, tf.data.Dataset):
            self.val_lazy = self._lazy(val, "val_dataset()", val_presharded, endless_ok=True)
            if not self.val_lazy.endless:
                self._val_sizes = self._val_plan(self.val_lazy.count)
            elif cfg.limit_val_batches is None:
                raise ConfigError(
                    "val_dataset(): the tf.data pipeline is endless (repeat() without a count); give validation_steps "
                    "(Trainer.fit(..., validation_steps=N) or trainer.limit_val_batches: N), as model.fit needs it, or "
                    "remove .repeat()"
                )
            else:  # as model.fit with validation_steps: each validation reads the stream's first N batches anew
                self._val_sizes = self._val_plan(cfg.limit_val_batches * self.local_batch)
        elif val is not None and cfg.limit_val_batches != 0:
            self.val_arrays = _arrays(val, "val_dataset()")
            n_val = len(self.val_arrays[0])
            rank, world = (0, 1) if val_presharded else (strategy.rank, strategy.world_size)
            self._val_indices = np.arange(rank, n_val, world)
            self._val_sizes = self._val_plan(len(self._val_indices))

        # MWMS broadcasts each variable's initial value from the chief as it is created; the
        # precision's dtype policy is global in Keras, so it holds only while the model is built
        precision = self.precision
        with self.strategy.collective_guard("creating the model"), self.dist.scope(), precision.building():
            self.module.model = model = precision.prepare_model(self.module.build_model())
            optimizer = self.module.configure_optimizers()
            self.policy = LRPolicy.from_config(cfg, self.replicas, self._batches)
            self.optimizer, self.schedule = with_policy(optimizer, self.policy)
            self.step_optimizer = precision.step_optimizer(self.optimizer)  # float16: a LossScaleOptimizer around it
            x_shape = self.train_lazy.x_shape if self.train_lazy is not None else self.train_arrays[0].shape[1:]
            self.module.built_for_input = (x_shape, getattr(self._batch_specs()[0], "dtype", "float32"))
            build(model, *self.module.built_for_input)
            self.training.prepare_model(model)
            self.targets = self.training.gradient_targets(model.trainable_variables)
            self.step_optimizer.build(self.targets)
            if self.module.own_step:
                self._set_up_own_step(model)
            elif not self.targets_given:
                raise ConfigError(
                    f"train_dataset(): gives x alone, without targets; {type(self.module).__name__} is trained by "
                    "a loss of targets and predictions: give (x, y) (x alone is for a model with its own train_step)"
                )
        self.training.broadcast_variables(model.variables + self.step_optimizer.variables)
        self._steps = 0  # optimizer steps, counted here so no step reads a device variable
        self.module.trained_optimizer = self.optimizer
        self.module.learning_rate = self.lr_control = LearningRateControl(self.schedule, lambda: self._steps)
        self._train_fns: dict[int, Any] = {}  # by batches per call (steps_per_execution; fewer at an epoch's end)
        self.steps_per_execution = int(getattr(self.module, "steps_per_execution", 1) or 1)
        self._val_fn = tf.function(self._distributed_step(train=False))
        self._untried = {"training", "validation"} if cfg.compile else set()  # XLA compiles at the first call

    def _set_up_own_step(self, model: Any) -> None:
        """The model's own step, with unifit's optimizers: model.optimizer and its others (a GAN's) take the lr
        policy, and reduce (horovod) and clip their gradients before applying them."""
        precision, clip = self.precision, self.config.gradient_clip_val

        def clipped(grads: list[Any]) -> list[Any]:
            return grads if clip is None else tf.clip_by_global_norm(grads, precision.clip_norm(clip))[0]

        self.extra_schedules: list[Any] = []

        def twin(optimizer: Any) -> Any:
            fresh, schedule = with_policy(optimizer, self.policy)
            self.extra_schedules.append(schedule)
            return fresh

        optimizers = self.module.prepare_own_step(model, self.step_optimizer, twin)
        self.extra_optimizers = {name: o for name, o in optimizers.items() if name != "optimizer"}
        self.own = OwnStep(model, self.dist, self.targets_given)
        self.own.take_optimizers(optimizers, self.training.reduce_gradients, clipped)
        self.own.build_optimizers(self.extra_optimizers, self._batch_specs())

    def _batch_specs(self) -> tuple[Any, ...]:
        """The (x, y[, sample_weight]) of one per-replica training batch, as TensorSpecs."""
        if self.train_lazy is not None:
            spec = self.train_lazy.dataset.element_spec
            return tuple(tf.nest.map_structure(lambda s: tf.TensorSpec([None, *s.shape], s.dtype), spec))
        return tuple(tf.TensorSpec([None, *a.shape[1:]], tf.as_dtype(a.dtype)) for a in self.train_arrays[:3])

    def _adopt_batch_size(self, batched_by: int | None) -> Any:
        """The run's config, with the batch size of a pipeline the user batched when trainer.batch_size was
        not set (both set and different: refused)."""
        cfg = self.config
        if batched_by is None or batched_by == cfg.batch_size and cfg.batch_size_given:
            return cfg
        if cfg.batch_size_given:
            raise ConfigError(
                f"train_dataset(): the tf.data pipeline is batched by {batched_by} but trainer.batch_size "
                f"is {cfg.batch_size}; leave trainer.batch_size unset to use the pipeline's, set it to "
                f"{batched_by}, or change the pipeline's .batch()"
            )
        return cfg.adopting_batch_size(batched_by, "the tf.data pipeline's .batch()")

    def _set_up_replicas(self) -> None:
        self.dist = self.training.tf_strategy or tf.distribute.get_strategy()
        self.local_replicas = _local_replicas(self.dist)
        # replicas over all processes: tf.distribute's own count for mirrored/mwms, one per process for horovod
        self.replicas = self.strategy.world_size * self.local_replicas
        self.local_batch = self.config.batch_size * self.local_replicas

    # ---- compiled steps -------------------------------------------------------------------
    def _distributed_step(self, train: bool, prefix: str = "val/", evaluate: Any = None, batches: int = 1) -> Any:
        """The compiled step: training (`batches` batches from the iterator it is given), or evaluation of one
        batch with `evaluate` (validation_step by default) logging under `prefix`."""
        module, clip, precision = self.module, self.config.gradient_clip_val, self.precision
        optimizer = getattr(self, "step_optimizer", None)  # none when only evaluating
        prefix = "train/" if train else prefix
        if self.own is not None:
            return self.own.function(train, prefix, jit_compile=bool(self.config.compile), batches=batches)
        evaluate = evaluate or module.validation_step
        keep_outputs = bool(self._stateful_metrics(prefix))  # their update runs on the host (stateful.py)

        def weighted(per_example: Any, weights: Any) -> Any:
            """Sample weights multiply the per-example losses (the mean stays over samples, as Keras'
            sum_over_batch_size with sample_weight)."""
            per_example = tf.cast(per_example, tf.float32)
            return per_example if weights is None else per_example * tf.cast(tf.reshape(weights, [-1]), tf.float32)

        def forward(x: Any, y: Any, weights: Any = None) -> tuple[Any, dict[str, Any]]:
            """Per replica: forward, loss and (training) gradients; what trainer.compile gives to XLA.
            Collectives (gradient reduction, the optimizer's all-reduce) stay outside it."""
            grads = None
            if train:
                with tf.GradientTape() as tape:
                    per_example, y_pred = module.training_step(x, y)
                    per_example = weighted(per_example, weights)
                    loss = tf.nn.compute_average_loss(per_example)
                    if module.model.losses:
                        regularization = tf.add_n([tf.cast(r, tf.float32) for r in module.model.losses])
                        loss += tf.nn.scale_regularization_loss(regularization)
                    scaled = precision.scale_loss(loss)
                grads = tape.gradient(scaled, self.targets)
            else:
                per_example, y_pred = evaluate(x, y)
                per_example = weighted(per_example, weights)
            sums = {f"{prefix}loss": tf.reduce_sum(tf.cast(per_example, tf.float32))}
            for name, values in module.metrics(y, y_pred).items():
                sums[f"{prefix}{name}"] = tf.reduce_sum(tf.cast(values, tf.float32))
            sums["_count"] = tf.cast(tf.shape(per_example)[0], tf.float32)
            if keep_outputs:
                sums["_y"], sums["_y_pred"] = y, tf.cast(y_pred, tf.float32)
            return grads, sums

        if self.config.compile:
            forward = tf.function(forward, jit_compile=True)

        def replica_step(x: Any, y: Any, weights: Any = None) -> dict[str, Any]:
            grads, sums = forward(x, y, weights)
            if train:
                variables = self.targets
                grads = self.training.reduce_gradients(grads)  # scaled alike on every rank (one loss scale)
                if clip is not None:
                    grads, _ = tf.clip_by_global_norm(grads, precision.clip_norm(clip))
                optimizer.apply_gradients(zip(grads, variables))  # float16: unscaled, skipped on inf/NaN
            return sums

        def one_batch(batch_or_iterator: Any) -> tuple[dict[str, Any], dict[str, Any]]:
            """This worker's sums (and sample count), and the outputs kept for stateful metrics."""
            # training passes the iterator and dequeues inside the graph, as Keras' own fit does
            batch = next(batch_or_iterator) if train else batch_or_iterator
            per_replica = self.dist.run(replica_step, args=batch)
            local = {k: self.dist.experimental_local_results(v) for k, v in per_replica.items()}
            outputs = {k: tf.concat(local.pop(k), axis=0) for k in ("_y", "_y_pred") if k in local}  # replica order
            return {k: tf.add_n(v) for k, v in local.items()}, outputs

        def step(batch_or_iterator: Any) -> dict[str, Any]:
            sums, outputs = one_batch(batch_or_iterator)
            if batches > 1:  # steps_per_execution: the call's other batches in a graph loop, as Keras' fit runs them
                kept = {
                    k: tf.TensorArray(v.dtype, size=batches, infer_shape=False).write(0, v) for k, v in outputs.items()
                }
                for i in tf.range(1, batches):
                    more, more_outputs = one_batch(batch_or_iterator)
                    sums = {k: sums[k] + more[k] for k in sums}  # the call's sums: its means weigh every sample once
                    kept = {k: kept[k].write(i, more_outputs[k]) for k in kept}
                outputs = {k: array.concat() for k, array in kept.items()}
            count = tf.maximum(sums.pop("_count"), 1.0)
            return {**{k: v / count for k, v in sums.items()}, **outputs}  # this worker's sample means

        return step

    # ---- data -------------------------------------------------------------------------------
    def _lazy(self, dataset: Any, what: str, presharded: bool, endless_ok: bool = False) -> LazyData:
        """A tf.data.Dataset as this worker's lazy part (presharded: FileShards already gave this rank its own)."""
        world, rank = (1, 0) if presharded else (self.strategy.world_size, self.strategy.rank)
        return LazyData(dataset, what, rank, world, endless_ok)

    def _counts(self, count: int) -> list[int]:
        """Every worker's element count (mwms, horovod: workers' parts differ when sharded by file)."""
        if self.strategy.world_size == 1:
            return [count]
        return [int(c) for c in self.strategy.all_gather_object(count)]

    def _lazy_batches(self, lazy: LazyData, sizes: list[int], repeat: bool, skip: int = 0) -> Any:
        """Distributed per-replica batches of a lazy part: each step's samples split evenly over the local replicas."""
        per_replica = [part for size in sizes for part in split_evenly(size, self.local_replicas)]
        return self.training.distribute(
            self.dist, lambda context: lazy.batched(per_replica, repeat, skip), training=repeat
        )

    def _steps_for(self, counts: list[int]) -> int:
        """Steps that every worker takes for its `counts` samples: enough for the largest at full
        batches, but never more than the smallest can fill with one sample per replica."""
        full = -(-max(counts) // self.local_batch)
        return min(full, min(counts) // self.local_replicas)

    def _val_plan(self, count: int) -> list[int]:
        """Samples per validation step. Under MWMS workers must take the same number of steps (a
        worker whose data ran out would be handed empty batches), so every worker's count decides."""
        spans_workers = self.dist.num_replicas_in_sync > self.local_replicas
        counts = [int(c) for c in self.strategy.all_gather_object(count)] if spans_workers else [count]
        if min(counts) < self.local_replicas:
            raise ConfigError(
                f"val_dataset(): a worker gets {min(counts)} validation samples, fewer than its "
                f"{self.local_replicas} replicas; give at least one sample per replica "
                f"({self.replicas} in all) or use fewer devices"
            )
        return step_sizes(count, self._steps_for(counts), self.local_batch, self.local_replicas)

    def _dataset(self, arrays: tuple[np.ndarray, ...], indices: np.ndarray, sizes: list[int], training: bool) -> Any:
        """This worker's samples in per-replica batches: each local replica dequeues one per step
        (round robin), and a step of `sizes[i]` samples gives every replica an even share, never none.

        distribute_datasets_from_function does no auto-sharding and no rebatching: unifit has
        already given this worker its own part, which is what every replica trains on.
        """
        data = tuple(a[indices[: sum(sizes)]] for a in arrays[:3])  # (x, y[, sample_weight])
        per_replica = [part for size in sizes for part in split_evenly(size, self.local_replicas)]

        def dataset_fn(context: Any) -> Any:
            parts, start = [], 0
            for size, run in itertools.groupby(per_replica):  # one batched dataset per run of equal sizes
                end = start + size * len(list(run))
                parts.append(tf.data.Dataset.from_tensor_slices(tuple(d[start:end] for d in data)).batch(size))
                start = end
            return functools.reduce(tf.data.Dataset.concatenate, parts)

        return self.training.distribute(self.dist, dataset_fn, training)

    def _stream(self) -> Iterator[Any]:
        """Each worker's own endless stream of the training data, batched by the step's batch size: arrays
        shuffled on the worker (unseeded, so the workers read different orders); a tf.data pipeline read
        whole on every worker, repeated, in its own order (its own shuffle, if it has one)."""
        size = self.local_batch
        if self.train_lazy is not None:
            pipeline = self.train_lazy.dataset

            def pipeline_fn(context: Any) -> Any:
                return pipeline.repeat().batch(size, drop_remainder=True)

            return iter(self.training.distribute(self.dist, pipeline_fn, training=True))
        data = tuple(self.train_arrays[:3])

        def dataset_fn(context: Any) -> Any:
            n = len(data[0])
            return tf.data.Dataset.from_tensor_slices(data).shuffle(n).repeat().batch(size, drop_remainder=True)

        return iter(self.training.distribute(self.dist, dataset_fn, training=True))

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        if skip >= self._batches:  # resumed from a checkpoint taken after the epoch's last step
            return
        if self.own is not None:  # as model.fit, every epoch's metrics start empty (a resume adds its saved state)
            self.own.reset_metrics()
        if self.training.per_worker_stream:  # one stream per worker for the whole fit: steps dequeue from it
            self._train_iter = self._train_iter or self._stream()
            yield from self._calls([self.local_batch] * (self._batches - skip), self._train_iter)
            return
        if self.train_lazy is not None:
            yield from self._lazy_train_batches(epoch, skip)
            return
        n = len(self.train_arrays[0])
        order = np.random.default_rng(self.config.seed + epoch).permutation(n)
        mine = order if self.train_presharded else order[self.strategy.rank :: self.strategy.world_size]
        mine = mine[: self.per_worker]  # every worker the same number of samples (and steps)
        # a mid-epoch resume starts after the samples of the first `skip` steps (never loaded)
        mine = mine[sum(self._train_sizes[:skip]) :]
        iterator = iter(self._dataset(self.train_arrays, mine, self._train_sizes[skip:], training=True))
        yield from self._calls(self._train_sizes[skip : self._batches], iterator)

    def _calls(self, sizes: list[int], iterator: Any) -> Iterator[Any]:
        """The iterator once per training call (train_step dequeues its batches inside the compiled call): each
        call `steps_per_execution` batches of `sizes`, fewer at the epoch's end and where max_steps stops it; the
        same calls on every worker."""
        done, max_steps = 0, self.config.max_steps
        while done < len(sizes):
            batches = min(self.steps_per_execution, len(sizes) - done)
            if max_steps is not None:
                batches = max(1, min(batches, max_steps - self._steps))
            self.batches_in_step = batches
            self.collector.batch_count = sum(sizes[done : done + batches])
            yield iterator
            done += batches

    def _lazy_train_batches(self, epoch: int, skip: int) -> Iterator[Any]:
        """One iterator over the endlessly repeated part serves every epoch (each epoch one pass of the
        part, trimmed to the steps every worker takes); repeat() re-reads the pipeline per pass, so random
        augmentation in it differs between epochs. A resume starts a new one, reading and dropping the
        samples of the steps already taken."""
        sizes = self._train_sizes[: self._batches]
        if self._train_iter is None or self._train_next != (epoch, skip):
            # an endless stream resumes past every sample read since it started (each epoch read on)
            done = epoch * sum(sizes) if self.train_lazy.endless else 0
            dataset = self._lazy_batches(self.train_lazy, sizes, repeat=True, skip=done + sum(sizes[:skip]))
            self._train_iter = iter(dataset)
        self._train_next = None  # an epoch left half-way is not continued
        yield from self._calls(sizes[skip:], self._train_iter)
        self._train_next = (epoch + 1, 0)

    def _train_fn(self, batches: int) -> Any:
        """The compiled training call that runs `batches` batches."""
        if batches not in self._train_fns:
            self._train_fns[batches] = tf.function(self._distributed_step(train=True, batches=batches))
        return self._train_fns[batches]

    def train_step(self, batch: Any, batch_idx: int) -> Any:
        batches = self.batches_in_step
        with self.strategy.collective_guard("training step"):  # a constant: no per-step formatting
            means = (
                self.training.run_step(self._train_fn(batches), batch)
                if not self._untried
                else self._first_call(self._train_fn(batches), batch, "training")
            )
        self._steps += batches
        self._collect("train/", means)
        self.collector.count_samples(self.collector.batch_count)
        return means.get("train/loss", next(iter(means.values()), 0.0))  # a GAN's step has d_loss, g_loss

    def val_batches(self) -> Iterator[Any]:
        self.training.wait_for_steps("validation")
        sizes = self._val_sizes
        limit = self.config.limit_val_batches
        steps = len(sizes) if limit is None else min(limit, len(sizes))
        if self.val_lazy is not None:
            iterator = iter(self._lazy_batches(self.val_lazy, sizes, repeat=False))
        else:
            iterator = iter(self._dataset(self.val_arrays, self._val_indices, sizes, training=False))
        for i in range(steps):  # the same count on every worker
            with self.strategy.collective_guard("validation batch"):  # MWMS: workers agree there is one
                batch = next(iterator)
            self.collector.batch_count = sizes[i]
            yield batch

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        means = (
            self.training.run_step(self._val_fn, batch)
            if not self._untried
            else self._first_call(self._val_fn, batch, "validation")
        )
        self._collect("val/", means)

    def _collect(self, prefix: str, means: dict[str, Any]) -> None:
        """A step's sample means into the collector; its outputs, if kept, into the stateful metrics."""
        fetch = self.training.fetch  # outputs of a step that ran elsewhere: brought here for the host's metrics
        y, y_pred = fetch(means.pop("_y", None)), fetch(means.pop("_y_pred", None))
        own_metrics = self._own_metrics(prefix)
        for name, value in means.items():  # a model's own step: its metrics' states, else its last values
            value = own_metrics.get(name, value)
            self.collector.add(name, value, self.collector.batch_count, keep_last=self.own is not None)
        for name, metric in self._stateful_metrics(prefix).items():
            metric.update(y, y_pred)
            self.collector.add(f"{prefix}{name}", metric, 0)

    def _own_metrics(self, prefix: str) -> dict[str, KerasMetricValue]:
        """A model with its own step: its metrics (whose results the step returns) by logged name, made once."""
        if self.own is None:
            return {}
        key = f"own:{prefix}"
        if key not in self._stateful:
            field = f"{type(self.module.model).__name__}.metrics"
            self._stateful[key] = {
                f"{prefix}{m.name}": KerasMetricValue(m, f"{field}['{m.name}']", self.dist)
                for m in metric_leaves(self.module.model)
            }
        return self._stateful[key]

    def _stateful_metrics(self, prefix: str) -> dict[str, KerasMetricValue]:
        """The module's stateful metrics for one phase (each phase its own objects), made once."""
        made = self._stateful
        if prefix not in made:
            made[prefix] = {
                name: KerasMetricValue(metric, f"{type(self.module).__name__}.stateful_metrics()['{name}']")
                for name, metric in self.module.stateful_metrics().items()
            }
        return made[prefix]

    def _first_call(self, fn: Any, batch: Any, which: str) -> Any:
        """The first call of a step under trainer.compile: an op XLA cannot compile is a one-line error."""
        if which not in self._untried:
            return self.training.run_step(fn, batch)
        try:
            result = self.training.run_step(fn, batch)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as exc:
            message = str(exc)
            if "XLA" not in message and "compil" not in message:
                raise
            ops = sorted(set(re.findall(r"on XLA_\w+: (\w+)", message)))
            found = f"ops XLA cannot compile: {', '.join(ops)}" if ops else first_line(exc)[:300]
            raise ConfigError(
                f"trainer.compile: received true, but XLA (jit_compile) cannot compile "
                f"{type(self.module).__name__}'s {which} step ({found}); set trainer.compile: false "
                "or remove those ops from the step"
            ) from None
        self._untried.discard(which)
        return result

    # ---- facts ------------------------------------------------------------------------------
    @property
    def batches_per_epoch(self) -> int:
        return self._batches

    @property
    def has_validation(self) -> bool:
        return self.val_arrays is not None or self.val_lazy is not None

    @property
    def optimizer_steps(self) -> int:
        return self._steps

    def end_of_epoch(self) -> None:
        """Keras schedules are evaluated per step; the processes agree on the moving statistics before the
        epoch's checkpoint and validation."""
        self.training.wait_for_steps("the end of the epoch")
        self._agree_on_statistics()

    def epoch_metrics(self, metrics: dict[str, float], validated: bool) -> None:
        self._history.add_epoch(metrics)

    def fit_result(self, state: Any) -> Any:
        """A keras.callbacks.History, as model.fit returns (and sets as the user's model.history)."""
        model = getattr(self.module, "user_model", None) or getattr(self.module, "model", None)
        return self._history.history(state.progress.epoch, self.batches_per_epoch, self.config.max_epochs, model)

    @contextmanager
    def validating(self) -> Iterator[None]:
        """A model with its own step validates with the same metric objects it trains with (as in Keras): the
        epoch's training state is kept aside meanwhile."""
        with super().validating():
            if self.own is None:
                yield
                return
            with self.own.metrics_kept_aside():
                yield

    def _agree_on_statistics(self) -> None:
        """BatchNormalization's moving mean and variance (non-trainable float variables) follow each process's
        own batches under MultiWorkerMirroredStrategy and Horovod alike; their mean over the processes is
        given to every process (a moving average is linear in its inputs: the mean of the processes' averages
        is the average over all their batches), so every process validates and saves one model."""
        world = self.strategy.world_size
        moving = [v for v in self.module.model.non_trainable_variables if "float" in str(v.dtype)]
        if world == 1 or not moving:
            return
        values = [np.asarray(v.numpy(), dtype=np.float64) for v in moving]
        with self.strategy.collective_guard("average of the moving statistics"):
            total = self.strategy.all_reduce_sum(np.concatenate([v.ravel() for v in values]))
        start = 0
        for variable, value in zip(moving, values):
            variable.assign((total[start : start + value.size] / world).reshape(value.shape).astype(value.dtype))
            start += value.size

    def current_lrs(self) -> list[float]:
        """The rate of each optimizer's next step (a GAN's: its model.optimizer's, then its others')."""
        lrs = [float(self.schedule(self._steps))]
        for optimizer, schedule in zip(self.extra_optimizers.values(), getattr(self, "extra_schedules", [])):
            lrs.append(float(schedule(optimizer.iterations)))
        return lrs

    def to_numpy(self, values: list[Any]) -> np.ndarray:
        fetch = self.training.fetch  # a value of a step that ran on another worker is brought here
        return np.asarray([float(fetch(v)) for v in values], dtype=np.float64)

    def is_finite(self, value: Any) -> bool:
        return math.isfinite(float(self.training.fetch(value)))

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer_steps": self.optimizer_steps,
            "precision": self.precision.state_dict(),
            "lr_scale": self.lr_control.scale,  # what Keras callbacks (ReduceLROnPlateau...) set the rate to
            "optimizers_built_for": self._built_for(),
        }

    def _built_for(self) -> dict[str, list[int]]:
        """A model's other optimizers (a GAN's), each with the positions of the variables it was built for in the
        model's trainable ones: a resume builds them alike before restoring their slots."""
        positions = {id(v): i for i, v in enumerate(self.module.model.trainable_variables)}
        return {
            name: [positions[id(v)] for v in built_for(optimizer) if id(v) in positions]
            for name, optimizer in self.extra_optimizers.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainable = self.module.model.trainable_variables
        for name, positions in state.get("optimizers_built_for", {}).items():
            optimizer = self.extra_optimizers.get(name)
            if optimizer is not None and positions and not optimizer.built:
                with self.dist.scope():
                    optimizer.build([trainable[i] for i in positions])
        with self.strategy.collective_guard("checkpoint restore"):
            read_tf_files(state["tf_files"], self._checkpoint()).assert_consumed()
        self._steps = int(state["optimizer_steps"])
        self.precision.load_state_dict(state.get("precision", {}))  # the float16 loss scale
        self.lr_control.scale = float(state.get("lr_scale", 1.0))

    def _checkpoint(self) -> Any:
        return tf.train.Checkpoint(model=self.module.model, optimizer=self.optimizer, **self.extra_optimizers)

    def checkpoint_files(self, payload: dict[str, Any], writer: bool = True) -> dict[str, bytes]:
        """Every worker writes (TensorFlow requires all to take part); only the chief's files are kept."""
        self.training.wait_for_steps("a checkpoint")
        self._agree_on_statistics()  # a mid-epoch checkpoint holds the processes' mean, as at epoch end
        folder = tempfile.mkdtemp(prefix="unifit-tf-ckpt-")
        try:
            with self.strategy.collective_guard("checkpoint write"):
                self._checkpoint().write(os.path.join(folder, "ckpt"))
            if not writer:
                return {}
            files = {
                f"{_TF_PREFIX}{name}": open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)
            }
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # a non-chief's copy is removed at once
        files["state.json"] = json.dumps(payload).encode()
        return files

    def read_checkpoint(self, fs: Any, directory: str) -> dict[str, Any]:
        payload = json.loads(fs.cat_file(f"{directory}/state.json"))
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{directory}/tf", detail=False)]
        payload["engine"]["tf_files"] = {name: fs.cat_file(f"{directory}/tf/{name}") for name in names}
        return payload

    def model_files(self) -> dict[str, bytes]:
        folder = tempfile.mkdtemp(prefix="unifit-tf-export-")
        try:
            path = os.path.join(folder, "model.weights.h5")
            with self.training.whole_variables(self.module.model):
                self.module.model.save_weights(path)
            return {"model.weights.h5": open(path, "rb").read()}
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _seed_generators(self) -> list[Any]:
        """Keras layers' own random streams (Dropout, ...): not model weights, but part of the RNG state."""
        found = []
        from unifit.frameworks.keras.keras_compat import layers_of, seed_generators

        for layer in layers_of(self.module.model, include_self=True):
            found += seed_generators(layer)
        return found

    def rng_state(self) -> dict[str, Any]:
        return {
            **host_rng_state(),
            "tf": tf.random.get_global_generator().state.numpy().tolist(),
            "keras_layers": [np.asarray(g.state.numpy()).tolist() for g in self._seed_generators()],
        }

    def set_rng_state(self, state: dict[str, Any]) -> None:
        set_host_rng_state(state)
        tf.random.get_global_generator().reset(np.asarray(state["tf"], dtype=np.int64))
        for generator, value in zip(self._seed_generators(), state.get("keras_layers", [])):
            generator.state.assign(np.asarray(value, dtype=generator.state.dtype))

    def seed(self, seed: int) -> None:
        seed_host(seed)
        tf.random.set_seed(seed)


def step_sizes(count: int, steps: int, local_batch: int, replicas: int) -> list[int]:
    """Samples per step for `count` samples in `steps` steps: full steps (`local_batch`) first,
    then what is left, keeping at least one sample per replica for every later step.

    Needs count >= steps * replicas. No step exceeds local_batch when count <= steps * local_batch
    (otherwise, only with batch_size 1, the last step takes the surplus too).
    """
    sizes = []
    for later in range(steps - 1, -1, -1):  # steps still to plan after this one
        size = min(local_batch, count - later * replicas) if later else count
        sizes.append(size)
        count -= size
    return sizes


def split_evenly(size: int, parts: int) -> list[int]:
    """`size` samples over `parts` replicas, sizes differing by at most one (34 + 33 for 67 over 2)."""
    base, extra = divmod(size, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def _local_replicas(dist: Any) -> int:
    """Replicas in this process (the default strategy has one and no device list)."""
    try:
        return max(1, len(dist.extended.worker_devices))
    except RuntimeError:
        return 1
