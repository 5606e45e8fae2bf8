"""Unchanged LightningModules train under unifit: the same weights, hooks and metrics as Lightning's
own Trainer, on every torch strategy (from YAML too), resumable; what unifit cannot honour is refused."""

from __future__ import annotations

import itertools
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, ManualOptimBoringModel

import unifit
from tests.helpers import STRATEGY_OPTIONS, STRATEGY_PROCS, assert_ok, lightning_trainer, metrics_lines, run_unifit
from tests.probe.lightning_probe import Regressor
from unifit import Trainer
from unifit.errors import ConfigError

QUIET = {"progress_bar": False, "tensorboard": {"enabled": False}}


def _regressor() -> Regressor:
    torch.manual_seed(0)
    return Regressor()


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _lightning_trainer(max_epochs: int) -> L.Trainer:
    """Lightning's own Trainer, quiet, on one CPU process: the reference."""
    return lightning_trainer(max_epochs=max_epochs)


def _unifit(root, max_epochs: int, module=None, **kwargs) -> tuple[Regressor, dict]:
    module = module or _regressor()
    state = Trainer(strategy="single", max_epochs=max_epochs, batch_size=8, root_dir=str(root), **QUIET, **kwargs).fit(
        module, ckpt_path=kwargs.pop("ckpt", None)
    )
    return module, state.metrics


@pytest.mark.timeout(120)
def test_same_weights_hooks_and_metrics_as_lightnings_own_trainer(tmp_path):
    theirs = _regressor()
    lightning_trainer = _lightning_trainer(3)
    lightning_trainer.fit(theirs)
    ours, metrics = _unifit(tmp_path, 3)
    for key, value in _weights(theirs).items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert ours.calls == theirs.calls  # setup, on_fit_start, per epoch: start, validation end, train epoch end, fit end
    assert ours.seen_at_epoch_end == theirs.seen_at_epoch_end  # current_epoch, global_step, global_rank, world, device
    assert ours.current_epoch == theirs.current_epoch == 3
    assert metrics["train_mse"] == pytest.approx(float(lightning_trainer.callback_metrics["train_mse_epoch"]), rel=1e-5)
    assert metrics["val_mse"] == pytest.approx(float(lightning_trainer.callback_metrics["val_mse"]), rel=1e-5)
    assert ours.hparams == {"lr": 0.05, "hidden": 16, "n": 64}  # save_hyperparameters


@pytest.mark.timeout(120)
def test_resume_continues_exactly_with_the_modules_checkpoint_hooks(tmp_path):
    full, _ = _unifit(tmp_path / "full", 3)
    _unifit(tmp_path / "part", 2)
    resumed = _regressor()
    resumed.net[0].weight.data.zero_()  # the checkpoint must overwrite it
    state = Trainer(strategy="single", max_epochs=3, batch_size=8, root_dir=str(tmp_path / "part"), **QUIET).fit(
        resumed, ckpt_path="last"
    )
    assert state.progress.epoch == 3
    for key, value in _weights(full).items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=0)
    assert resumed.saved_counter == full.saved_counter == 3  # on_load_checkpoint restored what on_save_checkpoint put
    saved = torch.load(
        tmp_path
        / "part"
        / "checkpoints"
        / json.loads((tmp_path / "part" / "checkpoints" / "last.json").read_text())["name"]
        / "state.pt",
        weights_only=False,
    )
    assert set(saved["engine"]["model"]) == set(full.state_dict())  # the module's own keys, as Lightning saves them


def _bad(module, message: str, trainer: dict | None = None, **kwargs) -> None:
    with pytest.raises(ConfigError) as caught:
        Trainer(
            strategy="single",
            max_epochs=1,
            batch_size=kwargs.pop("batch_size", 1),
            root_dir="/tmp/unused-unifit",
            **QUIET,
            **(trainer or {}),
            checkpoint={"enabled": False},
        ).fit(module, **kwargs)
    text = str(caught.value)
    assert "\n" not in text and message in text, text


