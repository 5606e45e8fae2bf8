"""The Keras twin of the probe module, for the strategy conformance tests (mirrored, mwms)."""

from __future__ import annotations

import threading

import keras
import numpy as np
import tensorflow as tf

import unifit


def indexed(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Feature 0 carries each sample's index (the model ignores it), so tests can see the shards."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 9)).astype(np.float32)
    x[:, 0] = np.arange(n)
    y = (x[:, 1:] @ np.linspace(-1, 1, 8) + 0.1 * rng.standard_normal(n)).astype(np.float32)
    return x, y


class KerasProbe(unifit.KerasModule):
    def __init__(self, n_train: int = 64, n_val: int = 37, lr: float = 0.05, dropout: float = 0.2) -> None:
        super().__init__()
        self.n_train, self.n_val, self.lr, self.dropout = n_train, n_val, lr, dropout
        self.seen: dict[str, list[int]] = {}
        self.seen_by_replica: dict[str, list[int]] = {}
        self.rank = 0
        self._unifit_epoch = 0

    def train_dataset(self):
        return indexed(self.n_train, seed=1)

    def val_dataset(self):
        return indexed(self.n_val, seed=2)

    def test_dataset(self):
        return indexed(29, seed=3)

    def predict_dataset(self):
        return indexed(23, seed=4)[0]  # x alone

    def predict_step(self, x):
        return tf.stack([x[:, 0], self.model(x, training=False)], axis=1)  # each row: its index, the prediction

    def build_model(self):
        inputs = keras.Input((9,))
        hidden = keras.layers.Dense(16, activation="tanh")(inputs[:, 1:])
        hidden = keras.layers.Dropout(self.dropout)(hidden)
        return keras.Model(inputs, keras.layers.Dense(1)(hidden)[:, 0])

    def loss(self, y, y_pred):
        return tf.square(y - y_pred)

    def _record(self, phase: str, x, training: bool) -> None:
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group

        def record(replica_id, indices):
            key = f"train_epoch_{self._unifit_epoch}" if training else "val"
            values = [int(i) for i in indices.numpy()]
            self.seen.setdefault(key, []).extend(values)
            self.seen_by_replica.setdefault(f"{key}/replica{int(replica_id)}", []).extend(values)
            return 0

        tf.py_function(record, [replica, x[:, 0]], tf.int32)

    # MirroredStrategy traces each replica in a thread of its own and switches between them at merge
    # calls, so the batch metrics() reads is kept per thread (one attribute would hold another replica's)
    _batch = threading.local()

    def training_step(self, x, y):
        self._record("train", x, True)
        self._batch.x = x  # for metrics() below, within the same compiled step
        y_pred = self.model(x, training=True)
        return self.loss(y, y_pred), y_pred

    def validation_step(self, x, y):
        self._record("val", x, False)
        self._batch.x = x
        y_pred = self.model(x, training=False)
        return self.loss(y, y_pred), y_pred

    def metrics(self, y, y_pred):
        from unifit.strategies import environment

        rank_plus_one = float(environment.detect().rank + 1)
        return {"index_mean": self._batch.x[:, 0], "rank_plus_one": tf.fill(tf.shape(y), rank_plus_one)}

    def weights(self) -> list[np.ndarray]:
        return [np.asarray(v.numpy(), dtype=np.float64) for v in self.model.weights]

    def replicas_identical(self) -> bool:
        """Every variable holds the same value on every replica (MirroredVariable copies)."""
        for v in self.model.weights:
            tf_var = getattr(v, "value", v)
            copies = [c.numpy() for c in getattr(tf_var, "values", [tf_var])]
            if any(not np.array_equal(copies[0], c) for c in copies[1:]):
                return False
        return True

    def configure_optimizers(self):
        return keras.optimizers.SGD(learning_rate=self.lr, momentum=0.9)
