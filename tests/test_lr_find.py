"""trainer.lr_find (Lightning's LearningRateFinder, tests/test_lightning_callbacks.py compares it with Lightning's
sweep on one process) under several ranks: every rank sweeps the same curve (the loss averaged over the ranks),
adopts the same lr and ends with the same weights; the fit then trains from the restored start."""

from __future__ import annotations

import re

import pytest

from tests.helpers import assert_ok, launch_probe, metrics_lines, reports, strategy_params

pytestmark = pytest.mark.launch


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", strategy_params("ddp", "fsdp"))
def test_lr_find_under_several_ranks_agrees_and_trains_on(tmp_path, case):
    result = launch_probe(case, tmp_path, "--trainer.lr_find", "{num_training_steps: 20, max_lr: 0.5}")
    assert_ok(result)
    said = re.findall(r"lr_find: 20 steps from 1e-08 to [0-9.e-]+; suggested lr ([0-9.e-]+) \(was 0.1\)", result.stderr)
    assert len(said) == 1, result.stderr[-3000:]  # rank 0 says it; was: 0.05 x 2 ranks (linear scaling)
    got = reports(tmp_path)
    assert len({r["weights_sha256"] for r in got}) == 1
    lines = metrics_lines(tmp_path)
    assert [m["epoch"] for m in lines] == [1, 2, 3]  # the sweep's steps are not the fit's
    assert lines[0]["lr"] == pytest.approx(float(said[0]), rel=1e-4)
