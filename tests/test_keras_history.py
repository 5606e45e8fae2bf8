"""Keras users' habits around fit (issue #53): Trainer.fit returns a keras.callbacks.History equal to model.fit's
(and sets it as model.history), a History passed in fills the same, and a data provider without val_dataset()
trains without validation, as model.fit does without validation_data."""

from __future__ import annotations

import numpy as np
import pytest

from tests.probe.keras_compiled_probe import N_TRAIN, N_VAL, arrays, compiled_model

pytestmark = pytest.mark.tf

EPOCHS = 3


def _trainer(tmp_path, **kwargs):
    import unifit

    # one full batch an epoch: the order of the samples does not matter, so model.fit's numbers are ours
    settings = dict(max_epochs=EPOCHS, batch_size=N_TRAIN, lr_scaling="none", progress_bar=False)
    return unifit.Trainer(root_dir=str(tmp_path), **{**settings, **kwargs})


@pytest.mark.timeout(180)
def test_fit_returns_model_fits_history_and_a_history_passed_in_fills_alike(tmp_path):
    import keras

    x, y = arrays(N_TRAIN, seed=1)
    xv, yv = arrays(N_VAL, seed=2)
    reference = compiled_model("objects")
    theirs = reference.fit(x, y, batch_size=N_TRAIN, epochs=EPOCHS, shuffle=False, validation_data=(xv, yv), verbose=0)

    model, passed = compiled_model("objects"), keras.callbacks.History()
    ours = _trainer(tmp_path, callbacks=[passed]).fit(model, data={"train": (x, y), "val": (xv, yv)})

    assert isinstance(ours, keras.callbacks.History) and model.history is ours
    assert ours.epoch == theirs.epoch == [0, 1, 2]
    assert set(theirs.history) <= set(ours.history), (sorted(theirs.history), sorted(ours.history))
    for key, values in theirs.history.items():
        np.testing.assert_allclose(ours.history[key], values, rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(passed.history[key], values, rtol=1e-5, atol=1e-6, err_msg=key)


class _TrainOnly:
    """A data provider with train_dataset() only (TensorFlow's parameter-server tutorial's has no validation)."""

    def train_dataset(self):
        return arrays(N_TRAIN, seed=1)


@pytest.mark.timeout(180)
def test_a_provider_without_val_dataset_trains_without_validation(tmp_path):
    history = _trainer(tmp_path).fit(compiled_model("objects"), data=_TrainOnly())
    assert len(history.history["loss"]) == EPOCHS
    assert not any(key.startswith("val_") for key in history.history), sorted(history.history)