class _MedianReduce(BoringModel):
    def training_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("peak", loss, reduce_fx="median")  # Lightning takes mean, sum, max and min only
        return loss


class _LogsAtFitStart(BoringModel):
    def on_fit_start(self) -> None:  # where Lightning refuses self.log too
        self.log("early", 1.0)


class _SkipsBatches(Regressor):
    """Returns None for every third batch (no backward; the step still counts, as Lightning's) and, with
    `end_at`, -1 from on_train_batch_start at (epoch, batch): the rest of that epoch is skipped."""

    def __init__(self, end_at: tuple[int, int] | None = None, adam: bool = False) -> None:
        super().__init__()
        self.end_at, self.adam = end_at, adam

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 3 == 1 else super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if (self.current_epoch, batch_idx) == self.end_at else None

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01) if self.adam else super().configure_optimizers()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "options, trainer",
    [
        ({}, {}),  # SGD + a per-step StepLR: a skipped batch steps the schedule, not the weights
        ({"end_at": (1, 3), "adam": True}, {"accumulate_grad_batches": 2}),  # -1 inside a window: its gradients go
    ],
)
def test_skipped_batches_and_epochs_on_one_process_as_lightning(tmp_path, options, trainer):
    torch.manual_seed(0)
    theirs = _SkipsBatches(**options)
    lightning_trainer(max_epochs=3, **trainer).fit(theirs)
    torch.manual_seed(0)
    ours = _SkipsBatches(**options)
    Trainer(strategy="single", max_epochs=3, root_dir=str(tmp_path), lr_scaling="none", **QUIET, **trainer).fit(ours)
    for key, value in _weights(theirs).items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert ours.seen_at_epoch_end == theirs.seen_at_epoch_end  # the global step at each epoch's end
    # an epoch cut short by -1 still validates at its end under unifit; Lightning skips that epoch's validation
    validated = [c for c in ours.calls if c == "on_validation_epoch_end"]
    assert len(validated) == 3 and len([c for c in theirs.calls if c == "on_validation_epoch_end"]) == 3 - bool(
        options.get("end_at")
    )
    assert [c for c in ours.calls if c not in validated] == [c for c in theirs.calls if c not in validated]


@pytest.mark.timeout(120)
def test_what_unifit_cannot_honour_is_refused_in_one_line():
    # manual optimization trains (tests/test_zoo.py); what Lightning refuses with it is refused alike
    _bad(ManualOptimBoringModel(), "accumulate in training_step", trainer={"accumulate_grad_batches": 2})
    _bad(ManualOptimBoringModel(), "call self.clip_gradients(opt", trainer={"gradient_clip_val": 1.0})
    _bad(_MedianReduce(), "self.log('peak'): reduce_fx='median'; use one of mean, sum, max, min")
    _bad(_LogsAtFitStart(), "self.log('early', ...) outside the hooks where Lightning allows it")
    _bad(BoringModel(), "the DataLoader's batch_size is 1 but trainer.batch_size is 4", batch_size=4)
    _bad(Regressor, "received the class Regressor, not an instance")
    _bad(torch.nn.Linear(2, 2), "pass a unifit.TrainModule (PyTorch) or unifit.KerasModule (Keras) subclass")


