"""Long jobs survive: step checkpoints, exact mid-epoch resume, preemption by signal, restarts.

The probe trains 3 epochs. A preempted run gets SIGTERM on one rank in the middle of epoch 2, every
rank stops at that step with a checkpoint and exit code 143; `--ckpt-path auto` then continues it and
the result equals the uninterrupted run: the same loss curve and bit-identical weights (dropout on,
so every rank's RNG, the data position and the partial epoch's metric sums must all be restored)."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    assert_ok,
    at_most,
    launch_probe,
    metrics_lines,
    probe_args,
    reports,
    run_unifit,
    selected_params,
    start_unifit,
    stop,
    strategy_params,
)

STEPS = (
    "--trainer.checkpoint.every_n_steps",
    "2",
    "--trainer.checkpoint.keep_last_n",
    "null",
    "--trainer.preemption.check_every_n_steps",
    "1",
)


def _signal_at(rank: int) -> list[dict]:
    return [{"class_path": "tests.probe.callbacks.SignalAt", "init_args": {"rank": rank, "batch": 1}}]


def _assert_same_run(a: Path, b: Path) -> None:
    full, resumed = metrics_lines(a), metrics_lines(b)
    assert [m["epoch"] for m in resumed] == [m["epoch"] for m in full] == [1, 2, 3]
    for key in ("train/loss", "val/loss", "lr"):
        assert [m[key] for m in resumed] == pytest.approx([m[key] for m in full], rel=1e-6, abs=1e-9), key
    assert {r["weights_sha256"] for r in reports(b)} == {r["weights_sha256"] for r in reports(a)}
    assert len({r["weights_sha256"] for r in reports(b)}) == 1


def _preempt_and_resume(case, root: Path) -> tuple:
    """A run SIGTERMed mid-epoch 2 (on rank 1, where there is one), then resumed with --ckpt-path auto."""
    signalled_rank = 0 if case.nproc == 1 else 1  # single, mirrored: their one process
    stopped = launch_probe(case, root, *STEPS, callbacks=_signal_at(signalled_rank))
    last = root / "checkpoints" / "last.json"  # read now: the resumed run moves it on
    last_name = json.loads(last.read_text())["name"] if last.exists() else None
    progress = _saved_progress(root / "checkpoints" / last_name) if last_name else None
    return stopped, last_name, progress, launch_probe(case, root, *STEPS, ckpt="auto")


@pytest.fixture(scope="module")
def preempted(request, tmp_path_factory, reference_run) -> dict:
    """Row id -> (root, what _preempt_and_resume returned, or its exception), for every selected row, two rows at
    a time; their uninterrupted reference runs made first."""
    cases = selected_params(request, "case", "test_preempted_mid_epoch_resumes_exactly")
    reference_run.prefetch(cases)
    roots = [tmp_path_factory.mktemp(f"preempted-{c.id}") / "part" for c in cases]
    jobs = [functools.partial(_preempt_and_resume, c, root) for c, root in zip(cases, roots, strict=True)]
    return {c.id: (root, got) for c, root, got in zip(cases, roots, at_most(2, jobs), strict=True)}


@pytest.mark.launch
@pytest.mark.timeout(1200)  # the first runs every selected row's launches, two rows at a time
@pytest.mark.parametrize("case", strategy_params())
def test_preempted_mid_epoch_resumes_exactly(case, preempted, reference_run):
    part, outcome = preempted[case.id]
    if isinstance(outcome, BaseException):
        raise outcome
    stopped, last, progress, resumed = outcome
    full = reference_run(case)  # uninterrupted, without step checkpoints
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    said = [line for line in stopped.stderr.splitlines() if "preempted by SIGTERM" in line]
    assert len(said) >= 1, stopped.stderr[-3000:]
    named = {line.split("checkpoint ", 1)[1].split(" is committed")[0] for line in said if " is committed" in line}
    assert {path.rstrip("/").rsplit("/", 1)[-1] for path in named} == {last}, said  # every rank names the one saved
    assert progress["epoch"] == 1 and progress["batch_in_epoch"] == 1, progress  # mid-epoch 2, where it was stopped

    assert_ok(resumed)
    assert "batch 1 of epoch 2" in resumed.stderr
    _assert_same_run(full, part)


def _saved_progress(checkpoint: Path) -> dict:
    if (checkpoint / "state.pt").exists():
        return torch.load(checkpoint / "state.pt", weights_only=True)["trainer"]["progress"]
    return json.loads((checkpoint / "state.json").read_text())["trainer"]["progress"]  # Keras


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_sigterm_to_launch_is_forwarded_and_the_job_continues(tmp_path):
    slow = [{"class_path": "tests.probe.callbacks.SlowSteps", "init_args": {"seconds": 1.0}}]  # 4 batches per epoch
    run = tmp_path / "run"
    proc = start_unifit(*probe_args("ddp", run, *STEPS, "--trainer.max_epochs", "3", callbacks=slow))
    try:
        deadline = time.time() + 120
        while not (run / "checkpoints" / "last.json").exists():  # the first step checkpoint (step 2 of 12)
            assert time.time() < deadline and proc.poll() is None, "no checkpoint appeared"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # to `unifit launch` only, as a scheduler would
        started = time.time()
        out, err = stop(proc, timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    assert time.time() - started < 20, err[-2000:]  # the next step boundary, not torchrun's 30 s grace
    assert err.count("preempted by SIGTERM") >= 1, err[-3000:]
    name = json.loads((run / "checkpoints" / "last.json").read_text())["name"]
    assert int(name.rsplit("=", 1)[1]) < 12, name  # stopped before the end, with a checkpoint of that step
    assert_ok(launch_probe("ddp", run, *STEPS, "--trainer.max_epochs", "3", ckpt="auto"))
    assert [m["epoch"] for m in metrics_lines(run)] == [1, 2, 3]


@pytest.mark.launch
@pytest.mark.timeout(420)
def test_max_restarts_continue_after_kill_9_of_one_rank(tmp_path, reference_run):
    full, part = reference_run("ddp"), tmp_path / "part"
    kill = [{"class_path": "tests.probe.callbacks.KillOnce", "init_args": {"marker": str(tmp_path / "killed")}}]
    result = run_unifit(*probe_args("ddp", part, *STEPS, callbacks=kill), "--max-restarts", "1", timeout=300)
    assert_ok(result)
    assert (tmp_path / "killed").exists()  # rank 1 really died once
    assert "resumed from" in result.stderr  # the restarted ranks continued from the last committed step
    _assert_same_run(full, part)


def test_every_n_minutes_saves_mid_epoch(tmp_path):
    import unifit
    from tests.probe.probe import ProbeModule

    unifit.Trainer(
        max_epochs=3,
        batch_size=2,
        root_dir=str(tmp_path),
        progress_bar=False,
        checkpoint={"every_n_minutes": 1e-6, "keep_last_n": None},
    ).fit(ProbeModule())
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("epoch="))
    steps = sorted(int(n.rsplit("=", 1)[1]) for n in names)
    # 32 steps per epoch, agreed every 10 steps: saves at 10, 20, 30, 40, ... and at the three epoch ends
    assert [s for s in steps if s % 32] == [10, 20, 30, 40, 50, 60, 70, 80, 90], steps


@pytest.mark.tf
@pytest.mark.parametrize("case", strategy_params("horovod", "mwms"))
def test_max_restarts_refused_where_no_launcher_restarts(tmp_path, cli, case):
    result = cli(*probe_args(case, tmp_path), "--max-restarts", "2")
    assert result.returncode == 2, result.stderr
    # unifit's lines (checking the Keras experiment imports TensorFlow, whose C++ start-up lines come before
    # absl is initialised and follow no TF_CPP_MIN_LOG_LEVEL in TensorFlow 2.21)
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("unifit")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "--max-restarts 2" in lines[0] and "--ckpt-path auto" in lines[0], result.stderr


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_mid_epoch_checkpoint_refuses_another_world_size(tmp_path):
    run = tmp_path / "run"
    stopped = launch_probe("ddp", run, *STEPS, callbacks=_signal_at(1))
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    result = launch_probe("single", run, *STEPS, ckpt="auto")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "saved mid-epoch by 2 ranks" in result.stderr and "same world size" in result.stderr
