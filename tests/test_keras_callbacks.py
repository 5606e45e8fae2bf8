"""Keras callbacks and model.fit's arguments under unifit (callbacks/keras_callbacks.py): passed to the Trainer as to
model.fit, they end a fit exactly as model.fit ends it on the same tf.data pipeline (weights, the checkpoint file,
the CSV log, the early stop, the learning rates); TensorBoard and BackupAndRestore map onto unifit's own; what
cannot be honoured is one line. The keras-io weather page with its callbacks under every Keras strategy:
tests/test_keras_zoo.py."""

from __future__ import annotations

import csv

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import unifit  # noqa: E402
from unifit.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.tf

BATCH = 16
QUIET = {"progress_bar": False, "lr_scaling": "none", "tensorboard": {"enabled": False}}


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _data() -> tuple[tf.data.Dataset, tf.data.Dataset]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype("float32")
    y = ((x[:, 0] > 0).astype("int64") + (x[:, 1] > 0)).astype("int64")
    return (
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
        tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).batch(BATCH),
    )


class Recorder(keras.callbacks.Callback):
    """A user's own callback: the logs of every epoch, the lr each epoch starts with, the batches it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[tuple[int, dict]] = []
        self.lrs: list[float] = []
        self.batches = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        assert np.isfinite(logs["loss"])

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((epoch, {k: v for k, v in logs.items() if k != "learning_rate"}))


def _callbacks(folder) -> list:
    return [
        keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=1, restore_best_weights=True),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=1.0),
        keras.callbacks.ModelCheckpoint(
            str(folder / "best.weights.h5"), monitor="val_loss", save_best_only=True, save_weights_only=True
        ),
        keras.callbacks.CSVLogger(str(folder / "log.csv")),
        keras.callbacks.TerminateOnNaN(),
        Recorder(),
    ]


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


@pytest.mark.timeout(240)
def test_keras_callbacks_end_a_fit_as_model_fit_ends_it(tmp_path):
    train, val = _data()
    (tmp_path / "keras").mkdir()
    (tmp_path / "unifit").mkdir()
    theirs, their_callbacks = _model(), _callbacks(tmp_path / "keras")
    theirs.fit(train, validation_data=val, epochs=8, callbacks=their_callbacks, verbose=0)
    ours, our_callbacks = _model(), _callbacks(tmp_path / "unifit")
    trainer = unifit.Trainer(max_epochs=8, root_dir=str(tmp_path / "run"), callbacks=our_callbacks, **QUIET)
    trainer.fit(ours, data={"train": train, "val": val})  # returns model.fit's History; the fit's state:
    state = trainer.state

    stopped = their_callbacks[0].stopped_epoch
    assert 0 < stopped < 7 and our_callbacks[0].stopped_epoch == stopped  # EarlyStopping stopped both alike
    assert state.epoch == stopped + 1
    for a, b in zip(ours.get_weights(), theirs.get_weights()):  # restore_best_weights, copied into the user's model
        np.testing.assert_array_equal(a, b)
    saved = {}
    for kind in ("keras", "unifit"):
        model = _model()
        model.load_weights(str(tmp_path / kind / "best.weights.h5"))
        saved[kind] = model.get_weights()
    for a, b in zip(saved["unifit"], saved["keras"]):
        np.testing.assert_array_equal(a, b)
    ours_csv, theirs_csv = _rows(tmp_path / "unifit" / "log.csv"), _rows(tmp_path / "keras" / "log.csv")
    assert [sorted(row) for row in ours_csv] == [sorted(row) for row in theirs_csv]
    for mine, their in zip(ours_csv, theirs_csv):
        assert mine == pytest.approx(their, rel=1e-6)
    recorded, their_recorded = our_callbacks[-1], their_callbacks[-1]
    assert recorded.lrs == pytest.approx(their_recorded.lrs) and min(recorded.lrs) < max(recorded.lrs)  # reduced
    assert recorded.batches == their_recorded.batches == 8 * (stopped + 1)
    for (epoch, logs), (their_epoch, their_logs) in zip(recorded.epochs, their_recorded.epochs):
        assert epoch == their_epoch and logs == pytest.approx(their_logs, rel=1e-6)


@pytest.mark.timeout(240)
def test_model_fits_arguments_class_weight_validation_freq_and_initial_epoch(tmp_path):
    train, val = _data()
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))
    arguments = {"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}, "validation_freq": 2, "initial_epoch": 1}
    theirs, recorded_theirs = _model(), Recorder()
    theirs.fit(train, validation_data=val, epochs=4, callbacks=[schedule, recorded_theirs], verbose=0, **arguments)
    ours, recorded = _model(), Recorder()
    trainer = unifit.Trainer(max_epochs=4, root_dir=str(tmp_path), callbacks=[schedule, recorded], **QUIET)
    trainer.fit(ours, data={"train": train, "val": val}, **arguments)
    state = trainer.state
    assert state.epoch == 4 and [e for e, _ in recorded.epochs] == [e for e, _ in recorded_theirs.epochs] == [1, 2, 3]
    assert ["val_loss" in logs for _, logs in recorded.epochs] == [True, False, True]  # (epoch + 1) % 2 == 0
    assert recorded.lrs == pytest.approx(recorded_theirs.lrs) == [0.05, 0.1 / 3, 0.025]
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    unweighted = _model()
    unifit.Trainer(max_epochs=4, root_dir=str(tmp_path / "plain"), **QUIET).fit(
        unweighted, data={"train": train, "val": val}
    )
    assert not np.allclose(unweighted.get_weights()[0], ours.get_weights()[0])  # the class weights trained


class _Interrupt(keras.callbacks.Callback):
    """Stops the process the way a preempted job ends: an exception at the start of epoch `at`."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError(f"interrupted at epoch {epoch}")