def _launch_yaml(
    tmp_path, strategy: str, sections: str, batch_size: int, callbacks: list | None = None, epochs: int = 2
) -> list[dict]:
    """`unifit launch -c exp.yaml` with the strategy's process count; each rank's LightningReport."""
    report = {
        "class_path": "tests.probe.lightning_probe.LightningReport",
        "init_args": {"out_dir": str(tmp_path / "r")},
    }
    every = ", ".join(json.dumps(cb) for cb in [report, *(callbacks or [])])
    experiment = tmp_path / "exp.yaml"
    experiment.write_text(
        sections
        + f"""
trainer:
  strategy: {strategy}
  max_epochs: {epochs}
  batch_size: {batch_size}
  root_dir: {tmp_path / "run"}
  progress_bar: false
  callbacks: [{every}]
"""
    )
    procs = STRATEGY_PROCS[strategy]
    result = run_unifit(
        "launch",
        "--nproc-per-node",
        str(procs),
        "-c",
        str(experiment),
        *STRATEGY_OPTIONS.get(strategy, []),
        timeout=240,
    )
    assert_ok(result)
    reports = [json.loads(f.read_text()) for f in sorted((tmp_path / "r").glob("report_*.json"))]
    assert len(reports) == procs and len({r["weights_sha256"] for r in reports}) == 1  # every rank the same model
    return reports


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_lightnings_own_demo_module_and_datamodule_unchanged_from_yaml(tmp_path):
    reports = _launch_yaml(
        tmp_path,
        "ddp",
        """
module:
  class_path: lightning.pytorch.demos.boring_classes.BoringModel
data:
  class_path: lightning.pytorch.demos.boring_classes.BoringDataModule
""",
        batch_size=1,
    )
    assert reports[0]["keys"] == ["layer.bias", "layer.weight"]
    assert reports[0]["metrics"]["train/loss"] > 0


@pytest.mark.launch
@pytest.mark.timeout(300)
# ddp and fsdp (a wrapped and a sharded module); the same LightningModules, hooks included, train under
# smddp-like and horovod too in tests/test_zoo.py, to ddp's weights
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lightning_module_with_its_hooks_on_every_torch_strategy(tmp_path, strategy):
    reports = _launch_yaml(
        tmp_path,
        strategy,
        """
module:
  class_path: tests.probe.lightning_probe.Regressor
  init_args: {lr: 0.02, hidden: 8}
""",
        batch_size=8,
    )
    world = STRATEGY_PROCS[strategy]
    for r in reports:
        assert [s["rank"] for s in r["seen_at_epoch_end"]] == [r["rank"]] * 2  # self.global_rank
        assert {s["world"] for s in r["seen_at_epoch_end"]} == {world}  # self.trainer.world_size
        assert [s["epoch"] for s in r["seen_at_epoch_end"]] == [0, 1]  # self.current_epoch
        epoch = ["on_train_epoch_start", "on_validation_epoch_end", "on_train_epoch_end"]
        assert r["calls"] == ["setup:fit", "on_fit_start", *epoch, *epoch]  # reported before the module's on_fit_end
    assert {"train_mse", "val_mse"} <= set(reports[0]["metrics"])


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_stochastic_weight_averagings_batch_norm_epoch_under_ddp(tmp_path):
    """Lightning's SWA from YAML on 2 ddp ranks, on a model with BatchNorm: its forward-only epoch runs in step on
    both ranks (no gradient sync, no step), which end with the same weights and statistics."""
    swa = {
        "class_path": "lightning.pytorch.callbacks.StochasticWeightAveraging",
        "init_args": {"swa_lrs": 0.02, "swa_epoch_start": 1},
    }
    module = "module:\n  class_path: tests.probe.lightning_probe.BatchNormRegressor\n"
    reports = _launch_yaml(tmp_path, "ddp", module, batch_size=8, callbacks=[swa], epochs=2)  # same weights: checked
    assert any(key.endswith("running_mean") for key in reports[0]["keys"])
    assert [m["epoch"] for m in metrics_lines(tmp_path / "run")] == [1, 2, 3]  # the third: forward passes only
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("epoch=*"))
    assert steps[-2:] == ["epoch=0002-step=0000008", "epoch=0003-step=0000008"], steps  # 4 steps an epoch


