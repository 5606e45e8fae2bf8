"""A keras.Model's own train_step / test_step, run as model.fit runs it (Keras' TensorFlow trainer).

keras-io's VAE, GANs and contrastive models override `train_step` (or `test_step`, `compute_loss`) and are
compiled with an optimizer and no loss. unifit runs that step itself, per replica under the strategy
(`strategy.run`, as Keras' `make_train_function`), rather than its own forward and loss:

- the model's optimizers are unifit's: `model.optimizer` and every other optimizer the model holds as an
  attribute (a GAN's `d_optimizer`, `g_optimizer`) are replaced by twins whose learning rate follows
  trainer.lr_scaling and warmup; their `apply` first reduces the gradients over the processes where
  tf.distribute does not (horovod) and clips them (trainer.gradient_clip_val);
- the step's values are the model's metrics (`model.metrics`, whose `result()` the step returns): each is
  read per replica and added over replicas and workers at the end of the phase (frameworks/keras/stateful.py),
  the value over the whole epoch that model.fit's History shows; a value that is no metric's result is
  averaged over the epoch's steps by samples (model.fit shows the last step's);
- a validation inside fit keeps the training metrics aside (the model's metrics serve both, as in Keras).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from unifit.frameworks.keras.keras_compat import layers_of
from unifit.frameworks.keras.stateful import local_parts

_STEP_METHODS = ("train_step", "test_step", "compute_loss", "compute_metrics")


def build(model: Any, x_shape: Any, x_dtype: Any = "float32") -> None:
    """Build the model's variables for inputs of `x_shape`: unless they are all built already (a model with its
    own step and no call(), a GAN, is built through its parts, as model.fit takes it)."""
    if x_shape is None or (model.built and model.weights):
        return
    layers = layers_of(model, include_self=False)
    if layers and all(layer.built for layer in layers) and type(model).call is keras.Model.call:
        return
    model.build(tuple([None, *x_shape]))
    if not model.weights and layers and type(model).call is not keras.Model.call:
        # a subclassed model without build(): Keras marks it built and creates nothing; its layers build at their
        # first call, as under model.fit's first batch (the optimizer must know the variables before the step)
        model(tf.zeros((1, *[d or 1 for d in x_shape]), x_dtype), training=False)


def own_methods(model: Any) -> list[str]:
    """The step methods `model`'s class overrides (what model.fit would run instead of unifit's step)."""
    return [name for name in _STEP_METHODS if getattr(type(model), name, None) is not getattr(keras.Model, name)]


def model_optimizers(model: Any) -> dict[str, Any]:
    """Every optimizer the model holds, by attribute: `optimizer` first, then those a custom compile() set."""
    found = {"optimizer": model.optimizer} if getattr(model, "optimizer", None) is not None else {}
    for name, value in sorted(vars(model).items()):
        if isinstance(value, keras.optimizers.Optimizer) and name != "optimizer" and value not in found.values():
            found[name] = value
    return found


def built_for(optimizer: Any) -> list[Any]:
    """The variables `optimizer` was built for (its slots follow their order): what a checkpoint records to build
    it again before restoring, and what its state is copied back for. Keras keeps them in a private list."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def metric_leaves(model: Any) -> list[Any]:
    """The model's metrics one by one: a compiled model's metrics container stands for the metrics in it."""
    leaves = []
    for metric in model.metrics:
        inner = getattr(metric, "metrics", None)
        leaves += list(inner) if isinstance(inner, list) and inner else [metric]
    return leaves


class OwnStep:
    """The compiled functions that run `model`'s own steps under `dist`, and what they leave in its metrics."""

    def __init__(self, model: Any, dist: Any, targets_given: bool) -> None:
        self.model, self.dist, self.targets_given = model, dist, targets_given
        self._recording: dict[int, list[Any]] | None = None  # while tracing for the optimizers' variables

    def take_optimizers(
        self,
        optimizers: dict[str, Any],
        reduce: Callable[[list[Any]], list[Any]],
        clip: Callable[[list[Any]], list[Any]],
    ) -> None:
        """Every optimizer's apply() (apply_gradients calls it) first reduces and clips the gradients."""
        for optimizer in optimizers.values():
            apply = optimizer.apply

            def reduced_apply(
                grads: Any, trainable_variables: Any = None, apply: Any = apply, key: int = id(optimizer)
            ) -> Any:
                if self._recording is not None:  # a trace that only looks for the variables each one updates
                    self._recording[key] = list(trainable_variables)
                    return None
                return apply(clip(reduce(list(grads))), trainable_variables)

            optimizer.apply = reduced_apply

    def build_optimizers(self, optimizers: dict[str, Any], batch_specs: Any) -> None:
        """Build the optimizers a custom compile() holds for the variables the step updates with them, found by
        tracing the step once without running it. Keras builds them in the first step, which fails under
        mirrored ("You must feed a value for placeholder tensor"), and a resume restores their slots."""
        unbuilt = [o for o in optimizers.values() if not getattr(o, "built", True)]
        if not unbuilt:
            return
        self._recording = {}
        try:
            on_batch = tf.function(lambda *batch: self.dist.run(self._replica_step(True), args=batch))
            on_batch.get_concrete_function(*batch_specs)
            found = self._recording
        finally:
            self._recording = None
        with self.dist.scope():
            for optimizer in unbuilt:
                if id(optimizer) in found:
                    optimizer.build(found[id(optimizer)])

    def _replica_step(self, train: bool) -> Callable[..., Any]:
        method = self.model.train_step if train else self.model.test_step

        def replica_step(*batch: Any) -> Any:
            data = tuple(batch) if self.targets_given else batch[0]  # x alone, as model.fit(x) passes it
            return method(data)

        return replica_step

    def function(self, train: bool, prefix: str, jit_compile: bool, batches: int = 1) -> Any:
        """step(iterator or batch) -> this worker's values by `prefix` + name (the mean over its replicas, as
        Keras' reduction 'auto'); training runs `batches` batches of the iterator per call. trainer.compile: the
        per-replica step is compiled by XLA, as Keras' jit_compile."""
        dist, replica_step = self.dist, self._replica_step(train)

        def on_batch(batch: Any) -> dict[str, Any]:
            outputs = dist.run(replica_step, args=batch)
            local = {k: dist.experimental_local_results(v) for k, v in dict(outputs).items()}
            return {
                f"{prefix}{k}": tf.add_n([tf.cast(v, tf.float32) for v in values]) / len(values)
                for k, values in local.items()
            }

        # a function of its own inside the step, as in Keras' make_train_function
        on_batch = tf.function(on_batch, reduce_retracing=True, jit_compile=jit_compile)

        def step(batch_or_iterator: Any) -> dict[str, Any]:
            values = on_batch(next(batch_or_iterator) if train else batch_or_iterator)
            if batches > 1:  # steps_per_execution: the values after the call's last batch, as Keras' fit returns
                for _ in tf.range(batches - 1):
                    values = on_batch(next(batch_or_iterator))
            return values

        return step

    def reset_metrics(self) -> None:
        for metric in self.model.metrics:
            metric.reset_state()

    @contextmanager
    def metrics_kept_aside(self) -> Iterator[None]:
        """The metrics emptied for a validation and given back their training state after it."""
        leaves = metric_leaves(self.model)
        kept = [[np.asarray(part.numpy()) for part in local_parts(self.dist, v)] for m in leaves for v in m.variables]
        self.reset_metrics()
        try:
            yield
        finally:
            variables = [v for m in leaves for v in m.variables]
            for variable, parts in zip(variables, kept):
                for part, value in zip(local_parts(self.dist, variable), parts):
                    part.assign(value)
