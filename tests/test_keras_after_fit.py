"""After Trainer.fit the user's compiled keras.Model is the trained model, optimizer included, as model.fit
leaves it: step count, slot variables and current learning rate equal Keras' own model.fit's, and
model.save() / load keep them."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.probe.keras_compiled_probe import N_TRAIN, arrays, compiled_model

pytestmark = pytest.mark.tf

EPOCHS = 3


def _decay(epoch: int, lr: float) -> float:
    return 1e-3 * 0.1**epoch  # 1e-3, 1e-4, 1e-5: the tutorial's LearningRateScheduler


def _adam_model():
    import keras

    model = compiled_model("objects")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=model.loss, metrics=["accuracy"])
    return model


@pytest.mark.timeout(180)
def test_the_users_model_has_the_trained_optimizer_state(tmp_path, caplog):
    import keras

    import unifit

    x, y = arrays(N_TRAIN, seed=1)
    theirs = _adam_model()
    theirs.fit(
        x,
        y,
        batch_size=N_TRAIN,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.LearningRateScheduler(_decay)],
    )

    ours = _adam_model()
    assert len(ours.optimizer.variables) == 2  # not built yet: iterations and learning_rate
    unifit.Trainer(
        max_epochs=EPOCHS,
        batch_size=N_TRAIN,  # one full batch an epoch: the order of the samples does not matter
        lr_scaling="none",
        root_dir=str(tmp_path),
        progress_bar=False,
        callbacks=[keras.callbacks.LearningRateScheduler(_decay)],
    ).fit(ours, data=(x, y))

    mine, reference = ours.optimizer, theirs.optimizer
    assert int(mine.iterations.numpy()) == int(reference.iterations.numpy()) == EPOCHS
    assert float(mine.learning_rate.numpy()) == pytest.approx(1e-5)
    assert len(mine.variables) == len(reference.variables) == 2 + 2 * len(ours.trainable_variables)
    for a, b in zip(mine.variables[2:], reference.variables[2:]):  # Adam's moments, as model.fit left them
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

    path = tmp_path / "my_model.keras"
    ours.save(path)
    with caplog.at_level(logging.WARNING):
        loaded = keras.models.load_model(path)
    assert "Skipping variable loading for optimizer" not in caplog.text
    assert int(loaded.optimizer.iterations.numpy()) == EPOCHS
    for a, b in zip(loaded.optimizer.variables[2:], mine.variables[2:]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    ours.fit(x, y, batch_size=N_TRAIN, epochs=1, verbose=0)  # model.fit goes on from that state
    assert int(ours.optimizer.iterations.numpy()) == EPOCHS + 1
