"""Bad input: one line naming the field, what was received and the fix; exit code 2; no traceback.

Checked in this process (the `cli` fixture calls unifit's main()); one bad config, one missing file and
one refused launch go through a real `python -m unifit` each, so the process's exit code and output
stay pinned end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import PROBE_YAML, launch_probe, run_unifit


def _one_line_error(result, *needles: str) -> str:
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("unifit: error")]
    assert len(errors) >= 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


BASE = """
module:
  class_path: tests.probe.probe.ProbeModule
trainer:
  root_dir: {root}
  max_epochs: 1
"""


END_TO_END = ["--trainer.strategy", "nope"]  # the case run by a real `python -m unifit`


@pytest.mark.launch
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "override, needles",
    [
        (["--trainer.strategy", "nope"], ["trainer.strategy", "'nope'", "single, ddp"]),
        (["--trainer.batch_size", "-4"], ["trainer.batch_size", "-4", "greater than 0"]),
        (["--trainer.max_epochs", "ten"], ["trainer.max_epochs", "'ten'", "integer"]),
        (["--trainer.max_epoch", "3"], ["unknown key 'trainer.max_epoch'", "did you mean 'max_epochs'"]),
        (["--trainer.checkpoint.keep_last", "3"], ["trainer.checkpoint.keep_last", "keep_last_n"]),
        (["--trainer.lr_scaling", "cubic"], ["trainer.lr_scaling", "'cubic'", "linear"]),
        (["--trainer.warmup_epochs", "1", "--trainer.warmup_steps", "5"], ["warmup_steps", "only one"]),
        (["--module.class_path", "tests.probe.probe.NoSuchModule"], ["module.class_path", "NoSuchModule"]),
        (["--module.class_path", "no_such_pkg.Module"], ["module.class_path", "no_such_pkg"]),
        (["--module.init_args.lr", "-0.5"], ["configure_optimizers", "-0.5", "init_args"]),
        (["--module.init_args.bogus", "1"], ["module.init_args", "bogus"]),
        (
            ["--trainer.strategy", "ddp", "--trainer.strategy_options.bucket_cap", "5"],
            ["trainer.strategy_options.bucket_cap", "bucket_cap_mb"],
        ),
        (["--trainer.strategy_options.x", "5"], ["trainer.strategy_options.x", "valid keys: (none)"]),
        (
            ["--trainer.strategy", "fsdp", "--trainer.strategy_options", "{share_gpus: true, backend: nccl}"],
            ["trainer.strategy_options.share_gpus", "backend gloo"],
        ),
        (["--trainer.accelerator", "tpu"], ["trainer.accelerator", "'tpu'"]),
        (["--trainer.bogus"], ["--trainer.bogus", "no value"]),
        (["--epochs", "3"], ["unknown argument '--epochs'"]),
    ],
)
def test_bad_config_gives_one_line_and_exit_2(tmp_path, cli, override, needles):
    exp = _write(tmp_path, BASE.format(root=tmp_path / "run"))
    run = run_unifit if override == END_TO_END else cli
    _one_line_error(run("fit", "-c", str(exp), *override, timeout=60), *needles)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_missing_config_file_and_invalid_yaml(tmp_path, cli):
    # a missing file in a real process, end to end
    _one_line_error(run_unifit("fit", "-c", str(tmp_path / "missing.yaml")), "missing.yaml", "does not exist")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epochs: [1,\n")
    _one_line_error(cli("print-config", "-c", str(bad)), "bad.yaml", "not valid YAML", "line")
    wrong_type = tmp_path / "list.yaml"
    wrong_type.write_text("- a\n- b\n")
    _one_line_error(cli("fit", "-c", str(wrong_type)), "list.yaml", "expected a mapping")
    no_module = tmp_path / "nomodule.yaml"
    no_module.write_text("trainer: {max_epochs: 1}\n")
    _one_line_error(cli("fit", "-c", str(no_module)), "'module' is required")


@pytest.mark.launch
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_resume_without_checkpoint_fails_on_every_rank(tmp_path, strategy):
    result = launch_probe(strategy, tmp_path / "empty", ckpt="last", timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "--ckpt-path last: no committed checkpoint" in line]
    assert len(errors) == (2 if strategy == "ddp" else 1), result.stderr  # every rank says why it stopped
    assert "Traceback" not in result.stderr


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_single_strategy_refuses_many_processes(tmp_path):
    """A refused launch, in a real process end to end."""
    exp = _write(tmp_path, BASE.format(root=tmp_path / "run"))
    _one_line_error(run_unifit("launch", "--nproc-per-node", "2", "-c", str(exp)), "strategy 'single' runs one process")


@pytest.mark.timeout(60)
def test_print_config_shows_resolved_values_with_overrides(cli):
    result = cli("print-config", "-c", str(PROBE_YAML), "--trainer.max_epochs", "7", "--module.init_args.lr=0.2")
    assert result.returncode == 0, result.stderr
    import yaml

    cfg = yaml.safe_load(result.stdout)
    assert cfg["trainer"]["max_epochs"] == 7
    assert cfg["module"]["init_args"]["lr"] == 0.2
    assert cfg["trainer"]["checkpoint"]["keep_last_n"] == 3  # defaults are filled in
    assert cfg["trainer"]["lr_scaling"] == "linear"


def test_objects_that_are_not_callbacks_and_bad_sample_weights_are_refused_in_one_line():
    import numpy as np

    from unifit import Trainer
    from unifit.errors import ConfigError
    from unifit.frameworks.keras.data import arrays

    for callback, needle in [
        (object(), "not a callback: give a unifit.Callback subclass"),
    ]:
        with pytest.raises(ConfigError, match="trainer.callbacks\\[0\\]") as caught:
            Trainer(callbacks=[callback])
        assert needle in str(caught.value) and "\n" not in str(caught.value)
    x = np.zeros((4, 2), np.float32)
    with pytest.raises(
        ConfigError, match=r"train_dataset\(\): received 4 arrays; give \(x, y\) or \(x, y, sample_weight\)"
    ):
        arrays((x, x[:, 0], np.ones(4), np.ones(4)), "train_dataset()")
    with pytest.raises(ConfigError, match=r"train_dataset\(\): sample weights have shape \(4, 2\)"):
        arrays((x, x[:, 0], np.ones((4, 2))), "train_dataset()")
