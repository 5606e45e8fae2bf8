"""Keras models with their own train_step (issue #53): keras-io's VAE and DCGAN (tests/keras_io/, taken as the
tutorials write them) train as model.fit trains them: their step per replica, their metrics over replicas and
workers, unifit's lr policy on every optimizer (the GAN's two), checkpoints that resume exactly.

Single and mirrored against model.fit itself (same seeds, same order, 1e-5); where Keras 3's model.fit cannot
train the tutorial's model under mirrored (the VAE without a call(), the GAN at all), the reason is in
tests/keras_io/own_step_run.py. mwms, horovod and parameter-server: the GAN trains from YAML, in one launch
each, all three at once."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from tests.helpers import REPO, assert_ok, run_together

pytestmark = pytest.mark.tf


def _close_histories(ours: dict, theirs: dict, what: str) -> None:
    assert set(theirs) <= set(ours), (what, sorted(theirs), sorted(ours))
    for key, values in theirs.items():
        np.testing.assert_allclose(ours[key], values, rtol=1e-5, atol=1e-6, err_msg=f"{what}: {key}")


def _close_weights(ours: list, theirs: list, what: str) -> None:
    assert len(ours) == len(theirs) > 0, what
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=what)


@pytest.mark.timeout(240)
def test_vae_and_gan_equal_model_fit_in_one_process(tmp_path):
    from tests.keras_io import own_step_run

    out = tmp_path / "single.json"
    own_step_run.main("single", str(out))
    for name, both in json.loads(out.read_text()).items():
        _close_histories(both["unifit"]["history"], both["keras"]["history"], name)
        _close_weights(both["unifit"]["weights"], both["keras"]["weights"], name)


@pytest.mark.timeout(240)
def test_gan_resumes_its_two_optimizers_exactly(tmp_path):
    """A checkpoint holds the GAN's d_optimizer and g_optimizer (built for the variables its step updates with
    them); resumed, the run equals one that was never stopped."""
    import keras

    import unifit
    from tests.keras_io.gan import Images, make_gan
    from unifit.frameworks.keras.compiled import CompiledModel

    def run(root, epochs, resume=None):
        module = CompiledModel(make_gan)
        trainer = unifit.Trainer(root_dir=str(root), max_epochs=epochs, batch_size=16, progress_bar=False)
        history = trainer.fit(module, data=Images(32), ckpt_path=resume)
        return history, module.model

    straight_history, straight = run(tmp_path / "straight", 3)
    run(tmp_path / "stopped", 2)
    resumed_history, resumed = run(tmp_path / "stopped", 3, resume="last")
    _close_weights(resumed.get_weights(), straight.get_weights(), "weights")
    for name in ("d_optimizer", "g_optimizer"):
        ours, theirs = getattr(resumed, name), getattr(straight, name)
        assert int(ours.iterations.numpy()) == int(theirs.iterations.numpy()) == 6
        _close_weights([v.numpy() for v in ours.variables], [v.numpy() for v in theirs.variables], name)
    _close_histories(resumed_history.history, {k: v[2:] for k, v in straight_history.history.items()}, "resumed")
    assert isinstance(straight.d_optimizer, keras.optimizers.Adam)


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_vae_under_mirrored_equals_model_fit_and_the_gan_trains(tmp_path):
    import subprocess

    out = tmp_path / "mirrored.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.keras_io.own_step_run", "mirrored", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text())
    _close_histories(found["vae"]["unifit"]["history"], found["vae"]["keras"]["history"], "vae")
    _close_weights(found["vae"]["unifit"]["weights"], found["vae"]["keras"]["weights"], "vae")
    gan = found["gan"]["unifit"]["history"]
    assert all(math.isfinite(v) for key in ("d_loss", "g_loss") for v in gan[key]), gan


GAN_YAML = {
    "module": {
        "class_path": "unifit.frameworks.keras.compiled.CompiledModel",
        "init_args": {"model": "tests.keras_io.gan.make_gan"},
    },
    "data": {"class_path": "tests.keras_io.gan.Images", "init_args": {"n": 32}},
    "trainer": {"max_epochs": 2, "batch_size": 8, "progress_bar": False, "collective_timeout_s": 90},
}


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_gan_trains_under_mwms_horovod_and_parameter_server(tmp_path):
    jobs = {
        "mwms": ["--nproc-per-node", "2"],
        "horovod": ["--nproc-per-node", "2"],
        "parameter-server": ["--nproc-per-node", "2", "--num-ps", "1"],
    }
    commands = []
    for strategy, flags in jobs.items():
        experiment = tmp_path / f"{strategy}.yaml"
        config = json.loads(json.dumps(GAN_YAML))
        config["trainer"].update(strategy=strategy, root_dir=str(tmp_path / strategy))
        experiment.write_text(json.dumps(config))
        commands.append((["launch", *flags, "-c", str(experiment)], {}))
    for strategy, result in zip(jobs, run_together(commands, timeout=280)):
        assert_ok(result)
        lines = [json.loads(line) for line in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]
        epochs = [line for line in lines if "train/d_loss" in line and not line.get("mid_epoch")]
        assert len(epochs) == 2, (strategy, lines)
        for line in epochs:
            assert math.isfinite(line["train/d_loss"]) and math.isfinite(line["train/g_loss"]), (strategy, line)


@pytest.mark.timeout(180)
def test_a_gan_passed_as_it_is_keeps_its_own_optimizers_trained(tmp_path):
    """single trains the user's GAN object itself (it cannot be rebuilt); after fit its d_optimizer and
    g_optimizer are its own objects again, holding the trained state, as after model.fit."""
    import unifit
    from tests.keras_io.gan import dataset, make_gan

    gan = make_gan()
    d_optimizer, g_optimizer = gan.d_optimizer, gan.g_optimizer
    history = unifit.Trainer(root_dir=str(tmp_path), max_epochs=2, progress_bar=False).fit(gan, data=dataset(32))
    assert gan.d_optimizer is d_optimizer and gan.g_optimizer is g_optimizer
    assert int(d_optimizer.iterations.numpy()) == int(g_optimizer.iterations.numpy()) == 4  # 2 epochs x 2 steps
    assert float(d_optimizer.learning_rate.numpy()) == pytest.approx(0.0003)
    assert len(history.history["d_loss"]) == 2 and gan.history is history


@pytest.mark.timeout(180)
def test_loss_weights_weighted_and_per_output_metrics_train_as_model_fit(tmp_path):
    """What unifit's own step does not compute (loss_weights, weighted_metrics, metrics named per output) is no
    longer refused: Keras' train_step runs it, equal to model.fit with the same sample weights."""
    import keras

    import unifit
    from tests.probe.keras_compiled_probe import CLASSES, N_TRAIN, arrays

    x, y = arrays(N_TRAIN, seed=1)
    weights = np.linspace(0.5, 1.5, len(x)).astype("float32")

    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input(x.shape[1:])
        model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="out")(inputs))
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            loss_weights=[0.5],
            metrics={"out": ["accuracy"]},
            weighted_metrics=["sparse_categorical_accuracy"],
        )
        return model

    theirs = make().fit(x, y, sample_weight=weights, batch_size=N_TRAIN, epochs=3, shuffle=False, verbose=0)
    trainer = unifit.Trainer(
        root_dir=str(tmp_path), max_epochs=3, batch_size=N_TRAIN, lr_scaling="none", progress_bar=False
    )
    ours = trainer.fit(make(), data=(x, y, weights))
    assert {"loss", "accuracy", "sparse_categorical_accuracy"} <= set(theirs.history), sorted(theirs.history)
    _close_histories(ours.history, theirs.history, "compiled")
