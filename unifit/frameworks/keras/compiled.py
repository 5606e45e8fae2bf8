"""Train a compiled `keras.Model` (Keras 3): loss, metrics and optimizer come from `model.compile(...)`.

`CompiledModel` is a KerasModule that wraps the user's model:
- build_model() rebuilds the model inside the strategy's scope (keras.models.clone_model for a
  Sequential/functional model, `from_config(get_config())` for a subclassed one) and copies the
  user's current weights into it, so mirrored/mwms own its variables and the user's initial
  weights are kept; after fit the trained weights are copied back into the user's object (the
  copy-back callback is set by trainer/adapt.py, which may import callbacks).
- configure_optimizers(): a fresh optimizer of the compiled one's class and config (the engine
  scales its learning rate).
- loss(): per-example values of the compiled loss (a Loss object's `call`, or the function
  keras.losses.get gives for a string); the engine averages them.
- metrics(): the compiled metrics that are per-example means (strings, functions and
  MeanMetricWrapper objects such as SparseCategoricalAccuracy); 'accuracy'/'acc' are resolved from
  the shapes of the targets and predictions, as Keras does. Stateful metrics that are not means
  (AUC, Precision, Recall, ...) become stateful_metrics(): exact over every replica and worker.
What compile() offers that unifit cannot honour (several outputs, run_eagerly) is refused in one line naming
the argument; steps_per_execution runs that many batches in one compiled call, as in model.fit; loss_weights,
weighted_metrics and metrics per output are computed by Keras' own train_step, run as below.

A model with its own step (it overrides train_step, test_step or compute_loss, or is compiled without a
loss: keras-io's VAE and GANs) is trained by that step, as model.fit trains it (frameworks/keras/own_step.py);
its data may then be x alone, as model.fit(x) takes it.

From YAML, `model` may instead be the dotted path of a function returning the compiled model
(`model_args` its arguments): it is then called in build_model(), inside the strategy's scope and
after the strategy was made, which mirrored on logical CPUs and mwms need (they must be set up before
TensorFlow starts, and building a model starts it). docs/keras.md.
"""

from __future__ import annotations

import logging
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from unifit._imports import load_object
from unifit.errors import ConfigError
from unifit.frameworks.keras.data import check_dataset
from unifit.frameworks.keras.keras_compat import wrapped_function
from unifit.frameworks.keras.module import KerasModule
from unifit.frameworks.keras.own_step import build, built_for, model_optimizers, own_methods

log = logging.getLogger("unifit")
_COMPILE_FIRST = "call model.compile(optimizer=..., loss=...) first"
_AS_IS = "single, horovod"  # strategies that need no tf.distribute scope: they train a model as it is


def _metric_name(metric: Any) -> str:
    return getattr(metric, "name", None) or getattr(metric, "__name__", None) or type(metric).__name__


