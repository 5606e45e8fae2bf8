"""A Keras binary classifier with metrics that are not means (AUC, Precision) as stateful metrics."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import unifit


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = ((x @ np.linspace(-1, 1, 8) + 0.8 * rng.standard_normal(n)) > 0).astype(np.float32)
    return x, y


class KerasMetricsProbe(unifit.KerasModule):
    def train_dataset(self):
        return _data(64, seed=1)

    def val_dataset(self):
        return _data(37, seed=2)

    def build_model(self):
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, activation="sigmoid")])

    def loss(self, y, y_pred):
        return keras.losses.binary_crossentropy(y[:, None], y_pred)

    def stateful_metrics(self):
        return {"auc": keras.metrics.AUC(num_thresholds=1000), "precision": keras.metrics.Precision()}

    def configure_optimizers(self):
        return keras.optimizers.SGD(learning_rate=0.1)

    def training_step(self, x, y):
        y_pred = self.model(x, training=True)
        return self.loss(y, y_pred), tf.reshape(y_pred, [-1])

    def validation_step(self, x, y):
        y_pred = self.model(x, training=False)
        return self.loss(y, y_pred), tf.reshape(y_pred, [-1])