@pytest.mark.timeout(240)
def test_backup_and_restore_and_tensorboard_map_onto_unifits_own(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, val = _data()
    backup, logs = tmp_path / "backup", tmp_path / "tb"

    def run(*more) -> unifit.TrainState:
        reduce = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=1.0)
        callbacks = [keras.callbacks.BackupAndRestore(str(backup)), keras.callbacks.TensorBoard(str(logs)), reduce]
        options = {key: value for key, value in QUIET.items() if key != "tensorboard"}
        trainer = unifit.Trainer(max_epochs=3, root_dir=str(tmp_path / "run"), callbacks=[*callbacks, *more], **options)
        trainer.fit(_model(), data={"train": train, "val": val})
        return trainer.state

    with pytest.raises(RuntimeError, match="interrupted at epoch 2"):
        run(_Interrupt(2))
    assert (backup / "last.json").exists()  # the backup of the interrupted run
    resumed = run()  # continues from it: one more epoch, at the rate reduced before the interruption
    assert resumed.epoch == 3 and resumed.global_step == 24
    assert resumed.metrics["lr"] == pytest.approx(0.05)  # reduced once (after the first run's second epoch)
    assert not backup.exists()  # training ended well: the backup is gone, as Keras deletes it
    events = EventAccumulator(str(logs)).Reload()
    assert "val/loss" in events.Tags()["scalars"]


