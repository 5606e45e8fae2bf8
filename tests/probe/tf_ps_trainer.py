"""A user's script that trains a compiled Keras model with unifit's Trainer on a parameter-server cluster
(`unifit launch --strategy parameter-server -- tf_ps_trainer.py --root-dir DIR`, or SageMaker's parameter_server
distribution with the hyperparameter script). Data: 10 classes of noisy 8x8 templates, learnable in a few epochs."""

import argparse

import numpy as np

import unifit
from unifit.frameworks.keras.compiled import CompiledModel

parser = argparse.ArgumentParser()
parser.add_argument("--root-dir", "--root_dir", required=True)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

# the Trainer first: it connects this process (the chief) to the cluster before any model is built
trainer = unifit.Trainer(
    strategy="parameter-server", max_epochs=args.epochs, batch_size=32, progress_bar=False, root_dir=args.root_dir
)


def classifier():
    import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=10,  # as TensorFlow's parameter-server tutorial compiles its model for model.fit
    )
    return model


rng = np.random.default_rng(0)
templates = rng.normal(size=(10, 64)).astype(np.float32)
y = rng.integers(0, 10, size=1024)
x = templates[y] + rng.normal(scale=0.5, size=(1024, 64)).astype(np.float32)
data = {"train": (x[:768], y[:768]), "val": (x[768:], y[768:])}
trainer.fit(CompiledModel(classifier, data=data))
