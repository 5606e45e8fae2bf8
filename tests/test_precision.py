"""Mixed precision on CPU (torch autocast + GradScaler): identical replicas, close to full precision,
exact resume, under real launchers. The GPU variants are in tests/gpu."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import assert_ok, launch_probe, metrics_lines, reports

pytestmark = pytest.mark.launch

# bf16-mixed where gradients are averaged differently (the Keras strategies are in test_precision_keras.py);
# 16-mixed: in DDP's backward hooks, or in Horovod's optimizer.synchronize(). single and smddp-like in
# bf16-mixed are in tests/test_zoo.py (single equals Lightning's Trainer bit for bit; smddp-like ddp's weights)
CASES = [("ddp", "bf16-mixed"), ("horovod", "bf16-mixed"), ("ddp", "16-mixed"), ("horovod", "16-mixed")]
# clipping and accumulation make the scaler's unscale/skip path and DDP's no_sync part of every case
STEP_OPTIONS = (
    "--trainer.gradient_clip_val",
    "0.5",
    "--trainer.accumulate_grad_batches",
    "2",
    "--module.init_args.dropout",
    "0.0",
)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy, precision", CASES)
def test_mixed_precision_replicas_agree_track_full_precision_and_resume_exactly(tmp_path, strategy, precision):
    full, mixed, part = tmp_path / "full", tmp_path / "mixed", tmp_path / "part"
    assert_ok(
        launch_probe(strategy, mixed, *STEP_OPTIONS, "--trainer.precision", precision, "--trainer.max_epochs", "4")
    )
    got = reports(mixed)
    assert len({r["weights_sha256"] for r in got}) == 1  # every rank holds the same weights
    assert all(r["metrics"] == got[0]["metrics"] for r in got)
    low = metrics_lines(mixed)
    if precision == "bf16-mixed":  # 8 bits of mantissa: the curve follows full precision loosely
        assert_ok(launch_probe(strategy, full, *STEP_OPTIONS, "--trainer.max_epochs", "4"))
        ref = metrics_lines(full)
        assert [m["train/loss"] for m in low] != [m["train/loss"] for m in ref]  # autocast really ran
        assert [m["val/loss"] for m in low] == pytest.approx([m["val/loss"] for m in ref], rel=0.15, abs=0.05)
    else:  # the GradScaler starts at 2**16 and skips the overflowing first steps, so float16 lags, but learns
        assert low[-1]["val/loss"] < low[0]["val/loss"] / 2
        name = json.loads((mixed / "checkpoints" / "last.json").read_text())["name"]
        state = torch.load(mixed / "checkpoints" / name / "state.pt", weights_only=True)
        assert 0 < state["engine"]["precision"]["scaler"]["scale"] < 2.0**16  # the scaler ran and backed off

    assert_ok(
        launch_probe(strategy, part, *STEP_OPTIONS, "--trainer.precision", precision, "--trainer.max_epochs", "2")
    )
    assert_ok(
        launch_probe(
            strategy, part, *STEP_OPTIONS, "--trainer.precision", precision, "--trainer.max_epochs", "4", ckpt="last"
        )
    )
    resumed = metrics_lines(part)
    assert [m["epoch"] for m in resumed] == [1, 2, 3, 4]
    assert [m["train/loss"] for m in resumed] == pytest.approx([m["train/loss"] for m in low], rel=1e-9)
    assert reports(part)[0]["weights_sha256"] == got[0]["weights_sha256"]
