"""Step-based training: trainer.max_steps stops mid-epoch (validated and checkpointed there), spans as many epochs
as it takes when max_epochs is not set, sizes the schedules (estimated_stepping_batches), and a crash resumed from
a step checkpoint ends where the uninterrupted run ends; trainer.val_check_interval validates inside the epochs
without changing the training; under ddp and a Keras strategy through the same loop."""

from __future__ import annotations

import json
import time

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

import unifit
from tests.helpers import assert_ok, launch_probe
from unifit import Trainer

QUIET = {"progress_bar": False, "tensorboard": {"enabled": False}}


class _Stepped(BoringModel):
    """BoringModel (64 batches of 1 an epoch) with a OneCycleLR sized as Lightning's tutorials size it."""

    def __init__(self) -> None:
        super().__init__()
        self.sized_for: int | None = None

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.step(batch))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        self.sized_for = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=self.sized_for)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _CountsValidations(_Stepped):
    def __init__(self) -> None:
        super().__init__()
        self.validated_at: list[tuple[int, int]] = []

    def on_validation_start(self) -> None:
        self.validated_at.append((self.current_epoch, self.global_step))


class _CrashAt(unifit.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        if ctx.progress.optimizer_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


def _fit(root, make=_Stepped, ckpt_path=None, data="boring", **options) -> tuple[_Stepped, unifit.TrainState]:
    torch.manual_seed(0)  # the same initial weights in every run
    module = make()
    trainer = Trainer(**{"strategy": "single", "root_dir": str(root), **QUIET, **options})
    return module, trainer.fit(module, BoringDataModule() if data == "boring" else data, ckpt_path=ckpt_path)


def _jsonl(root) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(180)
def test_max_steps_stops_mid_epoch_spans_epochs_and_resumes_exactly(tmp_path):
    module, state = _fit(tmp_path / "a", max_steps=150)  # max_epochs not set: the 3 epochs 150 steps span
    assert state.progress.optimizer_step == 150 and state.progress.epoch == 3 and module.sized_for == 150
    lines = _jsonl(tmp_path / "a")
    assert [(line["epoch"], line["step"]) for line in lines] == [(1, 64), (2, 128), (3, 150)]
    assert all("val_loss" in line for line in lines)  # validated at the stop too, mid-epoch
    assert module.trainer.max_steps == 150

    few, state = _fit(tmp_path / "b", max_steps=150, max_epochs=1)  # whichever comes first
    assert state.progress.optimizer_step == 64 and few.sized_for == 64

    crashed = tmp_path / "c"
    with pytest.raises(RuntimeError, match="simulated crash at step 110"):
        _fit(crashed, max_steps=150, checkpoint={"every_n_steps": 50}, callbacks=[_CrashAt(110)])
    resumed, state = _fit(crashed, max_steps=150, checkpoint={"every_n_steps": 50}, ckpt_path="last")
    assert state.progress.optimizer_step == 150
    for key, value in module.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=0)
    _, again = _fit(crashed, max_steps=150, checkpoint={"every_n_steps": 50}, ckpt_path="last")
    assert again.progress.optimizer_step == 150  # resumed at max_steps: nothing more to train


@pytest.mark.timeout(180)
def test_val_check_interval_validates_inside_epochs_without_changing_the_training(tmp_path):
    plain, _ = _fit(tmp_path / "plain", max_epochs=2)
    for interval, inside in ((16, (16, 32, 48)), (0.5, (32,))):
        module, state = _fit(
            tmp_path / str(interval), make=_CountsValidations, max_epochs=2, val_check_interval=interval
        )
        expected = [(epoch, 64 * epoch + at) for epoch in (0, 1) for at in (*inside, 64)]
        assert module.validated_at == expected, interval
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(module.state_dict()[key], value, rtol=0, atol=0)
        assert _jsonl(tmp_path / str(interval))[-1]["val_loss"] == _jsonl(tmp_path / "plain")[-1]["val_loss"]
    # inside an accumulation window too, as Lightning validates: the gradients being accumulated are kept
    accumulating, _ = _fit(tmp_path / "acc", max_epochs=2, accumulate_grad_batches=3)
    inside, _ = _fit(
        tmp_path / "acc-inside", make=_CountsValidations, max_epochs=2, val_check_interval=16, accumulate_grad_batches=3
    )
    assert inside.validated_at[:2] == [(0, 5), (0, 10)]  # after batches 16 and 32: mid-window (steps of 3)
    for key, value in accumulating.state_dict().items():
        torch.testing.assert_close(inside.state_dict()[key], value, rtol=0, atol=0)
    with pytest.raises(unifit.ConfigError, match="inside a window of accumulate_grad_batches=3, where this strategy"):
        _fit(tmp_path / "fsdp", max_epochs=1, val_check_interval=16, accumulate_grad_batches=3, strategy="fsdp")


