"""The digits classifier as a unifit KerasModule (the twin of torch_module.py)."""

from __future__ import annotations

import keras

import unifit


class DigitsKeras(unifit.KerasModule):
    def __init__(self, hidden: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.hidden, self.lr = hidden, lr

    def build_model(self) -> keras.Model:  # called inside the strategy's scope
        return keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(self.hidden, activation="relu"), keras.layers.Dense(10)]
        )

    def loss(self, y, logits):  # per-example losses; averaged over the global batch for you
        return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)

    def metrics(self, y, logits):  # per-example values, logged as train/acc and val/acc
        return {"acc": keras.metrics.sparse_categorical_accuracy(y, logits)}

    def configure_optimizers(self):  # lr is the BASE lr; lr_scaling multiplies it
        return keras.optimizers.SGD(learning_rate=self.lr, momentum=0.9)
