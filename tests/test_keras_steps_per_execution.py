"""model.compile(steps_per_execution=N) (issue #53): N training batches in one compiled call, as model.fit runs
them. In one process against Keras' own model.fit on the same compiled model and pipeline: the same weights, the
same History, the batch hooks called once per call with its first and last batch index (Keras' begin/end step);
a call is cut at max_steps, a checkpoint every_n_steps falls at the first call that passes the step and resumes to
the uninterrupted result; a model with its own train_step runs it N times per call. Under mirrored, mwms and horovod
(the Keras zoo's text model, tests/test_keras_zoo.py) and parameter-server (tests/probe/tf_ps_trainer.py, as
TensorFlow's tutorial compiles it) it runs in the same launches as the rest."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.tf

SAMPLES, BATCH, PER_CALL = 200, 16, 4  # 13 batches per epoch: calls of 4, 4, 4 and 1
PER_OWN = 3


def _data():
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = (x[:, 0] + 0.5 * rng.normal(size=SAMPLES) > 0).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def _model(per_call: int):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        # AUC is not a mean: its state is updated from every batch's outputs (kept across the call's loop)
        metrics=[keras.metrics.BinaryAccuracy(threshold=0.0), keras.metrics.AUC(from_logits=True, name="auc")],
        steps_per_execution=per_call,
    )
    return model


def _calls_recorder():
    import keras

    class Calls(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int]] = []

        def on_train_batch_begin(self, batch, logs=None) -> None:
            self.calls.append(("begin", batch))

        def on_train_batch_end(self, batch, logs=None) -> None:
            self.calls.append(("end", batch))

    return Calls()


def _trainer(tmp_path, **options):
    import unifit

    base = dict(progress_bar=False, tensorboard={"enabled": False}, seed=0, root_dir=str(tmp_path))
    return unifit.Trainer(**{**base, **options})


def _max_diff(a, b) -> float:
    return max(float(np.abs(np.asarray(u) - np.asarray(v)).max()) for u, v in zip(a, b, strict=True))


@pytest.mark.timeout(240)
def test_several_batches_per_call_train_as_model_fit_does(tmp_path):
    ours, keras_own = _calls_recorder(), _calls_recorder()
    model = _model(PER_CALL)
    history = _trainer(tmp_path / "a", max_epochs=2, checkpoint={"enabled": False}, callbacks=[ours]).fit(
        model, data={"train": _data(), "val": _data()}
    )
    reference = _model(PER_CALL)
    expected = reference.fit(_data(), validation_data=_data(), epochs=2, verbose=0, callbacks=[keras_own])

    # Keras' own hooks: once per call, its first batch at the beginning and its last at the end (model.fit says
    # 15 for the epoch's last call, which holds batch 12 alone)
    per_epoch = math.ceil(SAMPLES / BATCH)
    starts = range(0, per_epoch, PER_CALL)
    one_epoch = [
        (hook, i) for start in starts for hook, i in [("begin", start), ("end", min(start + 3, per_epoch - 1))]
    ]
    assert ours.calls == one_epoch * 2, ours.calls
    assert [c for c in ours.calls if c[0] == "begin"] == [c for c in keras_own.calls if c[0] == "begin"]
    assert _max_diff(model.get_weights(), reference.get_weights()) <= 1e-6
    assert set(expected.history) <= set(history.history)
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, atol=1e-5, rtol=0, err_msg=key)

    one_per_call = _model(1)
    _trainer(tmp_path / "b", max_epochs=2, checkpoint={"enabled": False}).fit(one_per_call, data={"train": _data()})
    assert _max_diff(one_per_call.get_weights(), model.get_weights()) <= 1e-6


@pytest.mark.timeout(240)
def test_calls_stop_at_max_steps_and_checkpoints_fall_at_the_first_call_past_the_interval(tmp_path):
    """Calls of 4 steps: 4, 8, then 2 to max_steps 10; every_n_steps 5 saves at 8 (past 5) and 10; the fit resumed
    from step 8, mid-epoch, ends where the uninterrupted one ends."""
    model = _model(PER_CALL)
    trainer = _trainer(tmp_path / "cut", max_steps=10, checkpoint={"enabled": True, "every_n_steps": 5})
    trainer.fit(model, data={"train": _data()})
    assert trainer.state.global_step == 10
    saved = sorted(p.name for p in (tmp_path / "cut").rglob("epoch=*-step=*") if p.is_dir())
    assert any(name.endswith("step=0000008") for name in saved), saved
    assert not any(name.endswith(("step=0000005", "step=0000009")) for name in saved), saved

    whole = _model(PER_CALL)
    _trainer(tmp_path / "whole", max_epochs=2, checkpoint={"enabled": False}).fit(whole, data={"train": _data()})
    (at_8,) = [p for p in (tmp_path / "cut").rglob("epoch=*-step=0000008") if p.is_dir()]
    resumed = _model(PER_CALL)
    _trainer(tmp_path / "cut", max_epochs=2, checkpoint={"enabled": True}).fit(
        resumed, data={"train": _data()}, ckpt_path=str(at_8)
    )
    assert _max_diff(resumed.get_weights(), whole.get_weights()) == 0.0


@pytest.mark.timeout(240)
def test_a_model_with_its_own_train_step_runs_it_per_batch_of_the_call(tmp_path):
    import keras
    import tensorflow as tf

    class Regressor(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.tracker = keras.metrics.Mean(name="loss")

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True)[:, 0] - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            self.tracker.update_state(loss)
            return {"loss": self.tracker.result()}

        @property
        def metrics(self):
            return [self.tracker]

    def regressor():
        keras.utils.set_random_seed(0)
        model = Regressor()
        model.compile(optimizer=keras.optimizers.SGD(0.05), steps_per_execution=PER_OWN)
        return model

    model, calls = regressor(), _calls_recorder()
    history = _trainer(tmp_path, max_epochs=2, checkpoint={"enabled": False}, callbacks=[calls]).fit(
        model, data={"train": _data()}
    )
    reference = regressor()
    expected = reference.fit(_data(), epochs=2, verbose=0)
    assert [i for hook, i in calls.calls if hook == "begin"] == [0, 3, 6, 9, 12] * 2, calls.calls
    assert _max_diff(model.get_weights(), reference.get_weights()) <= 1e-6
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], atol=1e-6, rtol=0)


def test_a_steps_per_execution_that_is_not_a_count_is_refused_in_one_line():
    import keras

    from unifit.errors import ConfigError
    from unifit.frameworks.keras.compiled import CompiledModel

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=0)
    with pytest.raises(ConfigError, match=r"steps_per_execution=0\); give a whole number of batches per compiled"):
        CompiledModel(model)
