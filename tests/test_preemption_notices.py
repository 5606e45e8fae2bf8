"""The notices besides SIGTERM: SIGUSR2 (submitit's, SLURM's --signal=USR2@90) and SIGUSR1 (Lightning's SLURM
requeue) stop a fit with a checkpoint like SIGTERM does; the handler that was there before unifit's (submitit's
requeue) is called once that checkpoint is committed; `unifit launch` passes them on to the ranks that handle
them and to nothing else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import PROBE_YAML, metrics_lines
from unifit.strategies.launchers.notices import catches, descendants, notices_passed_on


def _fit(cli, root, *extra: str, signum: int | None = None):
    callbacks = [{"class_path": "tests.probe.callbacks.SignalAt", "init_args": {"signum": signum}}] if signum else []
    args = ["fit", "-c", str(PROBE_YAML), "--trainer.root_dir", str(root), "--trainer.callbacks", json.dumps(callbacks)]
    return cli(*args, "--trainer.preemption.check_every_n_steps", "1", *extra)


def test_sigusr2_stops_with_a_checkpoint_then_calls_the_handler_it_replaced(cli, tmp_path):
    """As under submitit: its handler (here a stand-in that records) finds the checkpoint committed when it runs,
    the fit then ends with 128 + 12, and --ckpt-path auto continues it to the uninterrupted run's losses."""
    calls = []

    def requeue(signum, frame):  # submitit's checkpoint_and_try_requeue stand-in
        calls.append((signum, json.loads((tmp_path / "run" / "checkpoints" / "last.json").read_text())["name"]))

    previous = signal.signal(signal.SIGUSR2, requeue)
    try:
        stopped = _fit(cli, tmp_path / "run", signum=int(signal.SIGUSR2))
        assert signal.getsignal(signal.SIGUSR2) is requeue  # put back after the fit
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert stopped.returncode == 128 + signal.SIGUSR2, stopped.stderr
    assert "preempted by SIGUSR2 at step 9 (epoch 2, batch 1)" in stopped.stderr, stopped.stderr
    assert calls == [(signal.SIGUSR2, "epoch=0001-step=0000009")], calls
    assert _fit(cli, tmp_path / "run", "--ckpt-path", "auto").returncode == 0
    assert _fit(cli, tmp_path / "whole").returncode == 0
    resumed, whole = metrics_lines(tmp_path / "run"), metrics_lines(tmp_path / "whole")
    assert [m["train/loss"] for m in resumed] == pytest.approx([m["train/loss"] for m in whole], rel=1e-6)


def test_a_signal_left_out_of_preemption_signals_is_not_caught(cli, tmp_path):
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        result = _fit(cli, tmp_path, "--trainer.preemption.signals", "[SIGTERM]", signum=int(signal.SIGUSR1))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert result.returncode == 0 and seen == [signal.SIGUSR1], result.stderr  # the fit ran through
    bad = _fit(cli, tmp_path / "bad", "--trainer.preemption.signals", "[SIGHUP]")
    assert bad.returncode == 2 and "trainer.preemption.signals.0" in bad.stderr, bad.stderr


HANDLES_USR2 = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGUSR2, lambda s, f: (print('got', s, flush=True), sys.exit(0)))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_the_launch_passes_a_notice_to_the_processes_that_handle_it_and_no_other():
    rank = subprocess.Popen([sys.executable, "-c", HANDLES_USR2], stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen(["sleep", "60"])  # default action for SIGUSR2: it would die of it
    try:
        assert rank.stdout.readline() == "ready\n"
        below = descendants(os.getpid())
        assert {rank.pid, bystander.pid} <= set(below)
        assert catches(rank.pid, signal.SIGUSR2) and not catches(bystander.pid, signal.SIGUSR2)
        with notices_passed_on():
            signal.raise_signal(signal.SIGUSR2)  # this process goes on
            assert rank.wait(timeout=30) == 0 and rank.stdout.read() == f"got {int(signal.SIGUSR2)}\n"
        time.sleep(0.2)
        assert bystander.poll() is None  # left alone
    finally:
        for proc in (rank, bystander):
            proc.kill()
            proc.wait()