class CompiledModel(KerasModule):
    """A compiled keras.Model (and, optionally, its data) as a KerasModule."""

    def __init__(self, model: Any, model_args: dict[str, Any] | None = None, data: Any = None) -> None:
        """`model`: a compiled keras.Model, or (YAML) the dotted path of a function or class that returns
        one, called with `model_args` inside the strategy's scope, after the strategy was made."""
        super().__init__()
        self._data = data
        self.hooks: list[Any] = []
        self._built: Any = None  # the model unifit trains (a copy, or the model the factory built)
        self.user_model: Any = None
        self._originals: dict[str, Any] = {}  # a model trained as it is: its own optimizers, given back after fit
        self.factory: Any = None
        if isinstance(model, keras.Model):
            if model_args:
                raise ConfigError(
                    "module.init_args.model_args: given with a keras.Model; model_args are the "
                    "arguments of a factory named by module.init_args.model"
                )
            self._read_compiled(model)
        elif isinstance(model, str) or callable(model):
            self.factory, self.factory_args = model, dict(model_args or {})
            self.name = model if isinstance(model, str) else getattr(model, "__name__", type(model).__name__)
        else:
            raise ConfigError(
                f"module.init_args.model: received {type(model).__name__}; give a compiled keras.Model "
                "or the dotted path of a function returning one"
            )

    def _read_compiled(self, model: Any) -> None:
        """What model.compile(...) chose, checked for what unifit cannot honour."""
        self.user_model = model
        self.name = type(model).__name__
        where = f"module: {self.name}"
        if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
            raise ConfigError(f"{where} is not compiled (no optimizer); {_COMPILE_FIRST}")
        compile_config = getattr(model, "_compile_config", None)
        config = dict(compile_config.config) if compile_config is not None else {}
        self._compile_config = config
        # its own train_step (a VAE, a GAN), no loss (add_loss() only), or what only Keras' step computes (loss
        # weights, weighted or per-output metrics): Keras' step, run as model.fit runs it (own_step.py)
        keras_computes = [config.get(a) is not None for a in ("loss_weights", "weighted_metrics")]
        keras_computes.append(isinstance(config.get("metrics"), dict))
        self.own_step = bool(own_methods(model)) or getattr(model, "loss", None) is None or any(keras_computes)
        if config.get("run_eagerly"):
            raise ConfigError(
                f"{where}: model.compile(run_eagerly=True); unifit runs the step as one compiled "
                "tf.function: compile with run_eagerly=False"
            )
        per_call = config.get("steps_per_execution", 1)
        if isinstance(per_call, bool) or not isinstance(per_call, int) or per_call < 1:
            raise ConfigError(
                f"{where}: model.compile(steps_per_execution={per_call!r}); give a whole number of batches "
                "per compiled call, 1 or more"
            )
        self.steps_per_execution = per_call
        if len(getattr(model, "outputs", None) or [None]) > 1 and not self.own_step:
            raise ConfigError(
                f"{where} has {len(model.outputs)} outputs; unifit trains models with one output and one loss for now"
            )
        # jit_compile is not read: Keras resolves its default 'auto' to True on GPUs, so it cannot be told
        # from an explicit True; trainer.compile decides whether the step is compiled by XLA (docs/keras.md)
        if self.own_step:  # its step computes the loss and updates its metrics
            self._loss, self._metrics = None, []
        else:
            self._loss = self._resolve_loss(model.loss, where)
            self._metrics = self._resolve_metrics(config.get("metrics", None), where)
        optimizer = model.optimizer
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer: trainer.precision scales
        self._optimizer_class, self._optimizer_config = type(optimizer), optimizer.get_config()

    # ---- compile() ------------------------------------------------------------------------------
    @staticmethod
    def _resolve_loss(loss: Any, where: str) -> Any:
        if isinstance(loss, dict) or (isinstance(loss, (list, tuple)) and len(loss) != 1):
            raise ConfigError(
                f"{where}: model.compile(loss=...) gives {len(loss)} losses; unifit trains one output "
                "with one loss for now"
            )
        if isinstance(loss, (list, tuple)):
            loss = loss[0]
        if isinstance(loss, str) and loss.lower() in ("crossentropy", "ce"):
            return lambda y, y_pred: _crossentropy_for(y, y_pred)(y, y_pred)
        if isinstance(loss, keras.losses.Loss):
            if getattr(loss, "reduction", None) == "mean_with_sample_weight":
                raise ConfigError(
                    f"{where}: model.compile(loss={type(loss).__name__}(reduction="
                    "'mean_with_sample_weight')); unifit averages (weighted) per-example losses over "
                    "the samples: use reduction='sum_over_batch_size'"
                )
            dtype = loss.dtype or "float32"

            def per_example(y: Any, y_pred: Any) -> Any:
                # as Loss.__call__ converts them, without its reduction
                convert = keras.ops.convert_to_tensor
                return loss.call(convert(y, dtype=dtype), convert(y_pred, dtype=dtype))

            return per_example
        try:
            function = keras.losses.get(loss)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"{where}: model.compile(loss={loss!r}) is not a Keras loss ({exc}); "
                "give a loss name, a keras.losses.Loss or a function(y_true, y_pred)"
            ) from None
        if isinstance(function, keras.losses.Loss):  # a name resolved to a Loss class
            return CompiledModel._resolve_loss(function, where)
        return _same_rank(function)

    @staticmethod
    def _resolve_metrics(metrics: Any, where: str) -> list[tuple[str, Any]]:
        if metrics is None:
            return []
        if isinstance(metrics, dict) or any(isinstance(m, (list, tuple, dict)) for m in metrics):
            raise ConfigError(
                f"{where}: model.compile(metrics=...) names metrics per output; give one flat list "
                "(unifit trains models with one output for now)"
            )
        resolved = []
        for metric in metrics:
            if isinstance(metric, str) and metric.lower() in ("accuracy", "acc"):
                resolved.append((metric, "accuracy"))  # chosen from the shapes when traced, as Keras does
                continue
            name = metric if isinstance(metric, str) else None
            if isinstance(metric, str):
                try:
                    metric = keras.metrics.get(metric)
                except (ValueError, TypeError) as exc:
                    raise ConfigError(
                        f"{where}: model.compile(metrics=[{name!r}]) is not a Keras metric ({exc})"
                    ) from None
            if isinstance(metric, keras.metrics.MeanMetricWrapper):
                fn, kwargs = wrapped_function(metric)
                fn = _same_rank(fn)
                resolved.append((name or metric.name, lambda y, y_pred, fn=fn, kwargs=kwargs: fn(y, y_pred, **kwargs)))
            elif isinstance(metric, keras.metrics.Metric):  # AUC, Precision, ...: its states, summed over workers
                resolved.append((name or metric.name, _Stateful(metric)))
            elif callable(metric):
                resolved.append((name or _metric_name(metric), _same_rank(metric)))
            else:
                raise ConfigError(
                    f"{where}: model.compile(metrics=[{metric!r}]) is not a metric; give names, "
                    "functions or keras.metrics mean metrics"
                )
        return resolved

    # ---- KerasModule ----------------------------------------------------------------------------
    def build_model(self) -> Any:
        """The model to train, built inside the strategy's scope (the engine enters it)."""
        if self.factory is not None:
            return self._from_factory()
        user = self.user_model
        model = self._rebuild(user)
        if user.weights:
            if not model.weights and getattr(user, "inputs", None):
                model.build(user.inputs[0].shape)
            model.set_weights(user.get_weights())  # the user's current (initial) weights
        self._built = model
        return model

    def _from_factory(self) -> Any:
        factory = self.factory
        if isinstance(factory, str):
            factory = load_object(factory, field="module.init_args.model")
        try:
            model = factory(**self.factory_args)
        except TypeError as exc:
            raise ConfigError(
                f"module.init_args.model_args: {self.name}(**model_args) failed: {exc}; fix module.init_args.model_args"
            ) from None
        if not isinstance(model, keras.Model):
            raise ConfigError(
                f"module.init_args.model: {self.name} returned a {type(model).__name__}, not a compiled keras.Model"
            )
        self._read_compiled(model)
        self._built = model  # built in the strategy's scope: trained as it is, nothing to copy back
        return model

    def _rebuild(self, user: Any) -> Any:
        if (
            isinstance(user, keras.Sequential)
            or getattr(user, "_is_graph_network", False)
            or type(user).__name__ == "Functional"
        ):
            return keras.models.clone_model(user, clone_function=_in_policy)
        try:
            return type(user).from_config(user.get_config())
        except Exception as exc:  # noqa: BLE001 - any failure: the user's own get_config/from_config
            if not tf.distribute.has_strategy():  # single, horovod: no scope owns the variables
                return user
            raise ConfigError(
                f"module: {self.name} is a subclassed keras.Model that {type(user).__name__}"
                f".from_config(get_config()) cannot rebuild ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:150] if str(exc) else ''}), and "
                f"{type(tf.distribute.get_strategy()).__name__} needs its variables created in its "
                f"scope; define get_config()/from_config(), or train it as is with trainer.strategy "
                f"{_AS_IS}"
            ) from None

    def configure_optimizers(self) -> Any:
        return self._optimizer_class.from_config(dict(self._optimizer_config))

    def loss(self, y: Any, y_pred: Any) -> Any:
        return _per_example(self._loss(y, y_pred))

    def stateful_metrics(self) -> dict[str, Any]:
        return {name: fn.fresh() for name, fn in self._metrics if isinstance(fn, _Stateful)}

    def metric_names(self) -> list[str]:
        return [name for name, _ in self._metrics]

    def metrics(self, y: Any, y_pred: Any) -> dict[str, Any]:
        values = {}
        for name, fn in self._metrics:
            if isinstance(fn, _Stateful):
                continue
            if fn == "accuracy":
                fn = _same_rank(_accuracy_for(y, y_pred))
            values[name] = _per_example(fn(y, y_pred))
        return values

    # ---- its own step ---------------------------------------------------------------------------
    def prepare_own_step(self, model: Any, optimizer: Any, twin: Any) -> dict[str, Any]:
        """Give `model` (built in the strategy's scope) unifit's optimizers for its own step: `optimizer` as
        model.optimizer, and `twin(o)` for every other optimizer it holds (a GAN's). Returns them by attribute."""
        if not self.compile_copy(model, optimizer):
            if model is self.user_model:
                self._originals = model_optimizers(model)
            model.optimizer = optimizer
        for name, own in model_optimizers(model).items():
            if name != "optimizer":
                setattr(model, name, twin(own))
        return model_optimizers(model)

    def compile_copy(self, model: Any, optimizer: Any) -> bool:
        """A copy of the user's model (built in the strategy's scope) compiled as the user compiled theirs, with
        `optimizer`; False where `model` is the user's own or the factory's (compiled already)."""
        if model is self.user_model or self.factory is not None:
            return False
        if type(model).compile is not keras.Model.compile:
            raise ConfigError(
                f"module: {self.name} defines its own compile(), which unifit cannot repeat on the copy "
                f"{type(tf.distribute.get_strategy()).__name__} needs in its scope; pass a function that builds "
                "and compiles the model (Trainer.fit(model=make_model) or module.init_args.model: "
                f"pkg.make_model), or train it as is with trainer.strategy {_AS_IS}"
            )
        model.compile(**{**self._compile_config, "optimizer": optimizer})
        return True

    # ---- data -----------------------------------------------------------------------------------
    def train_dataset(self) -> Any:
        return _checked(self._split()[0], "train")

    def val_dataset(self) -> Any:
        val = self._split()[1]
        return None if val is None else _checked(val, "val")

    def _split(self) -> tuple[Any, Any]:
        data = self._data
        if data is None:
            raise ConfigError(
                f"Trainer.fit({self.name}, data=...): a keras.Model brings no data; pass data=(x, y), "
                "{'train': (x, y), 'val': (x_val, y_val)}, an unbatched tf.data.Dataset of (x, y[, sample_weight]) or a "
                "data provider (train_dataset()/val_dataset())"
            )
        if isinstance(data, dict):
            unknown = sorted(set(data) - {"train", "val"})
            if unknown or "train" not in data:
                raise ConfigError(
                    f"data: received a dict with keys {sorted(data)}; give {{'train': (x, y)}} and "
                    "optionally 'val': (x_val, y_val)"
                )
            return data["train"], data.get("val")
        return data, None

    def attach_callbacks(self, callbacks: list[Any]) -> None:
        """The callbacks that serve this adapter (the copy-back; made by trainer/adapt.py, which may
        import callbacks): they run as the module's own configure_callbacks()."""
        self.hooks = list(callbacks)

    def configure_callbacks(self) -> list[Any]:
        return list(self.hooks)

    # ---- after fit ------------------------------------------------------------------------------
    def copy_weights_back(self) -> None:
        """The trained weights and optimizer state into the user's model object, as model.fit leaves it: trained,
        `model.optimizer` built with its step count, slots and current learning rate (model.save() keeps them)."""
        built, user = self._built, self.user_model
        if built is None or user is None:
            return
        if built is not user:
            if not user.weights and getattr(built, "inputs", None):
                user.build(built.inputs[0].shape)
            elif not user.weights and self.built_for_input is not None:  # a subclassed model built at its first call
                build(user, *self.built_for_input)
            user.set_weights(built.get_weights())
        if self._originals:  # trained as it is: its own optimizers back, with the trained ones' state
            for name, own in self._originals.items():
                trained_one = getattr(user, name)
                setattr(user, name, own)
                rate = self.learning_rate.get() if name == "optimizer" else float(trained_one.learning_rate)
                _copy_optimizer_state(trained_one, own, built_for(trained_one), rate)
            return
        trained = getattr(self, "trained_optimizer", None)
        if trained is not None and getattr(user, "optimizer", None) is not None:
            _copy_optimizer_state(trained, user.optimizer, user.trainable_variables, self.learning_rate.get())


