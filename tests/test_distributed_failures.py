"""Distributed failures end every process with an error, never a hang."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.helpers import STRATEGY_PROCS, launch_probe

pytestmark = pytest.mark.launch


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp", "horovod"])
def test_nan_on_one_rank_stops_all_ranks_and_keeps_last_good_checkpoint(tmp_path, strategy):
    # 4 steps per epoch per rank; step 6 (2nd batch of epoch 2) is NaN on rank 1 only
    result = launch_probe(
        strategy,
        tmp_path,
        "--module.init_args.nan_at_step",
        "6",
        "--module.init_args.nan_rank",
        "1",
        "--trainer.nan_guard.check_every_n_steps",
        "2",
        timeout=130,
    )
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if "non-finite loss at step 6 on rank 1" in line]
    # both ranks stopped at the same step, for the same reason (horovodrun may stop the second one
    # before it prints: it ends every rank once the first one exits)
    assert len(lines) == 2 or (strategy == "horovod" and len(lines) == 1), result.stderr
    assert "last good checkpoint" in lines[0] and "epoch=0001-step=0000004" in lines[0]
    assert "unifit: launch failed (rank" in result.stderr  # the launcher's one summary line
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["epoch=0001-step=0000004", "last.json"]
    assert json.loads((tmp_path / "checkpoints" / "last.json").read_text())["epoch"] == 1


@pytest.mark.timeout(120)
def test_nan_between_checks_is_caught_before_the_epoch_checkpoint(tmp_path):
    # NaN at step 5 with checks every 10 steps: only the epoch-end check can see it
    result = launch_probe(
        "ddp",
        tmp_path,
        "--module.init_args.nan_at_step",
        "5",
        "--trainer.nan_guard.check_every_n_steps",
        "10",
        timeout=100,
    )
    assert result.returncode == 1, result.stderr
    assert "non-finite train/loss in epoch 2" in result.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch=0001-step=0000004", "last.json"]


@pytest.mark.timeout(120)
def test_metric_logged_on_some_ranks_only_is_an_error_on_every_rank(tmp_path):
    result = launch_probe("ddp", tmp_path, "--module.init_args.log_rank_only", "train/only_rank0", timeout=100)
    assert result.returncode == 1, result.stderr
    lines = [
        line
        for line in result.stderr.splitlines()
        if "metric 'train/only_rank0' was logged on ranks [0] but not on ranks [1]" in line
    ]
    assert len(lines) == 2, result.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp", "horovod"])
def test_save_checkpoint_on_one_rank_fails_instead_of_hanging(tmp_path, strategy):
    result = launch_probe(
        strategy,
        tmp_path,
        "--trainer.checkpoint.enabled",
        "false",
        "--trainer.collective_timeout_s",
        "5",
        "--trainer.callbacks",
        json.dumps([{"class_path": "tests.probe.probe.SaveOnRankZeroOnly"}]),
        timeout=130,
    )
    assert result.returncode == 1, result.stderr
    # ddp: gloo's monitored barrier (own group) names rank 0's barrier every time. horovod: the watchdog
    # ends whichever rank waits too long first; usually rank 0 in the barrier, but Horovod has let rank 0's
    # barrier go on and rank 1's next gradient allreduce time out instead, so only the hint is certain
    if strategy == "ddp":
        assert "barrier 'save_checkpoint' on rank 0 failed" in result.stderr, result.stderr
    stopped = [
        line
        for line in result.stderr.splitlines()
        if "unifit: error" in line and "do not call save_checkpoint inside 'if rank == 0'" in line
    ]
    assert stopped, result.stderr  # a rank stopped with the one-line hint, nothing hung
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.tf
@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ddp", "smddp-like", "fsdp", "horovod", "mwms"])
def test_kill_9_of_one_rank_ends_every_process_and_names_it(tmp_path, strategy):
    """Without restarts, kill -9 of one rank mid-epoch: every process ends non-zero within 60 s and one
    line names the rank that died (the others only see a reset connection or a timed-out collective)."""
    rank = STRATEGY_PROCS[strategy] - 1  # smddp-like: a rank on the second 'node'
    marker = tmp_path / "killed"
    kill = [{"class_path": "tests.probe.probe.KillOnce", "init_args": {"marker": str(marker), "rank": rank}}]
    result = launch_probe(
        strategy, tmp_path / "run", "--trainer.checkpoint.enabled", "false", callbacks=kill, timeout=180
    )
    ended = time.time()
    assert marker.exists(), result.stderr[-3000:]  # the rank really was killed mid-run
    assert result.returncode != 0, result.stderr[-3000:]
    assert ended - marker.stat().st_mtime < 60, result.stderr[-3000:]
    named = [
        line for line in result.stderr.splitlines() if line.startswith(f"unifit: rank {rank} died (killed by SIGKILL)")
    ]
    assert len(named) == 1, result.stderr[-3000:]
    left = subprocess.run(
        ["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True, timeout=30
    ).stdout.split()
    assert not left, f"processes of the job still running: {left}"
