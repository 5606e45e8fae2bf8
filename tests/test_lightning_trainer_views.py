"""A script written for Lightning's Trainer, run by `unifit.Trainer`: Lightning's keywords take the LightningCLI
file's mapping (or a one-line refusal), and what the script reads after fit (trainer.logger.log_dir,
callback_metrics, checkpoint_callback.best_model_path, global_step...) is what Lightning's own Trainer gives; a ddp
fit with a parameter in no loss (a DQN's target network) fails in one line naming the option."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import unifit
from tests.helpers import lightning_trainer, run_unifit
from unifit.config.lightning_cli import from_lightning_cli
from unifit.config.schema import TrainerConfig

LIGHTNING_KEYWORDS = {
    "enable_progress_bar": False,
    "log_every_n_steps": 7,
    "val_check_interval": 0.5,
    "check_val_every_n_epoch": 2,
    "max_epochs": 3,
    "precision": 16,
    "gradient_clip_val": 0.5,
    "accumulate_grad_batches": 2,
    "limit_train_batches": 1.0,
    "enable_checkpointing": False,
    "logger": False,
    "devices": 1,
    "num_nodes": 1,
    "strategy": "auto",
    "accelerator": "cpu",
    "benchmark": True,
}


def test_lightning_keywords_change_the_config_as_a_lightning_cli_file_does(tmp_path):
    keywords = {**LIGHTNING_KEYWORDS, "default_root_dir": str(tmp_path)}
    from_file = from_lightning_cli({"model": {"class_path": "m.M"}, "trainer": dict(keywords)}, "f.yaml")
    expected = {k: v for k, v in from_file.experiment["trainer"].items() if k != "lr_scaling"}  # the file's own
    mine = unifit.Trainer(**keywords).config
    assert mine.model_dump() == TrainerConfig.model_validate(expected).model_dump()
    assert (mine.precision, mine.root_dir, mine.progress_bar) == ("16-mixed", str(tmp_path), False)


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"overfit_batches": 3}, "overfit_batches: received 3, which unifit does not offer: pass a small training"),
        ({"devices": 2}, "start it with unifit launch --nproc-per-node 2 --nnodes 1 -- SCRIPT"),
        ({"devices": [0, 1]}, "devices: received [0, 1]; give a number of processes per node"),
        ({"strategy": "deepspeed"}, "unknown strategy 'deepspeed' (did you mean fsdp"),
        ({"logger": CSVLogger("x"), "loggers": ["csv"]}, "give the loggers one way"),
    ],
)
def test_lightning_keywords_unifit_cannot_honour_are_refused_in_one_line(keywords, named):
    with pytest.raises(unifit.ConfigError) as caught:
        unifit.Trainer(**keywords)
    assert named in str(caught.value) and "\n" not in str(caught.value)


class Regression(LightningModule):
    """Logs val_loss (monitored) and train_loss per epoch, as the tutorials do."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def _loader(self, seed: int) -> torch.utils.data.DataLoader:
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(seed))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def train_dataloader(self):
        return self._loader(1)

    def val_dataloader(self):
        return self._loader(2)


def _fit(make_trainer, root) -> tuple:
    torch.manual_seed(0)
    trainer = make_trainer(
        max_epochs=2,
        default_root_dir=str(root),
        logger=CSVLogger(save_dir=str(root / "logs")),
        callbacks=[ModelCheckpoint(dirpath=str(root / "ckpt"), monitor="val_loss")],
        enable_progress_bar=False,
    )
    trainer.fit(Regression())
    return trainer


@pytest.mark.timeout(120)
def test_views_after_fit_hold_what_lightnings_trainer_gives(tmp_path):
    theirs = _fit(lambda **o: lightning_trainer(**{**o, "enable_checkpointing": True}), tmp_path / "lightning")
    mine = _fit(unifit.Trainer, tmp_path / "unifit")
    assert (mine.global_step, mine.current_epoch) == (theirs.global_step, theirs.current_epoch) == (8, 2)
    assert type(mine.logger) is CSVLogger and mine.loggers == [mine.logger]
    assert mine.log_dir == mine.logger.log_dir == str(tmp_path / "unifit/logs/lightning_logs/version_0")
    for name in ("val_loss", "train_loss"):
        assert isinstance(mine.callback_metrics[name], torch.Tensor)
        torch.testing.assert_close(mine.callback_metrics[name], theirs.callback_metrics[name], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(
        mine.checkpoint_callback.best_model_score, theirs.checkpoint_callback.best_model_score, rtol=1e-4, atol=1e-6
    )
    assert os.path.exists(mine.checkpoint_callback.best_model_path)
    pd = pytest.importorskip("pandas")
    for trainer in (mine, theirs):  # Lightning's CIFAR-10 baseline tutorial, after its fit
        metrics = pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")
        del metrics["step"]
        metrics = metrics.set_index("epoch")
        assert {"val_loss", "train_loss"} <= set(metrics.dropna(axis=1, how="all").columns)


@pytest.mark.timeout(120)
def test_unifits_own_checkpoint_and_csv_logger_as_lightnings_views(tmp_path):
    trainer = unifit.Trainer(
        max_epochs=2, root_dir=str(tmp_path), progress_bar=False, loggers=["csv"], checkpoint={"monitor": "val_loss"}
    )
    torch.manual_seed(0)
    trainer.fit(Regression())
    best = trainer.checkpoint_callback
    assert os.path.exists(best.best_model_path) and best.best_model_path.startswith(str(tmp_path))
    logged = _column(f"{trainer.logger.log_dir}/metrics.csv", "val_loss")  # each epoch's, as unifit's csv has it
    assert len(logged) == 2 and float(best.best_model_score) == pytest.approx(min(logged))
    assert trainer.log_dir == str(tmp_path) and isinstance(trainer.callback_metrics["val_loss"], torch.Tensor)


def _column(path: str, name: str) -> list[float]:
    import csv

    with open(path, newline="") as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


class WithTargetNetwork(Regression):
    """Lightning's DQN example's shape: a target network whose parameters take part in no loss."""

    def __init__(self) -> None:
        super().__init__()
        self.target = torch.nn.Linear(4, 1)


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_ddp_with_a_parameter_in_no_loss_fails_in_one_line_naming_the_option(tmp_path):
    config = tmp_path / "dqn.yaml"
    config.write_text("module:\n  class_path: tests.test_lightning_trainer_views.WithTargetNetwork\n")
    result = run_unifit(
        "launch", "--nproc-per-node", "2", "-c", str(config), "--trainer.strategy", "ddp",
        "--trainer.root_dir", str(tmp_path / "run"), "--trainer.max_epochs", "1", "--trainer.progress_bar", "false",
        timeout=240,
    )  # fmt: skip
    assert result.returncode != 0
    line = "ddp: parameters target.weight, target.bias took part in no loss of the last training step"
    assert line in result.stderr and "strategy_options: {find_unused_parameters: true}" in result.stderr
    assert "Expected to have finished reduction" not in result.stderr  # DDP's own words, answered
