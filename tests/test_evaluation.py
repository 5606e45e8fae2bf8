"""validate / test / predict: a disjoint shard per rank, metrics exact over all ranks, predictions in
dataset order exactly once; from the command line (with a checkpoint's weights) and from Python."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from tests.helpers import assert_ok, launch_probe
from unifit import Trainer
from unifit.errors import UnifitError


def _metrics(result, run, stage: str) -> dict[str, float]:
    assert f"{stage}: " in result.stdout  # the one summary line (horovodrun prefixes it)
    return json.loads((run / f"{stage}.json").read_text())["metrics"]  # every digit


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "trained_by, strategies",
    [
        ("fsdp", ["single", "ddp", "horovod", "fsdp"]),  # sharded ckpt
        ("mwms", ["mirrored", "mwms", "horovod-keras"]),
    ],
)
def test_checkpoint_evaluated_on_every_strategy_equals_one_process(tmp_path, trained_by, strategies):
    """The first strategy listed runs in one process: the reference the others must equal."""
    run = tmp_path / "run"
    assert_ok(
        launch_probe(
            trained_by,
            run,
            "--trainer.max_epochs",
            "1",
            "--trainer.tensorboard.enabled",
            "false",
            "--trainer.checkpoint.monitor",
            "val/loss",
        )
    )
    results = {}
    for strategy in strategies:
        tested = launch_probe(strategy, run, "--run", "test", ckpt="last")
        assert_ok(tested)
        out = tmp_path / f"{strategy}.pkl"
        predicted = launch_probe(strategy, run, "--run", "predict", "--output", str(out), ckpt="last")
        assert_ok(predicted)
        assert "predict: 23 predictions written to" in predicted.stdout
        results[strategy] = (_metrics(tested, run, "test"), torch.as_tensor(pickle.loads(out.read_bytes())))
    reference_metrics, reference_predictions = results[strategies[0]]
    assert reference_metrics["test/index_mean"] == 14.0  # 29 samples, each seen once over all ranks
    for strategy, (metrics, predictions) in results.items():
        metrics.pop("test/rank_plus_one", None)  # differs by design: which rank saw a sample
        reference_metrics.pop("test/rank_plus_one", None)
        assert metrics == pytest.approx(reference_metrics, rel=1e-6), (
            strategy
        )  # exact over uneven shards (float32 steps)
        assert predictions[:, 0].tolist() == list(range(23)), strategy  # dataset order, each sample once
        torch.testing.assert_close(predictions, reference_predictions, rtol=1e-5, atol=1e-6)

    validated = launch_probe(trained_by, run, "--run", "validate", ckpt="best")
    assert_ok(validated)
    assert _metrics(validated, run, "validate")["val/index_mean"] == 18.0  # 37 samples


@pytest.mark.timeout(120)
def test_python_api_and_bad_input(tmp_path):
    from tests.probe.probe import ProbeModule

    torch.manual_seed(0)
    trainer = Trainer(strategy="single", max_epochs=1, batch_size=8, root_dir=str(tmp_path), progress_bar=False)
    module = ProbeModule()
    trainer.fit(module)
    before = trainer.predict(module)  # the module's weights as they are
    fresh = ProbeModule()
    restored = trainer.predict(fresh, ckpt_path="last")  # a new module with the checkpoint's weights
    torch.testing.assert_close(restored, before)
    assert trainer.test(fresh, ckpt_path="last")["test/index_mean"] == 14.0
    assert set(trainer.validate(fresh)) >= {"val/loss", "val/index_mean"}

    with pytest.raises(UnifitError, match="no committed checkpoint"):
        Trainer(strategy="single", batch_size=8, root_dir=str(tmp_path / "empty"), progress_bar=False).test(
            ProbeModule(), ckpt_path="last"
        )


@pytest.mark.timeout(120)
def test_lightning_test_and_predict_steps(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = Trainer(strategy="single", max_epochs=1, batch_size=1, root_dir=str(tmp_path), progress_bar=False)
    module = BoringModel()
    trainer.fit(module)
    predictions = trainer.predict(module)
    assert predictions.shape == (64, 2)  # BoringModel's predict_dataloader: 64 samples, Lightning's default step
    assert trainer.test(module) == {}  # its test_step logs nothing