@pytest.mark.timeout(120)
def test_estimated_stepping_batches_and_the_test_and_predict_hooks(tmp_path):
    """A OneCycleLR sized by trainer.estimated_stepping_batches runs to its last step without the
    'stepped too many times' error; test/predict call the module's own hooks in Lightning's order."""
    from tests.probe.lightning_probe import OneCycleRegressor
    from unifit import Trainer

    module = OneCycleRegressor()
    trainer = Trainer(max_epochs=3, batch_size=8, root_dir=str(tmp_path), progress_bar=False, accumulate_grad_batches=2)
    trainer.fit(module)
    assert "estimated_stepping_batches:12" in module.calls  # 64 samples / 8 = 8 batches, 4 steps x 3 epochs
    module.calls.clear()
    metrics = trainer.test(module)
    assert set(metrics) == {"test_mse"}
    assert module.calls == [
        "setup:test",
        "on_test_start",
        "on_test_epoch_start",
        "on_test_batch_end:0",
        "on_test_batch_end:1",
        "on_test_batch_end:2",
        "on_test_epoch_end",
        "on_test_end",
        "teardown:test",
    ]
    module.calls.clear()
    predictions = trainer.predict(module)
    assert predictions.shape == (20, 1)
    assert module.calls == [
        "setup:predict",
        "on_predict_start",
        "on_predict_batch_start:0",
        "on_predict_batch_start:1",
        "on_predict_batch_start:2",
        "on_predict_end",
        "teardown:predict",
    ]


