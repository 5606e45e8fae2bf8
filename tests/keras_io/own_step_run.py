"""Run keras-io's VAE and GAN (their own train_step) by model.fit and by unifit.Trainer under one strategy, in
a fresh interpreter (mirrored's logical CPU devices must be made before TensorFlow starts), and write both
Histories and weights as JSON: `python -m tests.keras_io.own_step_run single|mirrored OUT.json`."""

from __future__ import annotations

import json
import sys
import tempfile

EPOCHS = 2
N = 64


def main(strategy: str, out: str) -> None:
    import unifit
    from unifit.frameworks.keras.compiled import CompiledModel

    options = {"strategy": strategy, "strategy_options": {"devices": 2}} if strategy == "mirrored" else {}
    replicas = 2 if strategy == "mirrored" else 1
    results = {}
    for name in ("vae", "gan"):
        make, data = _model_and_data(name)
        theirs = _keras_fit(make, data, strategy) if strategy == "single" else None  # mirrored: after unifit's
        root = tempfile.mkdtemp(prefix=f"unifit-own-step-{name}-")
        trainer = unifit.Trainer(
            root_dir=root,
            max_epochs=EPOCHS,
            batch_size=16 // replicas,
            lr_scaling="none",
            progress_bar=False,
            **options,
        )
        module = CompiledModel(make)  # the function is called in the strategy's scope, as Keras asks
        history = trainer.fit(module, data=data)
        ours = {"history": history.history, "weights": [w.tolist() for w in module.model.get_weights()]}
        reference = None if theirs else _reference_model(name)
        results[name] = {
            "unifit": ours,
            "keras": theirs or (_keras_fit(reference, data, strategy) if reference else None),
        }
    with open(out, "w") as f:
        json.dump(results, f)


def _model_and_data(name: str):
    """The model's function and its data provider (nothing of TensorFlow made yet)."""
    if name == "vae":
        from tests.keras_io.vae import Digits, make_vae

        return make_vae, Digits(N)
    from tests.keras_io.gan import Images, make_gan

    return make_gan, Images(N)


def _reference_model(name: str):
    """model.fit's model under a strategy, where Keras 3 cannot train the tutorial's: the VAE needs a call()
    (vae.py); the GAN it cannot train there at all, even with a call() and its optimizers built before fit
    (a collective of its two Adams fails: "CollectiveReduceV2"), so it has none."""
    from tests.keras_io.vae import make_vae_with_call

    return make_vae_with_call if name == "vae" else None


def _keras_fit(make, data, strategy: str) -> dict:
    import numpy as np
    import tensorflow as tf

    if strategy == "mirrored":
        scope = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope()
    else:
        scope = tf.distribute.get_strategy().scope()
    with scope:
        model = make()
    # the samples in one array, as the tutorials give them (over an unbatched pipeline of unknown length, Keras
    # runs one step more each epoch: "Your input ran out of data", and its Mean metrics take 0.8x their values)
    samples = np.stack(list(data.train_dataset().as_numpy_iterator()))
    history = model.fit(tf.data.Dataset.from_tensor_slices(samples).batch(16), epochs=EPOCHS, verbose=0)
    return {"history": history.history, "weights": [w.tolist() for w in model.get_weights()]}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
