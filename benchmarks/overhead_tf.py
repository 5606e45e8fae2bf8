"""unifit vs Keras model.fit: the same Keras model and data, single device and under
MirroredStrategy (2 logical CPUs), interleaved in this one script; steps/s and the ratio. Two models:
dense (Dense 32-64-10, overhead-bound), conv (Conv2D 16x3x3 on 16x16x1 images, MaxPool, Dense 10) and cnn
(MNIST-sized, two conv layers: compute-bound), each under model.fit's defaults (Keras 3 compiles its step with XLA where it can,
jit_compile="auto") and unifit's.

    .venv/bin/python benchmarks/overhead_tf.py [--reps 3]

Both train one epoch after a warm-up epoch (graph tracing excluded); unifit runs with its
defaults except the progress bar, checkpoints and TensorBoard (fit gets no callbacks either).
Logical devices must be configured before TensorFlow starts, so the script splits the CPU
into 2 devices once; the single-device runs use the default strategy on /cpu:0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from bench_paths import RESULTS  # beside this script

import unifit  # noqa: E402
from unifit.strategies.environment import ClusterEnvironment  # noqa: E402
from unifit.strategies.tf_distribute import MirroredStrategy  # noqa: E402

SAMPLES, FEATURES, BATCH = 64 * 400, 32, 64
SHAPES = {"dense": (FEATURES,), "conv": (16, 16, 1), "cnn": (28, 28, 1)}
MODEL = "dense"  # the model being run (set per case)


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, *SHAPES[MODEL])).astype(np.float32)
    return x, rng.integers(0, 10, SAMPLES)


def build():
    if MODEL == "cnn":
        layers = [
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    elif MODEL == "conv":
        layers = [
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    else:
        layers = [keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    return keras.Sequential([keras.Input(SHAPES[MODEL]), *layers])


class Module(unifit.KerasModule):
    def build_model(self):
        return build()

    def loss(self, y, logits):
        return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)

    def configure_optimizers(self):
        return keras.optimizers.SGD(0.01, momentum=0.9)

    def train_dataset(self):
        return data()


class EpochTimer(unifit.Callback):
    def __init__(self):
        self.times = []

    def on_train_epoch_start(self, ctx):
        self.start = time.perf_counter()

    def on_train_epoch_end(self, ctx):
        self.times.append(time.perf_counter() - self.start)


def run_unifit(strategy: str, replicas: int) -> float:
    timer = EpochTimer()
    trainer = unifit.Trainer(
        strategy=strategy,
        max_epochs=2,
        batch_size=BATCH // replicas,
        lr_scaling="none",
        strategy_options={"devices": replicas} if strategy == "mirrored" else {},
        root_dir=tempfile.mkdtemp(),
        progress_bar=False,
        checkpoint={"enabled": False},
        tensorboard={"enabled": False},
        callbacks=[timer],
    )
    trainer.fit(Module())
    return (SAMPLES // BATCH) / timer.times[-1]


class FitTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.start)


def run_fit(replicas: int) -> float:
    strategy = (
        tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
        if replicas > 1
        else tf.distribute.get_strategy()
    )  # the default strategy, as plain model.fit uses
    x, y = data()
    with strategy.scope():
        model = build()
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    timer = FitTimer()
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=True, callbacks=[timer])
    return (SAMPLES // BATCH) / timer.times[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=f"{RESULTS}/overhead_tf.md")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    MirroredStrategy(ClusterEnvironment(), options={"devices": 2})._make()  # split the CPU before TF starts
    cases = {
        "dense, single device": ("dense", ("single", 1), 1),
        "dense, mirrored, 2 logical CPUs": ("dense", ("mirrored", 2), 2),
        "conv, single device": ("conv", ("single", 1), 1),
        "cnn, single device": ("cnn", ("single", 1), 1),
    }  # not conv under mirrored: a second model's MirroredStrategy in one process reuses collective instance keys
    results = {case: {"unifit": [], "model.fit": []} for case in cases}
    global MODEL
    for rep in range(args.reps):
        for case, (model, (strategy, replicas), fit_replicas) in cases.items():
            MODEL = model
            order = ("unifit", "model.fit") if rep % 2 == 0 else ("model.fit", "unifit")
            for runner in order:
                rate = run_unifit(strategy, replicas) if runner == "unifit" else run_fit(fit_replicas)
                results[case][runner].append(rate)
                print(rep, case, runner, round(rate), flush=True)
    lines = [
        "# Keras: unifit vs model.fit (CPU, steps/s of one epoch after a warm-up epoch)",
        "",
        f"Command: `.venv/bin/python benchmarks/overhead_tf.py --reps {args.reps}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"intra-op threads 1; date {time.strftime('%Y-%m-%d')}. Models: dense (Dense {FEATURES}-64-10), conv "
        f"(Conv2D 16x3x3 on 16x16x1, MaxPool 2, Dense 10), cnn (MNIST-sized: Conv2D 32 and 64 3x3 on 28x28x1, each with "
        f"MaxPool 2, Dense 10); global batch {BATCH}, {SAMPLES // BATCH} steps/epoch; "
        f"median of {args.reps} interleaved runs.",
        "",
        "| case | model.fit steps/s | unifit steps/s | unifit / model.fit | per rep (median) |",
        "|---|---|---|---|---|",
    ]
    for case, r in results.items():
        fit, uni = statistics.median(r["model.fit"]), statistics.median(r["unifit"])
        per_rep = statistics.median(u / f for u, f in zip(r["unifit"], r["model.fit"]))  # the same rep: the same load
        lines.append(f"| {case} | {fit:.0f} | {uni:.0f} | {uni / fit:.2f} | {per_rep:.2f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