def test_trainmodule_offers_save_hyperparameters_natively():
    import unifit

    class Native(unifit.TrainModule):
        def __init__(self, lr: float = 0.1, hidden: int = 4, **extra) -> None:
            super().__init__()
            self.save_hyperparameters()

    class Some(unifit.TrainModule):
        def __init__(self, lr: float = 0.1, hidden: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters("lr")

    module = Native(lr=0.5, note="x")
    assert module.hparams == {"lr": 0.5, "hidden": 4, "note": "x"} and module.hparams.lr == 0.5
    assert Some().hparams == {"lr": 0.1}
    with pytest.raises(AttributeError, match="hparams has no 'nope'"):
        module.hparams.nope  # noqa: B018 (the access is what raises)


class _CountsWhatItSees(BoringModel):
    """Its own loaders refuse to be used: the data passed to the Trainer must be."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = {"train": 0, "val": 0, "test": 0}

    def training_step(self, batch, batch_idx):
        self.seen["train"] += len(batch)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.seen["val"] += len(batch)
        self.log("val_n", float(len(batch)), reduce_fx="sum")

    def test_step(self, batch, batch_idx):
        self.seen["test"] += len(batch)
        self.log("test_n", float(len(batch)), reduce_fx="sum")

    def train_dataloader(self):
        raise AssertionError("the loader passed to the Trainer must be used, not the module's")

    val_dataloader = test_dataloader = train_dataloader


class _PlainModule(unifit.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.seen = torch.nn.Linear(32, 2), 0

    def training_step(self, batch, batch_idx):
        self.seen += len(batch)
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.timeout(120)
def test_data_passed_the_ways_lightnings_trainer_takes_it(tmp_path):
    """fit(model, train, val) positionally, train_dataloaders= / val_dataloaders=, datamodule= with
    LightningDataModule.from_datasets, validate/test with dataloaders; a unifit module with a DataLoader."""
    from lightning.pytorch.demos.boring_classes import RandomDataset
    from torch.utils.data import DataLoader

    def loader(n: int) -> DataLoader:
        return DataLoader(RandomDataset(32, n), batch_size=4)

    def trainer() -> Trainer:
        return Trainer(strategy="single", max_epochs=1, root_dir=str(tmp_path), checkpoint={"enabled": False}, **QUIET)

    fits = {
        "positional": lambda m: trainer().fit(m, loader(16), loader(8)),
        "keywords": lambda m: trainer().fit(m, train_dataloaders=loader(16), val_dataloaders=loader(8)),
        "from_datasets": lambda m: trainer().fit(
            m,
            datamodule=L.LightningDataModule.from_datasets(
                train_dataset=RandomDataset(32, 16), val_dataset=RandomDataset(32, 8), batch_size=4
            ),
        ),
    }
    for how, fit in fits.items():
        module = _CountsWhatItSees()
        state = fit(module)
        assert module.seen == {"train": 16, "val": 8, "test": 0}, how
        assert state.progress.optimizer_step == 4 and state.metrics["val_n"] == 8.0, how  # batch size 4, adopted
    module = _CountsWhatItSees()
    assert trainer().test(module, loader(12)) == {"test_n": 12.0}
    assert trainer().validate(module, dataloaders=loader(4)) == {"val_n": 4.0}
    plain = _PlainModule()
    assert trainer().fit(plain, loader(8)).progress.optimizer_step == 2 and plain.seen == 8
    with pytest.raises(ConfigError, match=r"received a LightningDataModule and loaders \(train\); pass either"):
        trainer().fit(_CountsWhatItSees(), L.LightningDataModule(), train_dataloaders=loader(4))


@pytest.mark.timeout(120)
def test_the_glue_tutorials_epoch_end_metrics_equal_lightnings(tmp_path):
    """Lightning's GLUE tutorial module (tests/zoo/logging_models.py) with one validation loader: it computes and
    logs its metrics in on_validation_epoch_end (the zoo runs its two-loader MNLI form on every strategy)."""
    from tests.zoo.logging_models import GLUETransformer
    from tests.zoo.torch_models import VOCAB, SentencesData

    def build():
        torch.manual_seed(0)
        return GLUETransformer(vocab_size=VOCAB), SentencesData(4)

    module, data = build()
    lightning_trainer = _lightning_trainer(2)
    lightning_trainer.fit(module, datamodule=data)
    theirs = {k: float(v) for k, v in lightning_trainer.callback_metrics.items()}
    module, data = build()
    ours = Trainer(strategy="single", max_epochs=2, root_dir=str(tmp_path), **QUIET).fit(module, data).metrics
    assert set(theirs) == {"val_loss", "accuracy"} and ours["accuracy"] == pytest.approx(theirs["accuracy"])
    assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-6)


class _CountingWrapper(torch.optim.Optimizer):
    """An optimizer that wraps another, Lookahead-style, keeping it as `.optimizer`: its own step must run."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer, self.steps = inner, 0
        self.param_groups, self.defaults, self.state = inner.param_groups, inner.defaults, inner.state

    def step(self, closure=None):
        self.steps += 1
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


class _ManualWithWrapper(ManualOptimBoringModel):
    def configure_optimizers(self):
        self.wrapper = _CountingWrapper(torch.optim.SGD(self.layer.parameters(), lr=0.1))
        return self.wrapper


@pytest.mark.timeout(120)
def test_an_optimizer_that_wraps_another_is_stepped_itself(tmp_path):
    module = _ManualWithWrapper()
    Trainer(strategy="single", max_epochs=1, root_dir=str(tmp_path), checkpoint={"enabled": False}, **QUIET).fit(module)
    assert module.wrapper.steps == 64  # BoringDataModule's 64 batches of 1, one opt.step() each


class _LogsPerStep(BoringModel):
    def training_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("by_default", loss)  # training_step: on_step by default, as in Lightning
        self.log("asked", 2.0 * batch_idx, on_step=True, on_epoch=True)
        self.log("epoch_only", loss, on_step=False)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_x", 1.0)  # validation: epoch only by default


@pytest.mark.timeout(120)
def test_values_logged_per_step_are_written_per_step_in_tensorboard(tmp_path):
    """Read back with TensorBoard's own reader: <name>_step at every log_every_n_steps, the epoch value as <name>."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Trainer(
        strategy="single",
        max_epochs=1,
        root_dir=str(tmp_path),
        progress_bar=False,
        checkpoint={"enabled": False},
        tensorboard={"log_every_n_steps": 16},
    ).fit(_LogsPerStep())
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"by_default_step", "asked_step", "by_default", "asked", "epoch_only", "val_x"} <= tags, sorted(tags)
    assert not {"epoch_only_step", "val_x_step"} & tags
    asked = acc.Scalars("asked_step")  # 64 batches of 1: written after steps 16, 32, 48, 64 (batch_idx = step - 1)
    assert [(e.step, e.value) for e in asked] == [(s, 2.0 * (s - 1)) for s in (16, 32, 48, 64)]
    assert [e.value for e in acc.Scalars("asked")] == [63.0]  # the epoch mean of 2 x batch_idx


class _TwoSchedulers(BoringModel):
    """One optimizer driven by two schedulers at once, as Lightning steps them (a decay per epoch and a warmup
    per step, a common pairing)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
        return [opt], [{"scheduler": decay, "interval": "epoch"}, {"scheduler": warmup, "interval": "step"}]


@pytest.mark.timeout(120)
def test_several_schedulers_for_one_optimizer_step_as_under_lightning(tmp_path):
    g = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.randn(8, 32, generator=g), batch_size=2)
    trained = []
    for kind in ("lightning", "unifit"):
        torch.manual_seed(0)
        model = _TwoSchedulers()
        if kind == "lightning":
            _lightning_trainer(3).fit(model, train_dataloaders=loader)
        else:
            Trainer(max_epochs=3, root_dir=str(tmp_path), lr_scaling="none", **QUIET).fit(
                model, train_dataloaders=loader
            )
        trained.append(model)
    theirs, ours = trained
    assert torch.equal(ours.layer.weight, theirs.layer.weight)


