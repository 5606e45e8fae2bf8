"""The shipped example trains to the promised accuracy with its default config."""

from __future__ import annotations

import pytest

from tests.helpers import assert_ok, metrics_lines, run_unifit


@pytest.mark.timeout(300)
def test_digits_example_reaches_95_percent_with_two_ddp_processes(tmp_path):
    result = run_unifit(
        "launch",
        "--nproc-per-node",
        "2",
        "-c",
        "examples/digits/torch.yaml",
        "--trainer.root_dir",
        str(tmp_path),
        "--trainer.checkpoint.dir",
        str(tmp_path / "ckpt"),
        "--trainer.tensorboard.log_dir",
        str(tmp_path / "tb"),
        timeout=280,
    )
    assert_ok(result)
    assert "world size 2" in result.stdout and "final metrics" in result.stdout
    last = metrics_lines(tmp_path)[-1]
    assert last["epoch"] == 10
    assert last["val/acc"] >= 0.95, last
    assert last["lr"] == pytest.approx(0.1)  # base 0.05 x 2 replicas
    assert (tmp_path / "config.yaml").is_file() and list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "ckpt" / "best.json").is_file()