def _copy_optimizer_state(trained: Any, own: Any, variables: list[Any], learning_rate: float) -> None:
    """The trained optimizer's step count and slot variables (momenta, ...) into the user's optimizer `own` (built
    for `variables` first), and the rate its next step would take where the user's rate is a number. The trained
    one's rate is unifit's schedule (scaling, warmup): its variables are matched without it, slot by slot."""
    own = getattr(own, "inner_optimizer", own)  # a LossScaleOptimizer of a mixed policy
    trained = getattr(trained, "inner_optimizer", trained)
    if not trained.built:  # never stepped (a GAN's compiled optimizer its step does not use)
        return
    if not own.built:
        own.build(variables)
    own_rate, trained_rate = getattr(own, "_learning_rate", None), getattr(trained, "_learning_rate", None)
    slots = [v for v in own.variables if v is not own.iterations and v is not own_rate]
    trained_slots = [v for v in trained.variables if v is not trained.iterations and v is not trained_rate]
    if [tuple(v.shape) for v in slots] != [tuple(v.shape) for v in trained_slots]:
        log.warning(
            "model.optimizer: its %d slot variables do not match the %d trained ones (a different optimizer or set of "
            "trainable variables); the weights are trained, the optimizer state is not copied back",
            len(slots),
            len(trained_slots),
        )
        return
    own.iterations.assign(trained.iterations.numpy())
    for mine, theirs in zip(slots, trained_slots):
        mine.assign(theirs.numpy())
    if not isinstance(own_rate, keras.optimizers.schedules.LearningRateSchedule):
        own.learning_rate = learning_rate


