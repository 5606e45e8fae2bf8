"""Every validation that runs is logged, and trainer.lr_scaling says when it changes the module's lr.

With trainer.val_check_interval, each validation inside an epoch reaches every logger (unifit's csv and
TensorBoard, a Lightning logger object) and metrics.jsonl at the step it ran at, as Lightning's own Trainer logs
it; the epoch's own validation once, with the epoch; `unifit plot` draws the run. The lr rule is said once, on
rank 0, where it changes the lr, and not where it keeps it.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
import torch

import unifit
from tests.helpers import lightning_trainer
from tests.probe.lightning_probe import Regressor
from tests.test_batch_size_find import MemoryBound
from unifit.plot import read_run, render, render_html

EVERY = 2  # val_check_interval: the Regressor has 8 batches an epoch, so 3 validations inside each


def _rows_with(path: Path, key: str) -> list[tuple[int, float]]:
    with open(path, newline="") as f:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(f) if row.get(key)]


def _regressor() -> Regressor:
    torch.manual_seed(0)
    return Regressor()


def _close(ours: list[tuple[int, float]], theirs: list[tuple[int, float]]) -> None:
    """unifit's step is the optimizer steps taken, Lightning's the 0-based index of the last one (its step logs and
    epoch ends are one lower too: 2, 5... and 7, 15 for unifit's 3, 6... and 8, 16)."""
    assert [step for step, _ in ours] == [step + 1 for step, _ in theirs]
    torch.testing.assert_close([v for _, v in ours], [v for _, v in theirs], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(180)
def test_every_validation_reaches_every_logger_at_its_step_as_under_lightning(tmp_path):
    from lightning.pytorch.loggers import CSVLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reference = CSVLogger(tmp_path / "lightning")
    lightning_trainer(max_epochs=2, val_check_interval=EVERY, logger=reference).fit(_regressor())
    expected = _rows_with(Path(reference.log_dir) / "metrics.csv", "val_mse")
    assert len(expected) == 8  # Lightning's: after steps 2, 4, ... 16

    root, foreign = tmp_path / "run", CSVLogger(tmp_path / "foreign")
    unifit.Trainer(
        root_dir=str(root),
        max_epochs=2,
        val_check_interval=EVERY,
        loggers=["csv", "tensorboard", foreign],
        progress_bar=False,
        checkpoint={"enabled": False},
    ).fit(_regressor())

    _close(_rows_with(root / "metrics.csv", "val_mse"), expected)  # each once: the epoch's end not twice
    _close(_rows_with(Path(foreign.log_dir) / "metrics.csv", "val_mse"), expected)
    events = EventAccumulator(str(root / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    _close([(e.step, e.value) for e in events.Scalars("val_mse")], expected)
    assert [e.step for e in events.Scalars("epoch")] == [8, 16]  # `epoch` marks the epochs' ends only

    lines = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    _close([(line["step"], line["val_mse"]) for line in lines], expected)
    inside = [(line["epoch"], line["step"]) for line in lines if line.get("mid_epoch")]
    assert inside == [(0, 2), (0, 4), (0, 6), (1, 10), (1, 12), (1, 14)]
    assert all("train_mse_epoch" not in line for line in lines if line.get("mid_epoch"))  # the validation's alone
    assert [(line["epoch"], line["step"]) for line in lines if not line.get("mid_epoch")] == [(1, 8), (2, 16)]

    run = read_run(str(root))  # unifit plot: the validations inside epochs drawn at their steps
    assert render([run], width_px=400, height_px=300)[:4] == b"\x89PNG" and all(t is not None for t in run.elapsed)
    assert "<td>2</td><td>16</td>" in render_html([run], b"").decode()  # the last epoch's row: epoch 2, step 16


def _lr_lines(caplog, module=None, **options) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="unifit"):
        unifit.Trainer(
            max_epochs=1, limit_train_batches=2, progress_bar=False, checkpoint={"enabled": False}, **options
        ).fit(module or Regressor(lr=0.05))
    return [r.getMessage() for r in caplog.records if "lr_scaling" in r.getMessage()]


@pytest.mark.timeout(120)
def test_the_lr_rule_is_said_once_where_it_changes_the_modules_lr(tmp_path, caplog):
    """batch 8 over a base of 2: linear scaling is x4, sqrt x2 (with a warmup the module's lr is where it starts)."""
    quiet = dict(root_dir=str(tmp_path), tensorboard={"enabled": False}, batch_size=8)
    assert _lr_lines(caplog, base_batch_size=2, **quiet) == [
        "lr 0.05 -> 0.2: lr_scaling linear for a global batch 4x the base (8 / 2); lr_scaling: none keeps your module's"
    ]
    assert _lr_lines(caplog, base_batch_size=2, lr_scaling="sqrt", warmup_steps=5, **quiet) == [
        "lr 0.05 -> 0.1 (reached after a warmup of 5 steps): lr_scaling sqrt for a global batch 4x the base (8 / 2); "
        "lr_scaling: none keeps your module's"
    ]
    assert _lr_lines(caplog, base_batch_size=2, lr_scaling="none", **quiet) == []
    assert _lr_lines(caplog, **quiet) == []  # linear, a global batch equal to the base: x1
    # the batch size finder scales the lr at each size it tries: said once, for the size found (16 of 8, 16, 32)
    finder = {"batch_size_find": {"mode": "power", "steps_per_trial": 1}, "base_batch_size": 8}
    module = MemoryBound(limit=16, n=64)
    lines = _lr_lines(caplog, module, **{**quiet, **finder})
    assert module.batch_size == 16 and lines == [
        "lr 0.05 -> 0.1: lr_scaling linear for a global batch 2x the base (16 / 8); lr_scaling: none keeps your module's"
    ]


class _Validations(unifit.Callback):
    """(step, metrics) of every validation, as the callbacks see it."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict]] = []

    def on_validation_end(self, ctx) -> None:
        self.seen.append((ctx.state.global_step, dict(ctx.state.metrics)))


@pytest.mark.tf
@pytest.mark.timeout(180)
def test_a_keras_module_logs_its_validations_inside_epochs_and_says_its_lr_rule(tmp_path, caplog):
    """The Keras engine under the same loop: each validation inside the epoch in metrics.jsonl with the values the
    callbacks saw (val/rank_plus_one is 1.0 each time: recorded though unchanged), and the lr line during warmup."""
    from tests.probe.keras_probe import KerasProbe

    seen = _Validations()
    with caplog.at_level(logging.INFO, logger="unifit"):
        unifit.Trainer(
            root_dir=str(tmp_path),
            max_epochs=1,
            batch_size=8,
            base_batch_size=4,
            warmup_steps=4,
            val_check_interval=EVERY,
            progress_bar=False,
            checkpoint={"enabled": False},
            callbacks=[seen],
        ).fit(KerasProbe(lr=0.05))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    inside = [(line.pop("step"), line) for line in lines if line.pop("mid_epoch", False)]
    val = [(step, {k: v for k, v in metrics.items() if k.startswith("val/")}) for step, metrics in seen.seen]
    assert [(step, {k: v for k, v in line.items() if k.startswith("val/")}) for step, line in inside] == val[:-1]
    assert [step for step, _ in inside] == [2, 4, 6] and lines[-1]["step"] == 8 == val[-1][0]
    said = [r.getMessage() for r in caplog.records if "lr_scaling" in r.getMessage()]
    assert said == [
        "lr 0.05 -> 0.1 (reached after a warmup of 4 steps): lr_scaling linear for a global batch 2x the base (8 / 4); "
        "lr_scaling: none keeps your module's"
    ]
