"""The fit loop in one process, through the Python API."""

from __future__ import annotations

import math

import pytest
import torch

import unifit
from tests.probe.probe import ProbeModule
from unifit.loop.events import Event


class RecordingSGD(torch.optim.SGD):
    """Records the lr every optimizer step really used."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.used: list[float] = []

    def step(self, closure=None):
        self.used.append(self.param_groups[0]["lr"])
        return super().step(closure)


class LRProbe(ProbeModule):
    def __init__(self, scheduler: str | None = None, **kw):
        super().__init__(**kw)
        self.scheduler = scheduler

    def configure_optimizers(self):
        self.opt = RecordingSGD(self.parameters(), lr=self.lr)
        if self.scheduler == "step_epoch":
            return self.opt, torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.5)
        if self.scheduler == "cosine_step":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=100)
            return {"optimizer": self.opt, "lr_scheduler": sched, "interval": "step"}
        return self.opt


def _trainer(tmp_path, **kw):
    base = dict(
        max_epochs=2,
        batch_size=8,
        root_dir=str(tmp_path),
        progress_bar=False,
        tensorboard={"enabled": False},
        checkpoint={"enabled": False},
    )
    return unifit.Trainer(**{**base, **kw})


@pytest.mark.parametrize("scaling, factor", [("linear", 2.0), ("sqrt", math.sqrt(2.0)), ("none", 1.0)])
def test_lr_scaling_and_warmup_per_optimizer_step(tmp_path, scaling, factor):
    module = LRProbe(lr=0.1, dropout=0.0)
    _trainer(tmp_path, base_batch_size=4, lr_scaling=scaling, warmup_steps=4).fit(module)
    expected = [0.1 * (1 + (factor - 1) * k / 4) for k in range(4)] + [0.1 * factor] * 12
    assert module.opt.used == pytest.approx(expected, rel=1e-12)


def test_warmup_composes_with_the_users_epoch_scheduler(tmp_path):
    module = LRProbe(lr=0.1, dropout=0.0, scheduler="step_epoch")
    state = _trainer(tmp_path, base_batch_size=4, warmup_steps=12, max_epochs=3).fit(module)
    ramp = [(1 + k / 12) / 2 for k in range(12)]
    scheduled = [0.2] * 8 + [0.1] * 8 + [0.05] * 8  # StepLR halves the SCALED lr each epoch
    expected = [s * (ramp[k] if k < 12 else 1.0) for k, s in enumerate(scheduled)]
    assert module.opt.used == pytest.approx(expected, rel=1e-12)
    assert state.metrics["lr"] == pytest.approx(0.025)  # what the next step uses


def test_step_scheduler_steps_once_per_optimizer_step_with_accumulation(tmp_path):
    module = LRProbe(lr=0.1, dropout=0.0, scheduler="cosine_step")
    state = _trainer(tmp_path, accumulate_grad_batches=2, lr_scaling="none").fit(module)
    assert state.global_step == 8  # 8 batches per epoch / 2 per step x 2 epochs
    cosine = [0.1 * (1 + math.cos(math.pi * k / 100)) / 2 for k in range(8)]
    assert module.opt.used == pytest.approx(cosine, rel=1e-9)


def test_accumulation_equals_the_bigger_batch(tmp_path):
    torch.manual_seed(0)
    small = ProbeModule(dropout=0.0)
    big = ProbeModule(dropout=0.0)
    big.load_state_dict(small.state_dict())
    initial = [p.detach().clone() for p in small.parameters()]
    _trainer(tmp_path / "a", batch_size=8, accumulate_grad_batches=2, lr_scaling="none").fit(small)
    _trainer(tmp_path / "b", batch_size=16, lr_scaling="none").fit(big)
    for p, q, p0 in zip(small.parameters(), big.parameters(), initial):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert float((p.detach() - p0).abs().max()) > 1e-4  # both trained: two untrained runs are equal too


def test_accumulation_counts_in_the_global_batch_for_lr_scaling(tmp_path):
    module = LRProbe(lr=0.1, dropout=0.0)
    _trainer(tmp_path, accumulate_grad_batches=2).fit(module)
    assert module.opt.used == pytest.approx([0.2] * 8)


def test_gradient_clipping_bounds_each_update(tmp_path):
    module = LRProbe(lr=1.0, dropout=0.0)
    before = torch.cat([p.detach().clone().ravel() for p in module.parameters()])
    _trainer(
        tmp_path, max_epochs=1, limit_train_batches=1, lr_scaling="none", gradient_clip_val=0.01, limit_val_batches=0
    ).fit(module)
    after = torch.cat([p.detach().ravel() for p in module.parameters()])
    assert 0 < float((after - before).norm()) <= 0.01 + 1e-7


def test_early_stopping_stops_every_rank_on_a_flat_metric(tmp_path):
    state = _trainer(
        tmp_path,
        max_epochs=20,
        early_stopping={"monitor": "val/index_mean", "patience": 2},
        checkpoint={"enabled": True},
    ).fit(ProbeModule())
    assert state.epoch == 3 and state.should_stop
    assert "val/index_mean did not improve for 2 epochs" in state.stop_reason
    assert (tmp_path / "checkpoints" / "epoch=0003-step=0000024").is_dir()  # the stopping epoch is saved


def test_monitor_of_an_unlogged_metric_names_the_logged_ones(tmp_path):
    with pytest.raises(
        unifit.ConfigError, match=r"early_stopping.monitor: 'val/acc' was not logged; logged metrics: .*val/loss"
    ):
        _trainer(tmp_path, early_stopping={"monitor": "val/acc"}).fit(ProbeModule())


class Recorder(unifit.Callback):
    def __init__(self):
        self.events: list[str] = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")
            return lambda ctx, *args: events.append(name[3:] + (f":{args[-1]}" if name.endswith("batch_start") else ""))
        return object.__getattribute__(self, name)


for _event in Event:  # make the dispatcher see every hook as overridden
    setattr(Recorder, _event.value, lambda self, ctx, *a: None)


def test_event_order_is_pinned(tmp_path):
    recorder = Recorder()
    _trainer(tmp_path, max_epochs=2, limit_train_batches=2, validate_every_n_epochs=2, callbacks=[recorder]).fit(
        ProbeModule()
    )
    epoch = [
        "train_epoch_start",
        "train_batch_start:0",
        "train_batch_end",
        "train_batch_start:1",
        "train_batch_end",
        "train_epoch_end",
    ]
    assert recorder.events == [
        "setup",
        "fit_start",
        *epoch,
        "epoch_end",
        *epoch,
        "validation_start",
        "validation_end",
        "epoch_end",
        "fit_end",
        "teardown",
    ]


def test_exception_event_replaces_fit_end(tmp_path):
    recorder = Recorder()
    with pytest.raises(unifit.UnifitError, match="non-finite"):
        _trainer(
            tmp_path, max_epochs=1, limit_train_batches=2, callbacks=[recorder], nan_guard={"check_every_n_steps": 1}
        ).fit(ProbeModule(nan_at_step=2))
    assert recorder.events[-2:] == ["exception", "teardown"]
    assert "fit_end" not in recorder.events


def test_save_checkpoint_outside_fit_is_a_clear_error(tmp_path):
    with pytest.raises(unifit.UnifitError, match="only while fit"):
        _trainer(tmp_path).save_checkpoint()


def test_trainer_kwargs_are_validated_like_the_yaml():
    with pytest.raises(unifit.ConfigError, match=r"Trainer\(\.\.\.\): 'batch_size' received 0"):
        unifit.Trainer(batch_size=0)
    with pytest.raises(unifit.ConfigError, match="unknown key 'max_epoch'.*max_epochs"):
        unifit.Trainer(max_epoch=3)


def test_ddp_without_a_launcher_runs_a_world_of_one_and_says_so(tmp_path, caplog):
    state = _trainer(tmp_path, strategy="ddp", max_epochs=1).fit(ProbeModule())
    assert state.global_step == 8
    assert "running a world of size 1" in caplog.text
    assert not torch.distributed.is_initialized()
