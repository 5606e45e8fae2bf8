"""Lightning callbacks under unifit: every hook of a module and of its callbacks called in the order Lightning's own
Trainer calls them (the golden test), Lightning's ModelCheckpoint / EarlyStopping mapped onto unifit's with the same
outcome, callback state in checkpoints, `trainer.logger`, and one-line refusals (all problems at once). Under
ddp / fsdp / smddp-like / horovod the zoo's callback module (tests/zoo/callback_models.py) runs in test_zoo.py."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    DeviceStatsMonitor,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
    OnExceptionCheckpoint,
    StochasticWeightAveraging,
    TQDMProgressBar,
)
from lightning.pytorch.demos.boring_classes import BoringModel

import unifit
from tests.helpers import lightning_trainer
from tests.probe.lightning_probe import BatchNormRegressor, Regressor
from tests.zoo.hook_recording import HookedCallback, HookedData, HookedModel, TrainerHookedCallback
from unifit.config.schema import TrainerConfig
from unifit.errors import ConfigError
from unifit.frameworks.lr_policy import LRPolicy

QUIET = {"progress_bar": False, "tensorboard": {"enabled": False}, "lr_scaling": "none"}
LIMITS = {"max_epochs": 2, "limit_train_batches": 4, "limit_val_batches": 2, "accumulate_grad_batches": 2}


def _lightning(**kwargs) -> L.Trainer:
    return lightning_trainer(**kwargs)


def _hooked_run(kind: str, stage: str, root) -> list[str]:
    """One fit (or validate/test/predict) of the recording module, with a callback of the Trainer's and one from
    configure_callbacks(), under `kind` ("lightning" or "unifit"); every call in order."""
    calls: list[str] = []
    torch.manual_seed(0)
    model = HookedModel(calls, callbacks=(HookedCallback(calls, "Module's"),))
    data, trainers = HookedData(calls), [TrainerHookedCallback(calls, "Trainer's")]
    if kind == "lightning":
        trainer = _lightning(callbacks=trainers, **LIMITS)
        getattr(trainer, stage)(model, datamodule=data)
    else:
        trainer = unifit.Trainer(
            callbacks=trainers, root_dir=str(root), checkpoint={"enabled": False}, **QUIET, **LIMITS
        )
        getattr(trainer, stage)(model, data)
    return calls


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
def test_every_hook_of_the_module_and_its_callbacks_runs_in_lightnings_order(tmp_path, stage):
    theirs, ours = _hooked_run("lightning", stage, tmp_path), _hooked_run("unifit", stage, tmp_path)
    first_difference = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
    assert ours == theirs, (
        first_difference,
        theirs[first_difference - 3 : first_difference + 5],
        ours[first_difference - 3 : first_difference + 5],
    )
    if stage == "fit":  # what the comparison covers, so that it cannot pass empty
        for call in (
            "Trainer's.on_before_optimizer_step",
            "Module's.on_train_epoch_end",
            "on_after_batch_transfer",
            "on_validation_model_eval",
            "Module's.setup",
            "optimizer_zero_grad",
            "lr_scheduler_step",
        ):
            assert call in ours, call  # fmt: skip
        assert ours.index("configure_callbacks") < ours.index("DataModule.setup") < ours.index("Trainer's.setup")


class _Augmenting(BoringModel):
    """Moves and changes its batches itself, as GPU augmentation written in on_after_batch_transfer does."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch * 2.0


@pytest.mark.timeout(120)
def test_the_batch_a_step_gets_is_what_the_transfer_hooks_made(tmp_path):
    g = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.randn(8, 32, generator=g), batch_size=2)
    trained = {}
    for kind in ("lightning", "unifit", "plain"):
        torch.manual_seed(0)
        model = BoringModel() if kind == "plain" else _Augmenting()
        if kind == "lightning":
            _lightning(max_epochs=1).fit(model, train_dataloaders=loader)
        else:
            unifit.Trainer(max_epochs=1, root_dir=str(tmp_path / kind), **QUIET).fit(model, train_dataloaders=loader)
        trained[kind] = model.layer.weight.detach().clone()
    assert torch.equal(trained["unifit"], trained["lightning"])
    assert not torch.equal(trained["unifit"], trained["plain"])  # the hook changed what was trained on


