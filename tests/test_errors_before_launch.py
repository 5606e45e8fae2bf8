"""Mistakes found before any process starts: `unifit launch` answers in one line (exit 2) and starts nothing
when the strategy's options, its layout or the machine's GPUs cannot work; names from other trainers get a
'did you mean'; a monitor spelt with other separators is refused at the first validation, not after an epoch."""

from __future__ import annotations

import json

import pytest

import unifit
from tests.probe.probe import ProbeModule
from unifit.strategies import registry, torch_device

EXAMPLE = "examples/digits/torch.yaml"


@pytest.fixture
def launches(monkeypatch):
    """The launchers `unifit launch` asked for; none is started (a launcher that runs fails the test)."""
    asked: list[str] = []

    class NoLaunch:
        def __init__(self, name: str) -> None:
            asked.append(name)

        def launch(self, spec):
            return 0

    monkeypatch.setattr(registry, "launcher", NoLaunch)
    return asked


def one_line_error(result, *needles: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_typo_in_strategy_options_is_refused_before_launch(cli, launches):
    result = cli("launch", "--nproc-per-node", "2", "-c", EXAMPLE, "--trainer.strategy_options", "{bucket_cap: 3}")
    one_line_error(result, EXAMPLE, "trainer.strategy_options.bucket_cap", "did you mean 'bucket_cap_mb'")
    result = cli(
        "print-config", "-c", EXAMPLE, "--trainer.strategy", "fsdp", "--trainer.strategy_options", "{shard: x}"
    )
    one_line_error(result, "trainer.strategy_options.shard", "did you mean 'sharding'")
    assert launches == []


@pytest.mark.parametrize(
    ("given", "meant"),
    [("fdsp", "'fsdp'"), ("model_parallel", "'model-parallel'"), ("deepspeed", "fsdp"), ("ddp_spawn", "ddp")],
)
def test_a_misspelt_or_foreign_strategy_name_gets_a_did_you_mean(cli, launches, given, meant):
    result = cli("launch", "--nproc-per-node", "2", "-c", EXAMPLE, "--trainer.strategy", given)
    one_line_error(result, f"unknown strategy '{given}' (did you mean {meant}", "valid strategies: single, ddp")
    assert launches == []


def test_a_model_parallel_layout_that_cannot_divide_the_world_is_refused_before_launch(cli, launches):
    args = ("launch", "-c", EXAMPLE, "--trainer.strategy", "model-parallel")
    result = cli(*args, "--nproc-per-node", "3", "--trainer.strategy_options", "{tensor_parallel: 2}")
    one_line_error(result, "tensor_parallel: 2 does not divide the world size 3")
    result = cli(*args, "--nproc-per-node", "4", "--trainer.strategy_options", "{tensor_parallel: 2, data_parallel: 3}")
    one_line_error(result, "data_parallel: 3 x tensor_parallel 2 x pipeline_parallel 1 is not the world size 4")
    result = cli(
        *args, "--nproc-per-node", "2", "--nnodes", "2", "--trainer.strategy_options", "{pipeline_parallel: 3}"
    )
    one_line_error(result, "pipeline_parallel 3 does not divide the world size 4")
    result = cli(
        *args, "--nproc-per-node", "4", "--trainer.strategy_options", "{tensor_parallel: 2, pipeline_parallel: 2}"
    )
    one_line_error(result, "tensor_parallel: 2 with pipeline_parallel 2, but no plan", "plan: auto")
    assert launches == []
    assert cli(*args, "--nproc-per-node", "4", "--trainer.strategy_options", "{tensor_parallel: 2}").returncode == 0
    assert launches == ["model-parallel"]


def test_more_ranks_than_gpus_says_what_to_do_before_launch(cli, launches, monkeypatch):
    monkeypatch.setattr(torch_device, "gpus_visible", lambda: 1)
    for strategy in ("ddp", "fsdp", "smddp-like"):
        result = cli("launch", "--nproc-per-node", "2", "-c", EXAMPLE, "--trainer.strategy", strategy)
        one_line_error(
            result, "--nproc-per-node 2: this machine has 1 GPU", "--nproc-per-node 1", "accelerator cpu", "share_gpus"
        )
    assert launches == []
    ways_out = (
        ["--nproc-per-node", "1"],
        ["--trainer.accelerator", "cpu"],
        ["--trainer.strategy_options", "{share_gpus: true}"],
    )
    for extra in ways_out:
        args = ["launch", "--nproc-per-node", "2", "-c", EXAMPLE, *extra]
        args[2] = extra[1] if extra[0] == "--nproc-per-node" else "2"
        assert cli(*args).returncode == 0, extra
    assert launches == ["ddp"] * 3
    monkeypatch.setattr(torch_device, "gpus_visible", lambda: 0)  # a CPU machine: gloo ranks, any number
    assert cli("launch", "--nproc-per-node", "4", "-c", EXAMPLE).returncode == 0


@pytest.mark.parametrize(("lightning", "ours"), [("bf16", "bf16-mixed"), ("16", "16-mixed"), ("32", "32-true")])
def test_lightning_spellings_of_precision_are_taken(cli, lightning, ours):
    result = cli("print-config", "-c", EXAMPLE, "--trainer.precision", lightning)
    assert result.returncode == 0, result.stderr
    assert f"precision: {ours}\n" in result.stdout
    assert unifit.Trainer(precision=int(lightning) if lightning.isdigit() else lightning).config.precision == ours


def test_precisions_unifit_does_not_run_are_one_line(cli):
    result = cli("print-config", "-c", EXAMPLE, "--trainer.precision", "bf16-true")
    one_line_error(result, "trainer.precision", "Lightning's bf16-true is not run by unifit", "bf16-mixed")


def _fit(tmp_path, **config):
    trainer = unifit.Trainer(max_epochs=2, batch_size=8, root_dir=str(tmp_path), progress_bar=False, **config)
    return trainer, ProbeModule()


def test_a_monitor_spelt_with_other_separators_fails_at_the_first_validation(tmp_path):
    """val/index-mean for val/index_mean: refused at the first validation, a quarter into the first epoch."""
    trainer, module = _fit(tmp_path, val_check_interval=0.25, checkpoint={"enabled": True, "monitor": "val/index-mean"})
    with pytest.raises(
        unifit.ConfigError,
        match=r"checkpoint.monitor: 'val/index-mean' was not logged \(did you mean 'val/index_mean'\?\)",
    ):
        trainer.fit(module)
    assert module._steps == 2  # 8 batches an epoch: stopped at the first validation, after 2
    trainer, module = _fit(tmp_path / "es", val_check_interval=0.25, early_stopping={"monitor": "val_loss"})
    with pytest.raises(
        unifit.ConfigError, match=r"early_stopping.monitor: 'val_loss' was not logged \(did you mean 'val/loss'\?\)"
    ):
        trainer.fit(module)
    assert module._steps == 2


def test_an_unknown_monitor_is_refused_once_the_epoch_logged_everything(tmp_path):
    """A name unlike any logged one may still come (an epoch-end metric): refused at the epoch's end, with the
    logged names; nothing is refused that a later hook would have logged."""
    trainer, module = _fit(tmp_path, val_check_interval=0.25, checkpoint={"enabled": True, "monitor": "accuracy"})
    with pytest.raises(
        unifit.ConfigError,
        match=r"checkpoint.monitor: 'accuracy' was not logged; logged metrics: .*val/loss.*; set trainer.checkpoint.monitor to one of them",
    ):
        trainer.fit(module)
    assert module._steps == 8
    rows = (
        [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        if (tmp_path / "metrics.jsonl").exists()
        else []
    )
    assert all(row.get("epoch", 0) <= 1 for row in rows)