class _TwoPredictSets(BoringModel):
    """predict_dataloader returns two loaders: predict_step gets dataloader_idx, as in Lightning."""

    def predict_dataloader(self):
        g = torch.Generator().manual_seed(3)
        return [
            torch.utils.data.DataLoader(torch.randn(10, 32, generator=g), batch_size=4),
            torch.utils.data.DataLoader(torch.randn(6, 32, generator=g), batch_size=4),
        ]

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self.layer(batch) + dataloader_idx


@pytest.mark.timeout(120)
def test_several_predict_loaders_give_a_list_of_predictions(tmp_path):
    torch.manual_seed(0)
    module = _TwoPredictSets()
    theirs = _lightning_trainer(1).predict(module)  # per loader, a list of batch outputs
    ours = Trainer(root_dir=str(tmp_path), **QUIET).predict(module)
    assert isinstance(ours, list) and [len(p) for p in ours] == [10, 6]
    for mine, their_batches in zip(ours, theirs):
        torch.testing.assert_close(mine, torch.cat(their_batches), rtol=0, atol=0)


class _TwoLoaders(BoringModel):
    """Trains on a list of two loaders of 8 and 3 batches, or a CombinedLoader of them in `mode`; records what
    each step received (the second loader's first value, or None)."""

    def __init__(self, mode: str | None, stream: bool = False) -> None:
        super().__init__()
        self.mode, self.stream, self.seen = mode, stream, []

    def train_dataloader(self):
        from lightning.pytorch.utilities import CombinedLoader

        first = torch.utils.data.DataLoader(torch.arange(16.0).reshape(8, 2), batch_size=1)
        rows = torch.arange(100.0, 106.0).reshape(3, 2)
        data = {False: rows, True: _Rows(rows), "endless": _EndlessRows(rows)}[self.stream]
        second = torch.utils.data.DataLoader(data, batch_size=1)
        return [first, second] if self.mode is None else CombinedLoader([first, second], mode=self.mode)

    def training_step(self, batch, batch_idx):
        first, second = batch
        self.seen.append(None if second is None else float(second[0, 0]))
        loss = self.layer(first.repeat(1, 16)).sum() + (0 if second is None else self.layer(second.repeat(1, 16)).sum())
        return loss * 1e-3


