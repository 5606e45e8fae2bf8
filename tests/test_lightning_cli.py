"""A LightningCLI config file, as LightningCLI itself writes it (`--print_config`), runs with `unifit fit -c`:
the same weights as LightningCLI's own fit of that file; `devices: 2` under `unifit launch` trains on 2 ddp ranks;
what unifit cannot honour is one line naming every problem of the file, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, assert_ok, run_unifit

CLI_MAIN = REPO / "tests" / "probe" / "lightning_cli_main.py"


def _lightning_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(CLI_MAIN), *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture(scope="module")
def cli_file(tmp_path_factory):
    """The config LightningCLI prints for Lightning users' flags: a module by class path, a callback of the user's,
    Lightning's EarlyStopping, 3 epochs, seeded; then LightningCLI's own fit of that file (the reference)."""
    root = tmp_path_factory.mktemp("lightning-cli")
    printed = _lightning_cli(
        "fit",
        "--model", "tests.probe.lightning_probe.Regressor",
        "--seed_everything", "0",
        "--trainer.max_epochs", "3",
        "--trainer.accelerator", "cpu",
        "--trainer.default_root_dir", str(root / "lightning"),
        "--trainer.callbacks+=tests.probe.lightning_cli_main.SaveWeights",
        "--trainer.callbacks.path", str(root / "lightning.pt"),
        "--trainer.callbacks+=EarlyStopping",
        "--trainer.callbacks.monitor", "val_mse",
        "--print_config",
        cwd=root,
    )  # fmt: skip
    assert_ok(printed)
    config = root / "config.yaml"
    config.write_text(printed.stdout)
    assert "seed_everything: 0" in printed.stdout and "enable_checkpointing: null" in printed.stdout  # Lightning's
    assert_ok(_lightning_cli("fit", "--config", str(config), cwd=root))
    return config


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_lightning_cli_file_trains_as_lightningcli_trains_it(cli_file, tmp_path):
    csv = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path), "prefix": "lit"},
    }
    result = run_unifit(
        "fit", "-c", str(cli_file),
        "--trainer.default_root_dir", str(tmp_path / "unifit"),
        "--trainer.callbacks.0.init_args.path", str(tmp_path / "unifit.pt"),
        "--trainer.logger", json.dumps(csv),  # `prefix`: unifit's csv has none, so Lightning's own logger runs
    )  # fmt: skip
    assert_ok(result)
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "lit-train/loss" in header.split(","), header
    theirs, ours = torch.load(cli_file.parent / "lightning.pt"), torch.load(tmp_path / "unifit.pt")
    assert theirs.keys() == ours.keys()
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    assert (tmp_path / "unifit" / "checkpoints" / "last.json").exists()  # enable_checkpointing: null is on
    assert "strategy single, world size 1" in result.stdout + result.stderr


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_devices_under_unifit_launch_are_the_ranks(cli_file, tmp_path, cli):
    wrong = cli("fit", "-c", str(cli_file), "--trainer.devices", "2")
    assert wrong.returncode == 2 and "start it with unifit launch --nproc-per-node 2 --nnodes 1" in wrong.stderr
    result = run_unifit(
        "launch", "--nproc-per-node", "2", "-c", str(cli_file),
        "--trainer.devices", "2",
        "--trainer.default_root_dir", str(tmp_path / "ddp"),
        "--trainer.callbacks.0.init_args.path", str(tmp_path / "ddp.pt"),
        timeout=240,
    )  # fmt: skip
    assert_ok(result)
    assert "strategy ddp, world size 2" in result.stdout + result.stderr  # Lightning's strategy: auto, 2 processes
    assert (tmp_path / "ddp.pt").exists()


@pytest.mark.timeout(120)
def test_every_problem_of_a_lightning_cli_file_in_one_line(tmp_path, cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "seed_everything: true\n"
        "trainer:\n"
        "  precision: bf16-true\n"
        "  min_epochs: 3\n"
        "  bogus: 1\n"
        "  strategy: deepspeed_stage_2\n"
        "  max_steps: -1\n"  # Lightning's default: fine
        "model: {lr: 0.1}\n"
        "optimizer: {class_path: torch.optim.Adam}\n"
    )
    result = cli("fit", "-c", str(bad))
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()
    assert len(message) == 1, result.stderr
    for problem in (
        "model: has no class_path",
        "optimizer: LightningCLI's auto-configured optimizer",
        "trainer.precision: received 'bf16-true'",
        "trainer.min_epochs: received 3",
        "trainer.bogus: not a Lightning Trainer argument",
        "trainer.strategy: received 'deepspeed_stage_2'",
        "seed_everything: true draws a random seed",
    ):
        assert problem in message[0], problem
    assert "max_steps" not in message[0]


@pytest.mark.timeout(120)
def test_lightnings_names_in_a_unifit_file_point_at_unifits(tmp_path, cli):
    bad = tmp_path / "exp.yaml"
    bad.write_text(
        "module: {class_path: tests.probe.lightning_probe.Regressor}\n"
        "trainer: {log_every_n_steps: 5, check_val_every_n_epoch: 2, max_epochs: 0}\n"
    )
    result = cli("fit", "-c", str(bad))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "unifit's is tensorboard.log_every_n_steps" in result.stderr
    assert "unifit's is validate_every_n_epochs" in result.stderr
    assert "'trainer.max_epochs' received 0" in result.stderr  # all three at once


@pytest.mark.timeout(120)
def test_model_parallel_strategy_of_a_lightning_cli_file_maps_to_model_parallel(tmp_path, cli):
    """Lightning's ModelParallelStrategy(tensor_parallel_size=2, data_parallel_size=2) -> model-parallel's options;
    its 'auto' sizes (Lightning: tensor parallel over a node's devices) stay auto (the two-host test runs it)."""
    strategy = "{class_path: lightning.pytorch.strategies.ModelParallelStrategy, init_args: {%s}}"
    path = tmp_path / "mp.yaml"
    path.write_text(
        "model: {class_path: tests.probe.tiny_gpt_lightning.LightningTP}\n"
        f"trainer: {{max_epochs: 1, strategy: {strategy % 'tensor_parallel_size: 2, data_parallel_size: 2'}}}\n"
    )
    result = cli("print-config", "-c", str(path))
    assert_ok(result)
    assert "strategy: model-parallel" in result.stdout, result.stdout
    assert "tensor_parallel: 2" in result.stdout and "data_parallel: 2" in result.stdout, result.stdout
    path.write_text(
        f"model: {{class_path: tests.probe.tiny_gpt_lightning.LightningTP}}\ntrainer: {{strategy: {strategy % ''}}}\n"
    )
    result = cli("print-config", "-c", str(path))
    assert_ok(result)
    assert "tensor_parallel: auto" in result.stdout and "data_parallel: auto" in result.stdout, result.stdout
    # Lightning's FSDPStrategy(activation_checkpointing_policy={Block}): fsdp, those blocks checkpointed in full
    fsdp = "{class_path: lightning.pytorch.strategies.FSDPStrategy, init_args: {%s}}"
    policy = "activation_checkpointing_policy: [tests.probe.tiny_gpt.Block]"
    path.write_text(
        f"model: {{class_path: tests.probe.tiny_gpt_lightning.LightningTP}}\ntrainer: {{strategy: {fsdp % policy}}}\n"
    )
    result = cli("print-config", "-c", str(path))
    assert_ok(result)
    assert "strategy: fsdp" in result.stdout, result.stdout
    assert (
        "activation_checkpointing:\n    mode: full\n    every_n_blocks: 1\n    blocks:\n    - Block" in result.stdout
    ), result.stdout