@pytest.mark.timeout(240)
def test_endless_pipelines_with_steps_per_epoch_and_validation_steps_read_on_as_model_fit_and_resume(tmp_path):
    """repeat() without a count and steps_per_epoch: each epoch reads on where the last stopped (5 steps of 16 of
    a 128-sample set: epochs cross the set's end), as model.fit does; a resume reads past what was trained on.
    An endless validation pipeline with validation_steps: each validation reads the stream's first 3 batches anew
    (of a 2-batch set: its first batch twice), as model.fit resets its evaluation iterator; every epoch's val_loss
    equals model.fit's (reading on from one validation to the next would not)."""
    train, val = _data()

    def endless() -> tf.data.Dataset:  # a new one per run: a shuffle draws another order per iterator made
        return train.unbatch().shuffle(128, seed=1).repeat().batch(BATCH)

    def endless_val() -> tf.data.Dataset:
        return val.unbatch().repeat().batch(BATCH)

    theirs = _model()
    history = theirs.fit(
        endless(), validation_data=endless_val(), epochs=3, steps_per_epoch=5, validation_steps=3, verbose=0
    )
    ours, recorder = _model(), Recorder()
    trainer = unifit.Trainer(max_epochs=3, root_dir=str(tmp_path / "whole"), callbacks=[recorder], **QUIET)
    trainer.fit(ours, data={"train": endless(), "val": endless_val()}, steps_per_epoch=5, validation_steps=3)
    state = trainer.state
    assert state.global_step == 15
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    val_losses = [logs["val_loss"] for _, logs in recorder.epochs]
    np.testing.assert_allclose(val_losses, history.history["val_loss"], rtol=1e-5)
    with pytest.raises(RuntimeError, match="interrupted at epoch 2"):
        unifit.Trainer(max_epochs=3, root_dir=str(tmp_path / "part"), callbacks=[_Interrupt(2)], **QUIET).fit(
            _model(), data={"train": endless(), "val": endless_val()}, steps_per_epoch=5, validation_steps=3
        )
    resumed = _model()
    unifit.Trainer(max_epochs=3, root_dir=str(tmp_path / "part"), **QUIET).fit(
        resumed,
        data={"train": endless(), "val": endless_val()},
        steps_per_epoch=5,
        validation_steps=3,
        ckpt_path="last",
    )
    for a, b in zip(resumed.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    evaluated = unifit.Trainer(limit_val_batches=3, root_dir=str(tmp_path / "whole"), **QUIET).validate(
        ours, data={"train": endless(), "val": endless_val()}
    )  # model.evaluate(..., steps=3)
    assert evaluated["val/loss"] == pytest.approx(theirs.evaluate(endless_val(), steps=3, verbose=0)[0], rel=1e-5)


class _TorchModule(unifit.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        import torch

        self.layer = torch.nn.Linear(2, 1)


@pytest.mark.timeout(240)
def test_what_cannot_be_honoured_is_one_line(tmp_path):
    train, val = _data()

    def refused(message: str, module=None, data=None, callbacks=(), **arguments) -> None:
        with pytest.raises(ConfigError) as caught:
            trainer = unifit.Trainer(max_epochs=3, root_dir=str(tmp_path), callbacks=list(callbacks), **QUIET)
            trainer.fit(module or _model(), data=data or {"train": train, "val": val}, **arguments)
        assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)

    refused("(Keras callbacks) run with Keras modules", module=_TorchModule(), callbacks=[Recorder()])
    refused("log histograms or images from a callback", callbacks=[keras.callbacks.TensorBoard(histogram_freq=1)])
    refused("class_weight: model.fit's option for Keras models", module=_TorchModule(), class_weight={0: 2.0})
    x, y = (np.stack(column) for column in zip(*train.unbatch().as_numpy_iterator()))
    weighted = tf.data.Dataset.from_tensor_slices((x, y, np.ones(len(x), np.float32))).batch(BATCH)
    refused("has sample weights too", data={"train": weighted}, class_weight={0: 2.0})
    refused("give steps_per_epoch", data={"train": train.repeat()})
    refused("give validation_steps", data={"train": train, "val": val.repeat()})
    for option, message in (
        ({"data_on_device": True}, "trainer.data_on_device: true places a PyTorch module's"),
        ({"lr_find": {}}, "trainer.lr_find: the learning-rate range test runs for PyTorch modules"),
        ({"batch_size_find": {}}, "trainer.batch_size_find: the batch size finder runs for PyTorch modules"),
    ):
        with pytest.raises(ConfigError, match=message):
            unifit.Trainer(max_epochs=1, root_dir=str(tmp_path), **QUIET, **option).fit(_model(), data={"train": train})
    refused("so no epoch would train", initial_epoch=3)


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_a_trainer_made_after_tensorflow_started_is_one_line_under_mwms(tmp_path):
    from tests.helpers import run_unifit

    result = run_unifit(
        "launch", "--nproc-per-node", "2", "--strategy", "mwms", "--", "tests/probe/keras_late_trainer.py",
        str(tmp_path), timeout=200,
    )  # fmt: skip
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "unifit: error" in line]
    assert lines and all("make the Trainer at the top of the script" in line for line in lines), result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