class _Rows(torch.utils.data.IterableDataset):
    """A stream of known length (an IterableDataset: no __getitem__)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


class _EndlessRows(torch.utils.data.IterableDataset):
    """An endless stream (no __len__): its rows over and over, from the first on each iteration."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __iter__(self):
        return itertools.cycle(self.rows)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mode, stream, steps",
    [
        (None, False, None),
        ("min_size", False, None),
        ("max_size", False, None),
        (None, True, None),
        (None, "endless", 11),  # an endless epoch, as in Lightning: trained by max_steps, the other loader cycling
        ("min_size", "endless", None),  # ends with the other loader, the stream read again each epoch
    ],
)
def test_several_training_loaders_combine_as_lightnings_combined_loader(tmp_path, mode, stream, steps):
    """(None, True): the short loader is a stream, cycled by re-reading it as Lightning's does."""
    torch.manual_seed(0)
    theirs = _TwoLoaders(mode, stream)
    lightning_trainer(max_epochs=2, max_steps=steps or -1).fit(theirs)
    torch.manual_seed(0)
    ours = _TwoLoaders(mode, stream)
    Trainer(strategy="single", max_epochs=2, max_steps=steps, root_dir=str(tmp_path), lr_scaling="none", **QUIET).fit(
        ours
    )
    assert ours.seen == theirs.seen  # None (max_size_cycle): the short loader cycles, 8 steps an epoch
    assert len(ours.seen) == (steps or len(theirs.seen)) and len(ours.seen) >= 6
    for key, value in _weights(theirs).items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7)


class _CombinedValidation(BoringModel):
    """Validates on a CombinedLoader of two loaders (5 and 2 batches) in `mode`, as a dict: records each step's
    values and logs a sum over what it got."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.seen = mode, []

    def val_dataloader(self):
        from lightning.pytorch.utilities import CombinedLoader

        long = torch.utils.data.DataLoader(torch.arange(10.0).reshape(5, 2), batch_size=1)
        short = torch.utils.data.DataLoader(torch.arange(100.0, 104.0).reshape(2, 2), batch_size=1)
        return CombinedLoader({"long": long, "short": short}, mode=self.mode)

    def validation_step(self, batch, batch_idx):
        values = {key: None if value is None else float(value[0, 0]) for key, value in batch.items()}
        self.seen.append((batch_idx, values["long"], values["short"]))
        self.log("val_total", sum(v for v in values.values() if v is not None), batch_size=1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size", "max_size"])
def test_a_combined_validation_loader_gives_combined_batches_as_lightning(tmp_path, mode):
    theirs, ours = _CombinedValidation(mode), _CombinedValidation(mode)
    their_metrics = _lightning_trainer(1).validate(theirs)[0]
    our_metrics = Trainer(root_dir=str(tmp_path), **QUIET).validate(ours)
    assert ours.seen == theirs.seen and len(ours.seen) == (2 if mode == "min_size" else 5)
    assert our_metrics["val_total"] == pytest.approx(their_metrics["val_total"], rel=1e-6)


@pytest.mark.timeout(60)
def test_an_endless_stream_among_several_loaders_without_max_steps_is_one_line():
    _bad(_TwoLoaders(None, "endless"), "makes the epoch endless, as in Lightning; set trainer.max_steps")


class _SequentialTraining(_TwoLoaders):
    def __init__(self) -> None:
        super().__init__("sequential")


@pytest.mark.timeout(60)
def test_a_sequential_combined_loader_is_refused_for_training_as_lightning_does():
    _bad(_SequentialTraining(), "CombinedLoader(mode='sequential') for training")


class _StepsWithoutIndex(Regressor):
    """Steps written as Lightning's GAN example writes training_step: no batch_idx parameter."""

    def training_step(self, batch):
        return super().training_step(batch, 0)

    def validation_step(self, batch):
        super().validation_step(batch, 0)

    def predict_step(self, batch):
        return self(batch[0])

    def predict_dataloader(self):
        return self.val_dataloader()


@pytest.mark.timeout(120)
def test_steps_without_batch_idx_are_called_as_lightning_calls_them(tmp_path):
    torch.manual_seed(0)
    theirs = _StepsWithoutIndex()
    reference = lightning_trainer(max_epochs=2)
    reference.fit(theirs)
    torch.manual_seed(0)
    ours = _StepsWithoutIndex()
    trainer = Trainer(strategy="single", max_epochs=2, batch_size=8, root_dir=str(tmp_path), lr_scaling="none", **QUIET)
    metrics = trainer.fit(ours).metrics
    for key, value in _weights(theirs).items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert metrics["val_mse"] == pytest.approx(float(reference.callback_metrics["val_mse"]), rel=1e-5)
    assert trainer.predict(ours).shape == (20, 1)
