"""KerasModule: the Keras twin of TrainModule.

    TrainModule (PyTorch)                  KerasModule (TensorFlow/Keras)
    __init__: build layers                 __init__: keep hyperparameters; build_model() builds
                                           the keras.Model (unifit calls it inside strategy.scope())
    training_step(batch) -> loss           loss(y, y_pred) -> per-example losses (or override
                                           training_step(x, y) -> per-example losses)
    self.log("val/acc", value)             metrics(y, y_pred) -> {"acc": per-example values}
                                           (logged as train/acc and val/acc, sample-weighted)
    self.log("val/auc", torchmetric)       stateful_metrics() -> {"auc": keras.metrics.AUC()}
    configure_optimizers() -> optimizer    configure_optimizers() -> keras optimizer (base lr)
    train_dataset()/val_dataset()          the same: arrays (x, y[, sample_weight]) or an unbatched
                                           tf.data.Dataset of them (read lazily; weights multiply
                                           the per-example losses, docs/keras.md)
    test_step / predict_step               test_step(x, y) like validation_step; predict_step(x) -> outputs
    test_dataset()/predict_dataset()       the same (predict: x alone is enough)

Steps run inside one compiled tf.function, so per-step values are returned, not logged with
Python side effects; the engine averages them over replicas and workers by sample count.

trainer.precision bf16-mixed / 16-mixed: build_model() runs under Keras' mixed_bfloat16 /
mixed_float16 policy (variables float32, compute in the low dtype) and the model's floating outputs
come back in float32, so loss() and metrics() see float32. trainer.compile: the per-replica forward,
loss and gradients (training_step / validation_step and metrics) are compiled by XLA; they must use
ops XLA supports (no tf.py_function, no string ops).
"""

from __future__ import annotations

from typing import Any

from unifit.frameworks.module import ModuleBase


class KerasModule(ModuleBase):
    framework = "tensorflow"
    engine = "unifit.frameworks.keras.engine:KerasEngine"

    def __init__(self) -> None:
        self.model: Any = None

    own_step = False  # True: a keras.Model trained by its own train_step / test_step (frameworks/keras/own_step.py)
    # training batches run in one compiled call (Keras' compile(steps_per_execution=...)): fewer calls from Python
    steps_per_execution = 1

    # set by the engine while fit trains: what Keras callbacks reach through model.optimizer
    trained_optimizer: Any = None  # the optimizer the step uses (the compiled one's twin, with unifit's lr schedule)
    learning_rate: Any = None  # frameworks/keras/lr.py's LearningRateControl
    built_for_input: Any = None  # (x shape without the batch, dtype): what the model's variables were built for

    def build_model(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define build_model() returning a keras.Model")

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define configure_optimizers() returning a keras optimizer"
        )

    def loss(self, y: Any, y_pred: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define loss(y, y_pred) returning per-example losses")

    def metric_names(self) -> list[str]:
        """The names metrics are logged under (val/<name>): Keras callbacks' mode="auto" looks them up."""
        return []

    def metrics(self, y: Any, y_pred: Any) -> dict[str, Any]:
        """Per-example metric values by name (logged as train/<name> and val/<name>)."""
        return {}

    def stateful_metrics(self) -> dict[str, Any]:
        """Metrics that are not means, by name: new keras.metrics.Metric objects on every call (e.g.
        {"auc": keras.metrics.AUC()}), updated with (y, y_pred) every step and computed over every
        replica and worker at the end of the phase (logged as train/<name>, val/<name>, test/<name>)."""
        return {}

    def training_step(self, x: Any, y: Any) -> tuple[Any, Any]:
        """(per-example losses, predictions); override for a custom forward pass."""
        y_pred = self.model(x, training=True)
        return self.loss(y, y_pred), y_pred

    def validation_step(self, x: Any, y: Any) -> tuple[Any, Any]:
        y_pred = self.model(x, training=False)
        return self.loss(y, y_pred), y_pred

    def test_step(self, x: Any, y: Any) -> tuple[Any, Any]:
        """Trainer.test's step (logged as test/loss, test/<metric>); validation_step by default."""
        return self.validation_step(x, y)

    def predict_step(self, x: Any) -> Any:
        """Trainer.predict's step: one output row per sample."""
        return self.model(x, training=False)

    def __call__(self, x: Any, training: bool = False) -> Any:
        return self.model(x, training=training)
