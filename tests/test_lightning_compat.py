"""Every private name of Lightning unifit uses (unifit/frameworks/torch/lightning_compat.py), checked on the
installed Lightning: a release that renames one fails here, by name, not in a mapped callback's run."""

from __future__ import annotations

import inspect

import pytest

from unifit.frameworks.torch import lightning_compat as compat

L = pytest.importorskip("lightning.pytorch", reason="Lightning is not installed (unifit[dev])")


def test_the_arguments_lightnings_callbacks_were_made_with_are_read_back():
    from lightning.pytorch import callbacks

    checkpoint = callbacks.ModelCheckpoint(every_n_epochs=3, every_n_train_steps=0)
    assert compat.made_with(checkpoint, ("every_n_epochs", "every_n_train_steps", "train_time_interval")) == {
        "every_n_epochs": 3,
        "every_n_train_steps": 0,
        "train_time_interval": None,
    }
    assert compat.made_with(callbacks.Timer(duration="00:00:02:00"), ("duration",)) == {"duration": 120.0}
    finder = callbacks.LearningRateFinder(min_lr=1e-5, max_lr=0.5, num_training_steps=40, mode="linear")
    made = compat.made_with(finder, ("min_lr", "max_lr", "num_training_steps", "mode", "early_stop_threshold"))
    assert made == {"min_lr": 1e-5, "max_lr": 0.5, "num_training_steps": 40, "mode": "linear", "early_stop_threshold": 4.0}  # fmt: skip
    assert set(compat.made_with(finder, ("update_attr", "attr_name"))) == {"update_attr", "attr_name"}
    sizes = callbacks.BatchSizeFinder(mode="binsearch", steps_per_trial=2, init_val=4, max_trials=5)
    names = ("mode", "steps_per_trial", "init_val", "max_trials", "batch_arg_name")
    assert compat.made_with(sizes, names) == {
        "mode": "binsearch",
        "steps_per_trial": 2,
        "init_val": 4,
        "max_trials": 5,
        "batch_arg_name": "batch_size",
    }
    assert compat.made_with(callbacks.DeviceStatsMonitor(cpu_stats=True), ("cpu_stats",)) == {"cpu_stats": True}
    with pytest.raises(AttributeError):  # a name a callback does not keep is an error, not a silent default
        compat.made_with(checkpoint, ("every_n_weeks",))


def test_lr_finder_result_is_lightnings_own():
    lrs = [10 ** (-5 + i / 10) for i in range(40)]
    losses = [1.0 / (1 + i) if i < 30 else float(i) for i in range(40)]
    found = compat.lr_finder_result("exponential", 1e-5, 1.0, 40, lrs, losses)
    assert type(found).__name__ == "_LRFinder" and found.suggestion() in lrs


def test_the_attributes_lightnings_trainer_sets_are_where_unifit_sets_them():
    from lightning.pytorch.callbacks import BaseFinetuning
    from lightning.pytorch.utilities import CombinedLoader

    assert compat.combined_mode(CombinedLoader([[1, 2], [3]], mode="min_size")) == "min_size"
    module = L.LightningModule()
    compat.give_device_mesh(module, "mesh")
    assert module.device_mesh == "mesh"  # the public property reads what unifit set
    assert "self._restarting" in inspect.getsource(BaseFinetuning)
