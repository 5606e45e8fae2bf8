"""A compiled keras.Model named in YAML (module.class_path: a factory function), its data provider,
and a callback that reports each rank's weights, for tests/test_keras_compiled.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import keras
import numpy as np

import unifit

N_TRAIN, N_VAL, FEATURES, CLASSES = 32, 12, 4, 3


def arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = (np.argmax(x[:, :CLASSES], axis=1) + (x[:, 3] > 1.0)).astype(np.int32) % CLASSES
    return x, y


def compiled_model(form: str = "objects", lr: float = 0.5) -> keras.Model:
    """Dense -> Dense logits (objects) or softmax (strings), compiled; weights come from the
    seeded initializers, so every run (and every rank) starts from the same ones."""
    keras.utils.set_random_seed(7)
    strings = form == "strings"
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(CLASSES, activation="softmax" if strings else None),
        ]
    )
    if strings:
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    else:
        model.compile(
            optimizer=keras.optimizers.SGD(lr),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
    return model


class Data:
    """A unifit data provider (train_dataset()/val_dataset())."""

    def train_dataset(self):
        return arrays(N_TRAIN, seed=1)

    def val_dataset(self):
        return arrays(N_VAL, seed=2)


class PipelineData(Data):
    """The same data as tf.data pipelines, shuffled and batched by 8 as users write them."""

    def train_dataset(self):
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(arrays(N_TRAIN, seed=1)).shuffle(N_TRAIN).batch(8)

    def val_dataset(self):
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(arrays(N_VAL, seed=2)).batch(8)


def _replicas_identical(model) -> bool:
    for v in model.weights:
        tf_var = getattr(v, "value", v)
        copies = [c.numpy() for c in getattr(tf_var, "values", [tf_var])]
        if any(not np.array_equal(copies[0], c) for c in copies[1:]):
            return False
    return True


class WeightsReport(unifit.Callback):
    """At set-up (initial weights) and at teardown (after the weights were copied back) each rank
    writes report_<rank>.json: trained and user-model weights, replica agreement, metrics."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.initial: list = []

    def on_fit_start(self, ctx) -> None:
        self.initial = [w.tolist() for w in ctx.module.model.get_weights()]

    def on_teardown(self, ctx) -> None:
        module = ctx.module
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        report = {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "initial": self.initial,
            "trained": [w.tolist() for w in module.model.get_weights()],
            "user": [w.tolist() for w in module.user_model.get_weights()],
            "user_is_trained_copy": module.user_model is not module.model,
            "replicas_identical": _replicas_identical(module.model),
            "metrics": dict(ctx.state.metrics),
            "pid": os.getpid(),
        }
        (Path(self.out_dir) / f"report_{ctx.rank}.json").write_text(json.dumps(report))