@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "mirrored"])
def test_max_steps_and_val_check_interval_under_a_torch_and_a_keras_strategy(tmp_path, strategy):
    """The probe: 64 samples of batch 8 on 2 replicas, 4 steps an epoch; 6 steps end mid-way through epoch 2;
    validations after batch 2 and 4 of epoch 1, and at the stop (batch 2 of epoch 2), alike on every rank."""
    log = {"class_path": "tests.probe.callbacks.ValidationLog", "init_args": {"out_dir": str(tmp_path / "v")}}
    overrides = [
        "--trainer.max_steps",
        "6",
        "--trainer.val_check_interval",
        "2",
        "--trainer.checkpoint.enabled",
        "false",
    ]
    assert_ok(launch_probe(strategy, tmp_path, *overrides, callbacks=[log]))
    lines = [line for line in _jsonl(tmp_path) if not line.get("mid_epoch")]
    assert [(line["epoch"], line["step"]) for line in lines] == [(1, 4), (2, 6)]
    # the validation after batch 2 of epoch 1 has its own line (the one at the stop is the epoch's)
    assert [(line["epoch"], line["step"]) for line in _jsonl(tmp_path) if line.get("mid_epoch")] == [(0, 2)]
    assert all("val/loss" in line for line in lines)
    seen = [json.loads(f.read_text()) for f in sorted((tmp_path / "v").glob("validations_*.json"))]
    assert [(epoch, batch) for epoch, batch, _ in seen[0]] == [(0, 2), (0, 4), (1, 2)]
    assert all(ranks == seen[0] for ranks in seen)  # the same validations and values on every rank


class _Endless(torch.utils.data.IterableDataset):
    """A stream with no end and no __len__ (a generator, a message queue)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            x = torch.randn(4, generator=g)
            yield x, x.sum().reshape(1)


class _StreamRegressor(unifit.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.validations = torch.nn.Linear(4, 1), 0

    def train_dataset(self):
        return _Endless()

    def val_dataset(self):
        return torch.utils.data.TensorDataset(torch.ones(8, 4), torch.full((8, 1), 4.0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.validations += batch_idx == 0
        self.log("val/mse", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.timeout(180)
def test_an_endless_stream_trains_by_steps_validates_inside_and_resumes_exactly(tmp_path):
    options = dict(max_steps=30, val_check_interval=10, batch_size=4, checkpoint={"every_n_steps": 10})
    full, state = _fit(tmp_path / "full", make=_StreamRegressor, data=None, **options)
    assert state.progress.optimizer_step == 30 and state.progress.epoch == 1 and full.validations == 3  # 10, 20, 30
    with pytest.raises(RuntimeError, match="simulated crash at step 15"):
        _fit(tmp_path / "crash", make=_StreamRegressor, data=None, callbacks=[_CrashAt(15)], **options)
    resumed, state = _fit(tmp_path / "crash", make=_StreamRegressor, data=None, ckpt_path="last", **options)
    assert state.progress.optimizer_step == 30
    for key, value in full.state_dict().items():  # resumed mid-stream at step 10: the same batches after it
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=0)


class _Slow(_Stepped):
    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(180)
def test_max_time_stops_at_an_agreed_step_validated_checkpointed_and_counts_across_resumes(tmp_path):
    options = dict(max_epochs=3, max_time=0.5, preemption={"check_every_n_steps": 4})
    _, state = _fit(tmp_path, make=_Slow, **options)
    steps = state.progress.optimizer_step
    assert steps % 4 == 0 and 4 <= steps < 64, steps  # inside the first epoch, at an agreement
    assert state.stop_reason == "max_time=0.5s reached"
    last = _jsonl(tmp_path)[-1]
    assert last["step"] == steps and "val_loss" in last  # the stop is an epoch end: validated (and checkpointed)
    _, again = _fit(tmp_path, make=_Slow, ckpt_path="last", **options)
    assert again.progress.optimizer_step == steps + 4  # the time was spent before: it stops at the first agreement
    assert Trainer(max_time="00:01:00:05").config.max_time == 3605.0  # Lightning's DD:HH:MM:SS
    with pytest.raises(unifit.ConfigError, match=r"max_time.*'DD:HH:MM:SS'"):
        Trainer(max_time="1:30")