class _FrozenPart(BoringModel):
    """A part kept in eval mode (a frozen BatchNorm backbone, say): validation must not switch it back to train."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Dropout(0.5)
        self.modes: list[bool] = []

    def on_train_start(self) -> None:
        self.frozen.eval()

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.modes.append(self.frozen.training or not self.layer.training)


@pytest.mark.timeout(120)
def test_validation_gives_back_each_submodules_own_mode(tmp_path):
    model = _FrozenPart()
    unifit.Trainer(
        max_epochs=2, limit_train_batches=3, limit_val_batches=1, val_check_interval=1, root_dir=str(tmp_path), **QUIET
    ).fit(model)
    assert len(model.modes) == 6 and not any(model.modes), model.modes


def _regressor() -> Regressor:
    torch.manual_seed(0)
    return Regressor()


@pytest.mark.timeout(120)
def test_modelcheckpoint_and_earlystopping_end_as_under_lightning(tmp_path):
    """Lightning's own callbacks, mapped: the same epochs trained, the same early stop, the same k best epochs kept
    (mode max on a falling val_mse: the first two), the user's objects told their paths, scores and stop."""

    def callbacks(dirpath):
        return [
            ModelCheckpoint(dirpath=str(dirpath), monitor="val_mse", mode="max", save_top_k=2),
            EarlyStopping(monitor="val_mse", patience=2, min_delta=10.0),  # nothing counts as better: stops at 3
            LearningRateMonitor(logging_interval="step"),
            TQDMProgressBar(refresh_rate=0),
        ]

    theirs, lightning_callbacks = _regressor(), callbacks(tmp_path / "lightning")
    _lightning(
        max_epochs=8,
        callbacks=lightning_callbacks,
        enable_checkpointing=True,
        enable_progress_bar=True,
        logger=L.pytorch.loggers.CSVLogger(tmp_path),
    ).fit(theirs)
    ours, our_callbacks = _regressor(), callbacks(tmp_path / "unifit")
    state = unifit.Trainer(
        max_epochs=8, batch_size=8, root_dir=str(tmp_path / "run"), callbacks=our_callbacks, **QUIET
    ).fit(ours)

    assert state.epoch == lightning_callbacks[1].stopped_epoch + 1 == 3
    assert our_callbacks[1].stopped_epoch == lightning_callbacks[1].stopped_epoch
    assert our_callbacks[1].wait_count == lightning_callbacks[1].wait_count == 2
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    ckpt, their_ckpt = our_callbacks[0], lightning_callbacks[0]
    kept = sorted(p.name for p in (tmp_path / "unifit").iterdir() if p.name.startswith("epoch="))
    assert kept == ["epoch=0001-step=0000008", "epoch=0002-step=0000016", "epoch=0003-step=0000024"]  # 2 best + newest
    their_best_epochs = sorted(int(path.split("epoch=")[1].split("-")[0]) + 1 for path in their_ckpt.best_k_models)
    our_best_epochs = sorted(int(path.split("epoch=")[1].split("-")[0]) for path in ckpt.best_k_models)
    assert our_best_epochs == their_best_epochs == [1, 2]
    assert ckpt.best_model_path.endswith("/epoch=0001-step=0000008")
    assert float(ckpt.best_model_score) == pytest.approx(float(their_ckpt.best_model_score), rel=1e-5)
    assert ckpt.last_model_path.endswith("/epoch=0003-step=0000024")
    # the best checkpoint, by the path the user's ModelCheckpoint holds, evaluates
    metrics = unifit.Trainer(
        batch_size=8, root_dir=str(tmp_path / "run"), checkpoint={"dir": str(tmp_path / "unifit")}, **QUIET
    ).validate(_regressor(), ckpt_path=ckpt.best_model_path)
    assert metrics["val_mse"] == pytest.approx(float(ckpt.best_model_score), rel=1e-6)