class _Stateful:
    """A compiled metric that is not a mean; each phase gets a fresh copy of it (same config)."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric

    def fresh(self) -> Any:
        return type(self.metric).from_config(self.metric.get_config())


def _same_rank(function: Any) -> Any:
    """`function(y, y_pred)` after Keras' own rank alignment (a (N,) target against (N, 1) outputs is
    squeezed, as Loss and MeanMetricWrapper do), so it never broadcasts to (N, N)."""
    from unifit.frameworks.keras.keras_compat import same_rank

    def aligned(y: Any, y_pred: Any, **kwargs: Any) -> Any:
        y, y_pred = same_rank(keras.ops.convert_to_tensor(y), keras.ops.convert_to_tensor(y_pred))
        return function(y, y_pred, **kwargs)

    aligned.__name__ = getattr(function, "__name__", "metric")
    return aligned


def _in_policy(layer: Any) -> Any:
    """A copy of `layer`; under trainer.precision's mixed policy (set while the model is built) a
    layer on Keras' default float32 policy takes the mixed one, as if it had been built under it."""
    config = layer.get_config()
    policy = keras.config.dtype_policy()
    if policy.name != "float32" and not isinstance(layer, keras.layers.InputLayer):
        dtype = config.get("dtype")
        if isinstance(dtype, dict) and dtype.get("config", {}).get("name") == "float32":
            config["dtype"] = policy
    return type(layer).from_config(config)


