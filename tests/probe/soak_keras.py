"""The Keras twin of soak_torch.SoakModule: many cheap steps, nothing kept between steps."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import unifit


def _regression(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    return x, (x @ np.linspace(-1, 1, 8) + 0.1 * rng.standard_normal(n)).astype(np.float32)


class SoakKeras(unifit.KerasModule):
    def __init__(self, n_train: int = 200, n_val: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.n_train, self.n_val, self.lr = n_train, n_val, lr

    def train_dataset(self):
        return _regression(self.n_train, seed=1)

    def val_dataset(self):
        return _regression(self.n_val, seed=2)

    def build_model(self):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="tanh")(inputs)
        return keras.Model(inputs, keras.layers.Dense(1)(hidden)[:, 0])

    def loss(self, y, y_pred):
        return tf.square(y - y_pred)

    def configure_optimizers(self):
        return keras.optimizers.SGD(learning_rate=self.lr, momentum=0.9)
