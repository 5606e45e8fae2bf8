"""Distributed failures end every process with an error, never a hang.

Each test's launch is independent of the others: the module launches all of the selected ones at the first
test, two at a time (a failing launch mostly waits: for a timeout, for its peers to notice), and each test
checks its own."""

from __future__ import annotations

import functools
import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import STRATEGY_PROCS, at_most, launch_probe

# the first test launches every selected one, two at a time; each launch has its own limit (100-180 s)
pytestmark = [pytest.mark.launch, pytest.mark.timeout(1200)]

KILL_STRATEGIES = ["ddp", "smddp-like", "fsdp", "horovod", "mwms"]


def _kill_args(root: Path, strategy: str) -> dict:
    rank = STRATEGY_PROCS[strategy] - 1  # smddp-like: a rank on the second 'node'
    kill = [
        {"class_path": "tests.probe.callbacks.KillOnce", "init_args": {"marker": str(root / "killed"), "rank": rank}}
    ]
    return {"callbacks": kill, "timeout": 180}


# (test function, its strategy parameter or None) -> (strategy, overrides, launch_probe's keywords(root))
LAUNCHES = {
    **{
        ("test_nan_on_one_rank_stops_all_ranks_and_keeps_last_good_checkpoint", s): (
            s,
            ["--module.init_args.nan_at_step", "6", "--module.init_args.nan_rank", "1"]
            + ["--trainer.nan_guard.check_every_n_steps", "2"],
            lambda root: {"timeout": 130},
        )
        for s in ("ddp", "horovod")
    },
    ("test_nan_between_checks_is_caught_before_the_epoch_checkpoint", None): (
        "ddp",
        ["--module.init_args.nan_at_step", "5", "--trainer.nan_guard.check_every_n_steps", "10"],
        lambda root: {"timeout": 100},
    ),
    ("test_metric_logged_on_some_ranks_only_is_an_error_on_every_rank", None): (
        "ddp",
        ["--module.init_args.log_rank_only", "train/only_rank0"],
        lambda root: {"timeout": 100},
    ),
    **{
        ("test_save_checkpoint_on_one_rank_fails_instead_of_hanging", s): (
            s,
            ["--trainer.checkpoint.enabled", "false", "--trainer.collective_timeout_s", "5", "--trainer.callbacks"]
            + [json.dumps([{"class_path": "tests.probe.callbacks.SaveOnRankZeroOnly"}])],
            lambda root: {"timeout": 130},
        )
        for s in ("ddp", "horovod")
    },
    **{
        ("test_kill_9_of_one_rank_ends_every_process_and_names_it", s): (
            s,
            ["--trainer.checkpoint.enabled", "false"],
            functools.partial(_kill_args, strategy=s),
        )
        for s in KILL_STRATEGIES
    },
}


def _launch(strategy: str, root: Path, overrides: list[str], keywords: dict) -> tuple:
    """(the result, when it ended): the run's own directory is `root / "run"`."""
    result = launch_probe(strategy, root / "run", *overrides, **keywords)
    return result, time.time()


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict:
    """(test name, strategy) -> (root, (result, end time) or the launch's exception), for the selected tests."""
    keys = []
    for item in request.session.items:
        if item.path == request.path:
            key = (item.originalname, getattr(item, "callspec", None) and item.callspec.params.get("strategy"))
            if key in LAUNCHES and key not in keys:
                keys.append(key)
    roots = {key: tmp_path_factory.mktemp(key[0][5:30]) for key in keys}
    jobs = [
        functools.partial(_launch, LAUNCHES[k][0], roots[k], LAUNCHES[k][1], LAUNCHES[k][2](roots[k])) for k in keys
    ]
    return {key: (roots[key], got) for key, got in zip(keys, at_most(2, jobs), strict=True)}


def _outcome(launched: dict, test: str, strategy: str | None = None) -> tuple[Path, subprocess.CompletedProcess, float]:
    root, got = launched[(test, strategy)]
    if isinstance(got, BaseException):
        raise got
    return root / "run", *got


@pytest.mark.parametrize("strategy", ["ddp", "horovod"])
def test_nan_on_one_rank_stops_all_ranks_and_keeps_last_good_checkpoint(launched, strategy):
    # 4 steps per epoch per rank; step 6 (2nd batch of epoch 2) is NaN on rank 1 only
    run, result, _ = _outcome(launched, "test_nan_on_one_rank_stops_all_ranks_and_keeps_last_good_checkpoint", strategy)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if "non-finite loss at step 6 on rank 1" in line]
    # both ranks stopped at the same step, for the same reason (horovodrun may stop the second one
    # before it prints: it ends every rank once the first one exits)
    assert len(lines) == 2 or (strategy == "horovod" and len(lines) == 1), result.stderr
    assert "last good checkpoint" in lines[0] and "epoch=0001-step=0000004" in lines[0]
    assert "unifit: launch failed (rank" in result.stderr  # the launcher's one summary line
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["epoch=0001-step=0000004", "last.json"]
    assert json.loads((run / "checkpoints" / "last.json").read_text())["epoch"] == 1


def test_nan_between_checks_is_caught_before_the_epoch_checkpoint(launched):
    # NaN at step 5 with checks every 10 steps: only the epoch-end check can see it
    run, result, _ = _outcome(launched, "test_nan_between_checks_is_caught_before_the_epoch_checkpoint")
    assert result.returncode == 1, result.stderr
    assert "non-finite train/loss in epoch 2" in result.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch=0001-step=0000004", "last.json"]


def test_metric_logged_on_some_ranks_only_is_an_error_on_every_rank(launched):
    _, result, _ = _outcome(launched, "test_metric_logged_on_some_ranks_only_is_an_error_on_every_rank")
    assert result.returncode == 1, result.stderr
    lines = [
        line
        for line in result.stderr.splitlines()
        if "metric 'train/only_rank0' was logged on ranks [0] but not on ranks [1]" in line
    ]
    assert len(lines) == 2, result.stderr


@pytest.mark.parametrize("strategy", ["ddp", "horovod"])
def test_save_checkpoint_on_one_rank_fails_instead_of_hanging(launched, strategy):
    run, result, _ = _outcome(launched, "test_save_checkpoint_on_one_rank_fails_instead_of_hanging", strategy)
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
    assert not (run / "checkpoints").exists()


@pytest.mark.tf
@pytest.mark.parametrize("strategy", KILL_STRATEGIES)
def test_kill_9_of_one_rank_ends_every_process_and_names_it(launched, strategy):
    """Without restarts, kill -9 of one rank mid-epoch: every process ends non-zero within 60 s and one
    line names the rank that died (the others only see a reset connection or a timed-out collective)."""
    run, result, ended = _outcome(launched, "test_kill_9_of_one_rank_ends_every_process_and_names_it", strategy)
    rank, marker = STRATEGY_PROCS[strategy] - 1, run.parent / "killed"
    assert marker.exists(), result.stderr[-3000:]  # the rank really was killed mid-run
    assert result.returncode != 0, result.stderr[-3000:]
    assert ended - marker.stat().st_mtime < 60, result.stderr[-3000:]
    named = [
        line for line in result.stderr.splitlines() if line.startswith(f"unifit: rank {rank} died (killed by SIGKILL)")
    ]
    assert len(named) == 1, result.stderr[-3000:]
    left = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True, timeout=30).stdout.split()
    assert not left, f"processes of the job still running: {left}"
