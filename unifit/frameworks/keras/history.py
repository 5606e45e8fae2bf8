"""What model.fit returns: a keras.callbacks.History of each epoch's logs, under Keras' names.

The engine records each epoch's metrics (reduced over every rank, so every rank holds the same History) and
hands the History out when the fit ends; it is also set as the user's `model.history`, as model.fit sets it.
"""

from __future__ import annotations

from typing import Any


def keras_logs(metrics: dict[str, float], only_validation: bool = False) -> dict[str, float]:
    """unifit's metric names as model.fit's logs name them: train/loss -> loss, val/acc -> val_acc, lr ->
    learning_rate; other names as they are."""
    logs: dict[str, float] = {}
    for name, value in metrics.items():
        if name.startswith("val/"):
            logs["val_" + name[4:]] = value
        elif only_validation:
            continue
        elif name.startswith("train/"):
            logs[name[6:]] = value
        elif name == "lr":
            logs["learning_rate"] = value
        elif not name.startswith(("throughput/", "lr/")):  # unifit's own measures are not model.fit's logs
            logs[name] = value
    return logs


class FitHistory:
    """The epochs' logs of one fit, as a keras.callbacks.History once it ends."""

    def __init__(self) -> None:
        self._logs: list[dict[str, float]] = []

    def add_epoch(self, metrics: dict[str, float]) -> None:
        self._logs.append({k: float(v) for k, v in keras_logs(metrics).items()})

    def history(self, last_epoch: int, steps: int, epochs: int, model: Any) -> Any:
        """The History of the recorded epochs, which end with epoch `last_epoch` (1-based; a resumed fit
        records only its own, numbered as they ran, as model.fit's initial_epoch does)."""
        import keras  # here: this module is also read by torch runs (keras_logs, for the callbacks layer)

        history = keras.callbacks.History()
        history.set_params({"verbose": 0, "epochs": epochs, "steps": steps})
        if model is not None:
            history.set_model(model)
        history.on_train_begin()
        first = last_epoch - len(self._logs)
        for epoch, logs in enumerate(self._logs, start=first):
            history.epoch.append(epoch)
            for key, value in logs.items():
                history.history.setdefault(key, []).append(value)
        if model is not None:
            model.history = history
        return history