class _Counting(L.Callback):
    """State of its own (saved with a checkpoint and restored), and Lightning's logger from a callback."""

    def __init__(self) -> None:
        self.batches = 0
        self.saved_keys: list[str] = []
        self.loaded: dict | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        if trainer.is_global_zero:
            trainer.logger.log_metrics({"batches_seen": self.batches}, step=trainer.global_step)
            trainer.logger.experiment.add_histogram("first_layer", pl_module.net[0].weight, trainer.global_step)
        keep = trainer.strategy.reduce_boolean_decision(True)  # a collective, as Lightning's EarlyStopping makes
        assert keep and trainer.strategy.broadcast("rank 0's") == "rank 0's"

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = dict(state_dict)
        self.batches = state_dict["batches"]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saved_keys = sorted(checkpoint)


class _LogsThroughItsLogger(Regressor):
    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        self.logger.experiment.add_scalar("module_epoch", self.current_epoch, self.global_step)


@pytest.mark.timeout(120)
def test_callback_state_is_checkpointed_and_the_logger_is_tensorboards(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    counting = _Counting()
    options = dict(batch_size=8, root_dir=str(tmp_path), progress_bar=False, lr_scaling="none")
    unifit.Trainer(max_epochs=2, callbacks=[counting], **options).fit(_LogsThroughItsLogger())
    assert counting.batches == 16 and counting.saved_keys == ["callbacks", "state_dict"]  # as Lightning gives them
    resumed = _Counting()
    unifit.Trainer(max_epochs=3, callbacks=[resumed], **options).fit(_LogsThroughItsLogger(), ckpt_path="last")
    assert resumed.loaded == {"batches": 16} and resumed.batches == 24

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0}).Reload()
    tags = events.Tags()
    assert "first_layer" in tags["histograms"], tags
    assert {"batches_seen", "module_epoch"} <= set(tags["scalars"]), tags
    assert [e.value for e in events.Scalars("batches_seen")][-1] == 24


