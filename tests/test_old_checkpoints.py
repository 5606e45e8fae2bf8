"""Checkpoints written by an earlier unifit still resume: the ones in tests/data/old_checkpoints were
written by the code before the checkpoint owner (make.sh there says how), so a change to the format or
its reader cannot strand the checkpoints users already have."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import KERAS_PROBE_YAML, PROBE_YAML, assert_ok, run_unifit
from unifit.cli.main import main

OLD = Path(__file__).parent / "data" / "old_checkpoints"


def _args(yaml: Path, root: Path, *extra: str) -> list[str]:
    report = {"class_path": "tests.probe.callbacks.ProbeReport", "init_args": {"out_dir": str(root / "reports")}}
    return [
        "-c",
        str(yaml),
        "--trainer.root_dir",
        str(root),
        "--trainer.max_epochs",
        "1",
        "--trainer.seed",
        "7",
        "--trainer.tensorboard.enabled",
        "false",
        "--trainer.callbacks",
        json.dumps([report]),
        *extra,
    ]


def _report(root: Path) -> dict:
    return json.loads((root / "reports" / "report_0.json").read_text())


def _copy(name: str, tmp_path: Path) -> str:
    return str(shutil.copytree(OLD / name, tmp_path / "old" / name))


def test_a_mid_epoch_checkpoint_resumes_bit_for_bit(tmp_path):
    """Saved at step 5 of 8: the data position, partial epoch sums, RNG and callbacks all come back."""
    every = ("--trainer.checkpoint.every_n_steps", "5")
    assert main(["fit", *_args(PROBE_YAML, tmp_path / "whole", *every)]) == 0
    resumed = tmp_path / "resumed"
    assert main(["fit", *_args(PROBE_YAML, resumed, *every), "--ckpt-path", _copy("single", tmp_path)]) == 0
    whole, again = _report(tmp_path / "whole"), _report(resumed)
    assert again["global_step"] == whole["global_step"] == 8
    assert again["weights_sha256"] == whole["weights_sha256"]
    assert again["metrics"]["train/loss"] == whole["metrics"]["train/loss"]  # the epoch's average over all 8 batches


def test_a_sharded_fsdp_checkpoint_loads_whole_in_one_process(tmp_path):
    """fsdp's shards (torch.distributed.checkpoint) are read whole: the weights the 2 ranks ended with."""
    saved = json.loads((OLD / "fsdp.report.json").read_text())
    assert main(["fit", *_args(PROBE_YAML, tmp_path), "--ckpt-path", _copy("fsdp", tmp_path)]) == 0
    loaded = _report(tmp_path)
    assert loaded["global_step"] == saved["global_step"] == 8
    assert loaded["weights_sha256"] == saved["weights_sha256"]


@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(240)
def test_a_keras_checkpoint_restores_its_variables(tmp_path):
    saved = json.loads((OLD / "keras.report.json").read_text())
    ckpt = _copy("keras", tmp_path)
    result = run_unifit("fit", *_args(KERAS_PROBE_YAML, tmp_path, "--trainer.strategy", "single"), "--ckpt-path", ckpt)
    assert_ok(result)
    loaded = _report(tmp_path)
    assert loaded["global_step"] == saved["global_step"] == 8
    assert loaded["weights_sha256"] == saved["weights_sha256"]
