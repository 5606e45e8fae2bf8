"""Keras callbacks run in unifit's loop as model.fit runs them, through Keras' own CallbackList.

    fit start            on_train_begin
    train epoch start    on_epoch_begin(epoch)
    train batch          on_train_batch_begin(batch) / on_train_batch_end(batch, {"loss": this worker's step loss})
    validation           on_test_begin / on_test_end(logs)
    epoch end            on_epoch_end(epoch, logs)          the epoch's metrics averaged over every worker
    fit end              on_train_end(logs)                 before the weights go back into the user's model

`logs` use Keras' names: `loss`, `<metric>`, `val_loss`, `val_<metric>`, `learning_rate`. Every rank runs them
with the same averaged logs, as every worker does under model.fit, so they decide alike; those that write files
(ModelCheckpoint, CSVLogger) run on rank 0 only. `self.model` is the model being trained; setting its
`stop_training` stops every rank (the ranks agree every preemption.check_every_n_steps steps and at the epoch's
end), and
`model.optimizer.learning_rate = x` sets the rate of the following steps (frameworks/keras/lr.py). Batch hooks cost
a host sync per step: KerasBatchCallbacks, made only when a callback has them.
"""

from __future__ import annotations

from typing import Any

from unifit.callbacks.agreement import agree_on_asked_stop
from unifit.callbacks.keras_mapping import RANK_ZERO, keras_kind
from unifit.frameworks.keras.history import keras_logs
from unifit.loop.callback import Callback

_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")


class KerasCallbacks(Callback):
    # before early stopping and checkpoints (a stop a Keras callback asks for is seen by the save that follows),
    # and before the trained weights go back into the user's model (EarlyStopping's restore_best_weights)
    runs_first = True

    def __init__(self, callbacks: list[Any]) -> None:
        self.callbacks = list(callbacks)
        self.listing: Any = None
        self._logs: dict[str, float] = {}

    @staticmethod
    def made_for(callbacks: list[Any]) -> KerasCallbacks:
        """The runner for `callbacks`: with batch hooks only when one of them has one (every rank decides alike)."""
        batch = any(_overrides(cb, hook) for cb in callbacks for hook in _BATCH_HOOKS)
        return (KerasBatchCallbacks if batch else KerasCallbacks)(callbacks)

    def on_setup(self, ctx: Any) -> None:
        import keras

        running = [cb for cb in self.callbacks if ctx.is_global_zero or keras_kind(cb) not in RANK_ZERO]
        self.listing = keras.callbacks.CallbackList(
            running,
            add_history=False,
            add_progbar=False,
            model=KerasModelView(ctx),
            epochs=ctx.config.max_epochs,
            steps=ctx.batches_per_epoch,
            verbose=0,
        )

    def on_fit_start(self, ctx: Any) -> None:
        self.listing.on_train_begin()

    def on_train_epoch_start(self, ctx: Any) -> None:
        self.listing.on_epoch_begin(ctx.progress.epoch)

    def on_validation_start(self, ctx: Any) -> None:
        self.listing.on_test_begin()

    def on_validation_end(self, ctx: Any) -> None:
        self.listing.on_test_end(keras_logs(ctx.state.metrics, only_validation=True))

    def on_epoch_end(self, ctx: Any) -> None:
        self._logs = keras_logs(ctx.state.metrics)
        self.listing.on_epoch_end(ctx.state.epoch - 1, self._logs)
        agree_on_asked_stop(ctx)

    def on_fit_end(self, ctx: Any) -> None:
        self.listing.on_train_end(self._logs)


class KerasBatchCallbacks(KerasCallbacks):
    """With the batch hooks: `logs` hold this worker's loss of the step (model.fit gives the epoch's running mean);
    a stop one of them asks for (TerminateOnNaN on one worker's loss) is agreed on every
    preemption.check_every_n_steps steps and at the epoch's end: a collective per step would cost TensorFlow's
    MultiWorkerMirroredStrategy ~3 KB of memory each (a new collective key every call, seen in a 5,000-step soak)."""

    def on_train_batch_start(self, ctx: Any, batch: Any, batch_idx: int) -> None:
        self.listing.on_train_batch_begin(batch_idx)

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        self.listing.on_train_batch_end(batch_idx, {"loss": float(loss)})
        if ctx.passed_step(ctx.config.preemption.check_every_n_steps):
            agree_on_asked_stop(ctx)


class KerasModelView:
    """`self.model` of a Keras callback: the model being trained, with model.fit's `stop_training` (stops every
    rank) and `optimizer` (its `learning_rate` the rate of the next step, settable)."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx

    @property
    def stop_training(self) -> bool:
        return bool(self._ctx.state.should_stop)

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        if value:  # with several ranks, at their next agreement (KerasCallbacks: after the hooks of that point)
            self._ctx.state.ask_to_stop("a Keras callback set model.stop_training", self._ctx.world_size)

    @property
    def optimizer(self) -> _OptimizerView:
        return _OptimizerView(self._ctx.module)

    @property
    def metrics(self) -> list[Any]:
        """The compiled metrics as Keras' monitors look for them (mode="auto" reads each one's direction)."""
        import keras

        from unifit.frameworks.keras.keras_compat import metrics_list

        found = []
        for name in getattr(self._ctx.module, "metric_names", lambda: [])():
            try:
                found.append(keras.metrics.get(name))
            except ValueError:
                continue
        return [metrics_list(found)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx.module.model, name)


class _OptimizerView:
    def __init__(self, module: Any) -> None:
        self._module = module

    @property
    def learning_rate(self) -> float:
        return self._module.learning_rate.get()

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self._module.learning_rate.set(value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module.trained_optimizer, name)


def _overrides(callback: Any, hook: str) -> bool:
    """Whether `callback` defines `hook` below Keras' Callback base."""
    for cls in type(callback).__mro__:
        if hook in vars(cls):
            return not (cls.__name__ == "Callback" and cls.__module__.split(".")[0] == "keras")
    return False