@pytest.mark.timeout(120)
def test_device_stats_monitor_logs_lightnings_keys_at_the_logging_steps(tmp_path):
    """DeviceStatsMonitor, mapped onto trainer.device_stats: the keys Lightning's own run logs (here on CPU, with
    cpu_stats=True), every log_every_n_steps steps, read back from TensorBoard's files; without a logger, refused."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    theirs = tmp_path / "lightning"
    _lightning(
        max_epochs=1,
        callbacks=[DeviceStatsMonitor(cpu_stats=True)],
        logger=L.pytorch.loggers.CSVLogger(theirs),
        log_every_n_steps=3,
    ).fit(Regressor())
    header = next(theirs.rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    their_keys = {key for key in header if key.startswith("DeviceStatsMonitor.on_train_batch")}
    assert their_keys, header

    options = dict(batch_size=8, root_dir=str(tmp_path / "run"), progress_bar=False, lr_scaling="none")
    monitor = DeviceStatsMonitor(cpu_stats=True)
    unifit.Trainer(max_epochs=1, callbacks=[monitor], tensorboard={"log_every_n_steps": 3}, **options).fit(Regressor())
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    ours = {tag for tag in events.Tags()["scalars"] if tag.startswith("DeviceStatsMonitor.")}
    assert ours == their_keys
    used = events.Scalars("DeviceStatsMonitor.on_train_batch_end/cpu_vm_percent")
    assert [e.step for e in used] == [3, 6] and all(0 < e.value <= 100 for e in used)  # 8 steps in the epoch
    _refused("trainer.device_stats.enabled: true needs a logger", callbacks=[DeviceStatsMonitor()])


@pytest.mark.timeout(120)
def test_learning_rate_finder_sweeps_as_lightning_and_the_fit_then_starts_afresh_with_its_lr(tmp_path):
    """LearningRateFinder, mapped onto trainer.lr_find: the same lrs, smoothed losses and suggestion as Lightning's
    own sweep (same model, data and steps; through its StepLR schedule), the suggestion adopted (hparams.lr and
    the optimizer), and the model, optimizer, schedule and random states put back: the fit that follows equals a
    fresh fit at the suggested lr."""
    torch.manual_seed(0)
    theirs = LearningRateFinder(num_training_steps=30, max_lr=0.5)
    _lightning(max_epochs=4, callbacks=[theirs]).fit(Regressor())  # its sweep is bounded by max_epochs too
    torch.manual_seed(0)
    ours, tuned = LearningRateFinder(num_training_steps=30, max_lr=0.5), Regressor()
    options = dict(max_epochs=2, batch_size=8, checkpoint={"enabled": False}, **QUIET)
    unifit.Trainer(root_dir=str(tmp_path / "tuned"), callbacks=[ours], **options).fit(tuned)

    assert ours.optimal_lr.results["lr"] == pytest.approx(theirs.optimal_lr.results["lr"], rel=1e-9)
    assert ours.optimal_lr.results["loss"] == pytest.approx(theirs.optimal_lr.results["loss"], rel=1e-5)
    found = theirs.optimal_lr.suggestion()
    assert ours.optimal_lr.suggestion() == pytest.approx(found, rel=1e-9) and tuned.hparams.lr == pytest.approx(found)
    torch.manual_seed(0)
    fresh = Regressor(lr=tuned.hparams.lr)
    unifit.Trainer(root_dir=str(tmp_path / "fresh"), **options).fit(fresh)
    for key, value in fresh.state_dict().items():
        assert torch.equal(tuned.state_dict()[key], value), key


def _swa() -> StochasticWeightAveraging:
    return StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=2)


@pytest.mark.timeout(120)
def test_stochastic_weight_averaging_runs_unchanged_as_under_lightning_and_resumes(tmp_path):
    """Lightning's StochasticWeightAveraging as it is: its SWALR swapped in for the module's StepLR, the weights at
    the start of epochs 2-5 averaged and put into the model at the end: the same weights as Lightning's own run;
    its average and SWALR carried through a checkpoint (resumed at epoch 3, the same end)."""
    torch.manual_seed(0)
    theirs = Regressor()
    _lightning(max_epochs=5, callbacks=[_swa()]).fit(theirs)
    torch.manual_seed(0)
    ours = Regressor()
    options = dict(batch_size=8, **QUIET)
    unifit.Trainer(max_epochs=5, root_dir=str(tmp_path / "full"), callbacks=[_swa()], **options).fit(ours)
    torch.manual_seed(0)
    plain = Regressor()
    unifit.Trainer(max_epochs=5, root_dir=str(tmp_path / "plain"), **options).fit(plain)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert max((plain.state_dict()[k] - v).abs().max().item() for k, v in theirs.state_dict().items()) > 1e-4

    torch.manual_seed(0)
    unifit.Trainer(max_epochs=3, root_dir=str(tmp_path / "part"), callbacks=[_swa()], **options).fit(Regressor())
    resumed = Regressor()
    trainer = unifit.Trainer(max_epochs=5, root_dir=str(tmp_path / "part"), callbacks=[_swa()], **options)
    trainer.fit(resumed, ckpt_path="last")
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(120)
def test_stochastic_weight_averaging_on_batch_norm_adds_lightnings_forward_only_epoch(tmp_path):
    """With BatchNorm, Lightning's SWA adds an epoch of forward passes (no backward, no step) that recomputes the
    statistics for the averaged weights: unifit runs it as Lightning does, and ends with Lightning's weights and
    statistics; the epoch trains nothing (the optimizer step count stays) and is logged and checkpointed."""
    torch.manual_seed(0)
    theirs = BatchNormRegressor()
    _lightning(max_epochs=5, callbacks=[_swa()]).fit(theirs)
    torch.manual_seed(0)
    ours = BatchNormRegressor()
    trainer = unifit.Trainer(max_epochs=5, root_dir=str(tmp_path), callbacks=[_swa()], batch_size=8, **QUIET)
    state = trainer.fit(ours)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert state.progress.epoch == 6 and state.global_step == 5 * 8  # 8 batches an epoch, the sixth steps nothing
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("epoch=*"))
    assert checkpoints[-1] == "epoch=0006-step=0000040", checkpoints
    with pytest.raises(ConfigError, match="the accumulation is set before the fit"):
        trainer_view = ours.trainer
        trainer_view.accumulate_grad_batches = 3


class _EarlyStoppingWithHook(EarlyStopping):
    def on_validation_end(self, trainer, pl_module) -> None:
        print("custom")


def _refused(message: str, *, module=None, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        trainer = unifit.Trainer(max_epochs=1, root_dir="/tmp/unused-unifit", **QUIET, **kwargs)
        trainer.fit(module or BoringModel())
    text = str(caught.value)
    assert "\n" not in text and message in text, text
    return text


class _WithBatchNorm(BoringModel):
    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer


class _TrainModule(unifit.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)


@pytest.mark.timeout(120)
def test_what_is_not_honoured_is_refused_in_one_line_all_at_once(tmp_path):
    _refused(
        "sets trainer.checkpoint.keep_last_n, which the config sets to another value",
        callbacks=[ModelCheckpoint(monitor="x")],
        checkpoint={"keep_last_n": 2},
    )
    _refused(
        "sets trainer.checkpoint like another callback",
        callbacks=[ModelCheckpoint(), ModelCheckpoint(every_n_train_steps=5)],
    )
    _refused(
        "accumulate_grad_batches=2 is set too; set only one",
        callbacks=[GradientAccumulationScheduler({1: 4})],
        accumulate_grad_batches=2,
    )
    _refused("overrides on_validation_end", callbacks=[_EarlyStoppingWithHook(monitor="x")])
    _refused(
        "run with a LightningModule, and _TrainModule is not one",
        module=_TrainModule(),
        callbacks=[HookedCallback([], "x")],
    )


@pytest.mark.timeout(120)
def test_an_accumulation_schedule_trains_as_lightnings_and_resumes_mid_run(tmp_path):
    """GradientAccumulationScheduler({1: 2, 2: 3}) over 3 epochs of 8 batches: 8 + 4 + 3 optimizer steps (the last
    window of epoch 3 steps at the epoch's end), the same weights as Lightning's Trainer (through the module's
    StepLR by step); the steps the fit spans and the warmup follow the schedule. Stopped after epoch 2 and resumed,
    it ends where the uninterrupted run ends."""
    schedule = {1: 2, 2: 3}
    torch.manual_seed(0)
    theirs = Regressor()
    reference = _lightning(max_epochs=3, callbacks=[GradientAccumulationScheduler(schedule)])
    reference.fit(theirs)
    assert reference.global_step == 15

    def ours(epochs: int, root, module=None, ckpt_path=None):
        if module is None:
            torch.manual_seed(0)
            module = _StepsCounted()
        options = dict(max_epochs=epochs, batch_size=8, root_dir=str(root), **QUIET)
        trainer = unifit.Trainer(callbacks=[GradientAccumulationScheduler(schedule)], **options)
        return module, trainer.fit(module, ckpt_path=ckpt_path)

    whole, state = ours(3, tmp_path / "whole")
    assert state.global_step == 15 and whole.estimated_steps == 15
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(whole.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)
    ours(2, tmp_path / "part")
    torch.manual_seed(0)
    resumed, state = ours(3, tmp_path / "part", module=_StepsCounted(), ckpt_path="last")
    assert state.global_step == 15
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    config = TrainerConfig(accumulation_schedule=schedule, warmup_epochs=1.5)
    policy = LRPolicy.from_config(config, 1, lambda epoch: -(-8 // config.accumulation_at(epoch)))
    assert policy.warmup_steps == 10  # epoch 1's 8 steps and half of epoch 2's 4


class _StepsCounted(Regressor):
    def configure_optimizers(self):
        self.estimated_steps = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()


def _averaged(root, epochs: int, averaging: bool = True, ckpt_path: str | None = None) -> tuple[Regressor, dict]:
    torch.manual_seed(0)
    module = Regressor()
    callbacks = [EMAWeightAveraging(decay=0.9)] if averaging else []
    trainer = unifit.Trainer(max_epochs=epochs, batch_size=8, root_dir=str(root), callbacks=callbacks, **QUIET)
    return module, trainer.fit(module, ckpt_path=ckpt_path).metrics


@pytest.mark.timeout(120)
def test_weight_averaging_runs_unchanged_validates_and_resumes_as_lightning(tmp_path):
    """Lightning's EMAWeightAveraging: validation with the averaged weights, the averaged model at the end, its
    average carried through a checkpoint (resume), and evaluation from a checkpoint with the averaged weights."""
    torch.manual_seed(0)
    theirs = Regressor()
    reference = _lightning(max_epochs=3, callbacks=[EMAWeightAveraging(decay=0.9)])
    reference.fit(theirs)
    ours, metrics = _averaged(tmp_path / "full", 3)
    plain, _ = _averaged(tmp_path / "plain", 3, averaging=False)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert max((plain.state_dict()[k] - v).abs().max().item() for k, v in theirs.state_dict().items()) > 1e-3
    assert metrics["val_mse"] == pytest.approx(float(reference.callback_metrics["val_mse"]), rel=1e-5)
    _averaged(tmp_path / "part", 2)
    resumed, _ = _averaged(tmp_path / "part", 3, ckpt_path="last")
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    torch.manual_seed(0)
    fresh = Regressor()  # the checkpoint's weights are the averaged ones, as in Lightning's
    validated = unifit.Trainer(batch_size=8, root_dir=str(tmp_path / "full"), **QUIET).validate(fresh, ckpt_path="last")
    assert validated["val_mse"] == pytest.approx(metrics["val_mse"], rel=1e-6)
    _refused("keeps a whole, unsharded copy of the model", strategy="fsdp", callbacks=[EMAWeightAveraging()])


class _FailsAtStep5(Regressor):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail, self.steps_run = fail, 0

    def training_step(self, batch, batch_idx):
        if self.fail and self.global_step == 5:
            raise RuntimeError("boom at step 5")
        self.steps_run += 1
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(120)
def test_on_exception_checkpoint_saves_before_the_error_and_resumes_exactly(tmp_path):
    """OnExceptionCheckpoint beside a ModelCheckpoint: a failure mid-epoch saves on_exception after the last
    finished batch, and a resume from it ends where the uninterrupted run ends."""

    def fit(root, fail: bool, ckpt_path=None) -> Regressor:
        torch.manual_seed(0)
        module = _FailsAtStep5(fail)
        callbacks = [ModelCheckpoint(dirpath=str(root / "ckpt")), OnExceptionCheckpoint(str(root / "ckpt"))]
        unifit.Trainer(max_epochs=2, batch_size=8, root_dir=str(root), callbacks=callbacks, **QUIET).fit(
            module, ckpt_path=ckpt_path
        )
        return module

    whole = fit(tmp_path / "whole", fail=False)
    with pytest.raises(RuntimeError, match="boom at step 5"):
        fit(tmp_path / "failed", fail=True)
    assert (tmp_path / "failed" / "ckpt" / "on_exception").is_dir()
    resumed = fit(tmp_path / "failed", fail=False, ckpt_path="last")
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert resumed.seen_at_epoch_end[-1]["step"] == 16 and resumed.steps_run == 16 - 5  # from after step 5


@pytest.mark.timeout(120)
def test_lightning_callbacks_by_class_path_in_yaml(tmp_path):
    config = TrainerConfig.model_validate(
        {
            "max_epochs": 6,
            "batch_size": 8,
            "root_dir": str(tmp_path),
            **QUIET,
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.EarlyStopping", "init_args": {"monitor": "val_mse", "patience": 1, "min_delta": 10.0}},
                {"class_path": "lightning.pytorch.callbacks.GradientAccumulationScheduler", "init_args": {"scheduling": {0: 2}}},
            ],
        }
    )  # fmt: skip
    state = unifit.Trainer(config).fit(_regressor())
    assert state.epoch == 2  # patience 1: the second epoch did not improve by 10
    assert state.global_step == 8  # 8 batches of 8 per epoch, accumulating 2


class _OwnBackward(BoringModel):
    """Overrides backward (Lightning's hook), as modules that call backward their own way do."""

    def __init__(self) -> None:
        super().__init__()
        self.losses_seen: list[float] = []

    def backward(self, loss, *args, **kwargs) -> None:
        self.losses_seen.append(float(loss))  # under 16-mixed: the scaled loss, as Lightning hands it
        loss.backward(*args, **kwargs)


class _TwiceThroughOneGraph(BoringModel):
    """Manual optimization that backpropagates twice through one graph: manual_backward(retain_graph=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        out = self.layer(batch)
        first, second = out.pow(2).mean(), out.abs().mean()
        opt.zero_grad()
        self.manual_backward(first, retain_graph=True)
        self.manual_backward(second)
        opt.step()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_modules_own_backward_and_backwards_arguments(tmp_path, precision):
    g = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.randn(8, 32, generator=g), batch_size=2)
    for cls in (_OwnBackward, _TwiceThroughOneGraph):
        trained = []
        for kind in ("lightning", "unifit"):
            torch.manual_seed(0)
            model = cls()
            if kind == "lightning":
                _lightning(max_epochs=1, precision=precision).fit(model, train_dataloaders=loader)
            else:
                trainer = unifit.Trainer(max_epochs=1, root_dir=str(tmp_path / kind), precision=precision, **QUIET)
                trainer.fit(model, train_dataloaders=loader)
            trained.append(model)
        theirs, ours = trained
        assert torch.equal(ours.layer.weight, theirs.layer.weight), (cls.__name__, precision)
        if cls is _OwnBackward:
            assert len(ours.losses_seen) == 4 and ours.losses_seen == pytest.approx(theirs.losses_seen, rel=1e-6)


@pytest.mark.timeout(120)
def test_a_modules_own_backward_gets_the_scaled_loss_under_16_mixed(tmp_path):
    """Lightning hands backward the GradScaler's scaled loss (it runs 16-mixed on GPUs only; unifit on CPU too)."""
    g = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.randn(8, 32, generator=g), batch_size=2)
    model = _OwnBackward()
    trainer = unifit.Trainer(max_epochs=1, root_dir=str(tmp_path), precision="16-mixed", **QUIET)
    trainer.fit(model, train_dataloaders=loader)
    assert len(model.losses_seen) == 4 and model.losses_seen[0] > 1000  # scaled by 2**16 at first
    assert torch.isfinite(model.layer.weight).all()


@pytest.mark.timeout(120)
def test_a_saved_config_with_mapped_callbacks_runs_again(tmp_path, cli):
    """The config a run saves holds the options Lightning's ModelCheckpoint / EarlyStopping mapped onto and those
    callbacks' class paths: running it again is the same run, not a conflict; patience 0 is Lightning's too."""
    experiment = tmp_path / "exp.yaml"
    experiment.write_text(
        "module: {class_path: tests.probe.lightning_probe.Regressor}\n"
        f"trainer:\n  max_epochs: 2\n  batch_size: 8\n  root_dir: {tmp_path / 'run'}\n  progress_bar: false\n"
        "  callbacks:\n"
        "  - {class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {monitor: val_mse, save_top_k: 2}}\n"
        "  - {class_path: lightning.pytorch.callbacks.EarlyStopping, init_args: {monitor: val_mse, patience: 0}}\n"
    )
    first = cli("fit", "-c", str(experiment))
    assert first.returncode == 0, first.stderr
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "keep_best_k: 2" in saved and "lightning.pytorch.callbacks.ModelCheckpoint" in saved
    again = cli("fit", "-c", str(tmp_path / "run" / "config.yaml"), "--trainer.root_dir", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_a_stop_one_rank_asks_for_stops_every_rank_at_an_agreed_step(tmp_path):
    import json

    from tests.helpers import assert_ok, run_unifit

    result = run_unifit(
        "launch", "--nproc-per-node", "2", "--strategy", "ddp", "--", "tests/probe/rank_stop.py", str(tmp_path),
        timeout=200,
    )  # fmt: skip
    assert_ok(result)
    ends = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # -1 on rank 0 ends the first epoch on both after 3 steps; the stop asked at step 5 is agreed at step 8 (every 4)
    assert ends[0]["averaged"] and ends[0]["weights"] == ends[1]["weights"]  # EMAWeightAveraging on both ranks
    assert ends[0] == ends[1] and ends[0]["step"] == 8 and ends[0]["epoch"] == 2, ends
    assert ends[0]["steps_at_epoch_end"] == [3, 8], ends
    assert ends[0]["thread_done"] == [True], ends  # written at exit, after the thread Python waits for
    # the script's own writes after fit, run by both ranks, happen once
    assert (tmp_path / "saved_once.txt").read_text() == "0/2\n"
    assert [(tmp_path / f"rank_zero_only{r}.txt").read_text() for r in (0, 1)] == ["'saved'", "None"]
    assert (tmp_path / "model.pt").is_file()


def _writers_output(out) -> tuple[dict[int, torch.Tensor], list[int]]:
    """Every sample's prediction by dataset index, from the epoch writer's files, and the batch writer's indices."""
    by_index: dict[int, torch.Tensor] = {}
    for predictions in sorted(out.glob("predictions_*.pt")):
        indices = torch.load(str(predictions).replace("predictions_", "batch_indices_"))
        for batch, batch_indices in zip(torch.load(predictions), indices[0]):
            for row, index in zip(batch, batch_indices):
                assert index not in by_index, f"sample {index} predicted twice"
                by_index[index] = row
    batched = sorted(i for f in out.glob("b*_r*.pt") for i in torch.load(f)["indices"])
    return by_index, batched


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_prediction_writers_write_each_ranks_predictions_by_dataset_index(tmp_path):
    from tests.helpers import assert_ok, run_unifit
    from tests.probe.prediction_writer import BatchWriter, EpochWriter, model_and_data

    theirs = tmp_path / "lightning"
    theirs.mkdir()
    model, loader = model_and_data()
    _lightning(callbacks=[EpochWriter(str(theirs)), BatchWriter(str(theirs))]).predict(
        model, loader, return_predictions=False
    )
    expected, _ = _writers_output(theirs)
    assert sorted(expected) == list(range(21))
    for ranks in (1, 2):
        ours = tmp_path / f"unifit{ranks}"
        ours.mkdir()
        result = run_unifit(
            "launch", "--nproc-per-node", str(ranks), "--strategy", "ddp", "--",
            "tests/probe/prediction_writer.py", str(ours), timeout=150,
        )  # fmt: skip
        assert_ok(result)
        got, batched = _writers_output(ours)
        assert len(list(ours.glob("predictions_*.pt"))) == ranks and batched == list(range(21))
        assert sorted(got) == list(range(21))
        for index, row in got.items():
            torch.testing.assert_close(row, expected[index], rtol=1e-6, atol=1e-6)


def _pruned(root, epochs: int, ckpt_path: str | None = None, lottery: bool = True) -> tuple[Regressor, dict]:
    torch.manual_seed(0)
    module = Regressor()
    # every epoch's end, permanent at the end; lottery tickets: the pruned weights' survivors reset to their start
    pruning = ModelPruning("l1_unstructured", amount=0.3, use_lottery_ticket_hypothesis=lottery)
    trainer = unifit.Trainer(max_epochs=epochs, batch_size=8, root_dir=str(root), callbacks=[pruning], **QUIET)
    return module, trainer.fit(module, ckpt_path=ckpt_path).metrics


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_model_pruning_runs_as_lightning_resumes_with_its_masks_and_agrees_over_ranks(tmp_path):
    from tests.helpers import assert_ok, run_unifit

    torch.manual_seed(0)
    theirs = Regressor()
    _lightning(max_epochs=3, callbacks=[ModelPruning("l1_unstructured", amount=0.3)]).fit(theirs)
    ours, metrics = _pruned(tmp_path / "full", 3)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert (ours.net[0].weight == 0).float().mean() > 0.5  # pruned 3 times by 30 %
    # the start the lottery ticket resets to is in no checkpoint (Lightning's neither): resumed without it
    whole, _ = _pruned(tmp_path / "whole", 3, lottery=False)
    _pruned(tmp_path / "part", 2, lottery=False)
    resumed, _ = _pruned(tmp_path / "part", 3, ckpt_path="last", lottery=False)  # its masks come back with it
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    torch.manual_seed(0)  # an unpruned module evaluates the checkpoint's pruned weights
    validated = unifit.Trainer(batch_size=8, root_dir=str(tmp_path / "full"), **QUIET).validate(
        Regressor(), ckpt_path="last"
    )
    assert validated["val_mse"] == pytest.approx(
        unifit.Trainer(batch_size=8, root_dir=str(tmp_path / "v"), **QUIET).validate(ours)["val_mse"], rel=1e-6
    )
    _refused("re-parametrizes whole weights", strategy="fsdp", callbacks=[ModelPruning("l1_unstructured")])
    result = run_unifit(
        "launch", "--nproc-per-node", "2", "--strategy", "ddp", "--", "tests/probe/pruning_ranks.py", str(tmp_path),
        timeout=150,
    )  # fmt: skip
    assert_ok(result)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["zeros"] > 0, ranks
