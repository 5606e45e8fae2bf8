"""validate / test / predict: a disjoint shard per rank, metrics exact over all ranks, predictions in
dataset order exactly once; from the command line (with a checkpoint's weights) and from Python."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess

import pytest
import torch

from tests.helpers import STRATEGY, assert_ok, launch_probe, probe_args, run_unifit, start_unifit, stop
from unifit import Trainer
from unifit.errors import UnifitError

EVALUATE_BOTH = "tests/probe/evaluate_both.py"


def _metrics(result, run, stage: str) -> dict[str, float]:
    assert f"{stage}: " in result.stdout  # the one summary line (horovodrun prefixes it)
    return json.loads((run / f"{stage}.json").read_text())["metrics"]  # every digit


def _evaluate_on_the_command_line(strategy: str, run, out) -> dict[str, float]:
    """`unifit launch --run test` and `--run predict` with the last checkpoint: two launches of a strategy that
    runs one process, side by side (each keeps one core busy). The test metrics; the predictions in
    out/predictions.pkl."""
    assert STRATEGY[strategy].nproc == 1  # no ports to share
    tested, predicted = _side_by_side(
        probe_args(strategy, run, "--run", "test", ckpt="last"),
        probe_args(strategy, run, "--run", "predict", "--output", str(out / "predictions.pkl"), ckpt="last"),
    )
    assert_ok(tested)
    assert_ok(predicted)
    assert "predict: 23 predictions written to" in predicted.stdout
    return _metrics(tested, run, "test")


def _side_by_side(*commands: list[str], timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """run_unifit for each command, all started at once; a timeout kills every one of them."""
    procs = [start_unifit(*command) for command in commands]
    done: list[subprocess.CompletedProcess] = []
    try:
        for proc in procs:
            out, err = stop(proc, timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs[len(done) :]:  # left running by a timeout
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # a process outside the group holds a pipe
                proc.communicate(timeout=30)
    return done


def _evaluate_in_one_launch(strategy: str, run, out, validate: bool) -> dict[str, float]:
    """Trainer.test, then Trainer.predict with the last checkpoint (then Trainer.validate with the best one)
    in one launch of tests/probe/evaluate_both.py: one process start per rank, not two. The test metrics;
    the predictions in out/predictions.pkl, the validation metrics in out/validate.json."""
    case = STRATEGY[strategy]
    script = [EVALUATE_BOTH, "-c", str(case.probe_yaml), "--out", str(out), "--ckpt-path", "last"]
    script += ["--trainer.strategy", case.strategy, "--trainer.root_dir", str(run), *case.options]
    script += ["--validate", "best"] if validate else []
    launched = run_unifit("launch", "--nproc-per-node", str(case.nproc), "--strategy", case.strategy, "--", *script)
    assert_ok(launched)
    assert "23 predictions written to" in launched.stdout
    return json.loads((out / "test.json").read_text())["metrics"]


@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "trained_by, strategies",
    [
        ("fsdp", ["single", "ddp", "horovod", "fsdp"]),  # sharded ckpt
        ("mwms", ["mirrored", "mwms", "horovod-keras"]),
    ],
)
def test_checkpoint_evaluated_on_every_strategy_equals_one_process(tmp_path, trained_by, strategies):
    """The first strategy listed runs in one process: the reference the others must equal. It evaluates
    from the command line (`--run test`, `--run predict`: two launches); the others test and predict in
    one launch each through the Python API, the strategy that trained validating there too (process
    starts are what this test spends its time on: TensorFlow's take seconds each)."""
    assert trained_by in strategies[1:]
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
        out = tmp_path / strategy
        out.mkdir()
        if strategy == strategies[0]:
            metrics = _evaluate_on_the_command_line(strategy, run, out)
        else:
            metrics = _evaluate_in_one_launch(strategy, run, out, validate=strategy == trained_by)
        results[strategy] = (metrics, torch.as_tensor(pickle.loads((out / "predictions.pkl").read_bytes())))
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

    validated = json.loads((tmp_path / trained_by / "validate.json").read_text())["metrics"]
    assert validated["val/index_mean"] == 18.0  # 37 samples: the strategy that trained, with its best checkpoint


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