def _per_example(values: Any) -> Any:
    """One value per example: the mean over any further axes (as Keras' mean reductions do)."""
    values = tf.convert_to_tensor(values)
    if values.shape.rank is not None and values.shape.rank > 1:
        values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
    return values


def _accuracy_for(y: Any, y_pred: Any) -> Any:
    """Keras' choice for 'accuracy' (trainers/compile_utils.get_metric): binary, sparse categorical or
    categorical accuracy, from the shapes of the targets and predictions."""
    is_binary, is_sparse = _binary_or_sparse(y, y_pred)
    if is_binary:
        return keras.metrics.binary_accuracy
    return keras.metrics.sparse_categorical_accuracy if is_sparse else keras.metrics.categorical_accuracy


def _crossentropy_for(y: Any, y_pred: Any) -> Any:
    """Keras' choice for the loss 'crossentropy'/'ce' (trainers/compile_utils.get_loss)."""
    is_binary, is_sparse = _binary_or_sparse(y, y_pred)
    if is_binary:
        return keras.losses.binary_crossentropy
    return keras.losses.sparse_categorical_crossentropy if is_sparse else keras.losses.categorical_crossentropy


def _binary_or_sparse(y: Any, y_pred: Any) -> tuple[bool, bool]:
    from unifit.frameworks.keras.keras_compat import binary_or_sparse

    return binary_or_sparse(tf.convert_to_tensor(y), tf.convert_to_tensor(y_pred))


def _checked(data: Any, split: str) -> Any:
    """Arrays pass through; a tf.data.Dataset is checked (unbatched (x, y[, sample_weight]) elements, finite but for
    fit's, which then needs steps_per_epoch / validation_steps)
    and stays lazy (the engine shards and batches it per replica)."""
    if isinstance(data, tf.data.Dataset):
        check_dataset(data, f"data ({split})", endless_ok=split in ("train", "val"))  # fit asks for their steps
        return data
    if isinstance(data, (tuple, list)) and len(data) >= 1:
        return tuple(np.asarray(a) if not isinstance(a, np.ndarray) else a for a in data)
    if isinstance(data, np.ndarray):  # x alone, for a model with its own step (the engine checks)
        return data
    raise ConfigError(
        f"data ({split}): received {type(data).__name__}; give arrays (x, y[, sample_weight]), an "
        "unbatched tf.data.Dataset of (x, y[, sample_weight]) or a data provider "
        "(train_dataset()/val_dataset())"
    )
