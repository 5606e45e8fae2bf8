"""`unifit submit` / unifit.slurm.submit: a job through submitit, run here by its LocalExecutor (real task
processes, submitit's own signal handling and requeue). SIGUSR2 to the tasks mid-run, as SLURM sends it before
the time limit: unifit commits a checkpoint at the agreed step, submitit requeues the job, the requeued tasks
continue from that checkpoint and end with the uninterrupted run's weights. Mistakes fail before anything is
queued."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers import metrics_lines, probe_args, reports

submitit = pytest.importorskip("submitit", reason="unifit[slurm] (submitit) is not installed")

from unifit.slurm import submit  # noqa: E402
from unifit.strategies.launchers.notices import catches, descendants  # noqa: E402


def _logs(job) -> str:
    return "\n".join(
        job.task(i).paths.stderr.read_text()[-3000:] for i in range(2) if job.task(i).paths.stderr.exists()
    )


STEPS = ("--trainer.checkpoint.every_n_steps", "2", "--trainer.preemption.check_every_n_steps", "1")


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_job_told_sigusr2_is_requeued_and_ends_as_the_uninterrupted_run(tmp_path, reference_run, clean_environment):
    root = tmp_path / "run"
    slow = [{"class_path": "tests.probe.callbacks.SlowSteps", "init_args": {"seconds": 0.3}}]
    args = probe_args("ddp", root, *STEPS, callbacks=slow)  # launch --nproc-per-node 2 -c YAML OVERRIDES...
    job = submit(args[4], args[5:], tasks_per_node=2, executor="local", folder=str(tmp_path / "submitit"))
    deadline = time.time() + 150
    while not (root / "checkpoints" / "last.json").exists():  # training, past its first step checkpoint
        assert time.time() < deadline and not job.done(), _logs(job)
        time.sleep(0.2)
    tasks = [pid for pid in descendants(job._process.pid) if catches(pid, signal.SIGUSR2)]
    assert len(tasks) == 2, tasks
    for pid in tasks:  # what SLURM's --signal=USR2@90 does: every task of the job
        os.kill(pid, signal.SIGUSR2)
    while not job.done():
        assert time.time() < deadline + 100, _logs(job)
        time.sleep(0.5)
    job.results()  # raises submitit's error (naming the task's log) if the requeued job failed
    log = "\n".join(job.task(i).paths.stderr.read_text() + job.task(i).paths.stdout.read_text() for i in range(2))
    assert "preempted by SIGUSR2" in log and "passing SIGUSR2 on to the handler" in log, log[-3000:]
    assert "Requeued job" in log, log[-3000:]  # submitit's own line: the job ran again
    assert [m["epoch"] for m in metrics_lines(root)] == [1, 2, 3]
    full = reference_run("ddp")
    assert {r["weights_sha256"] for r in reports(root)} == {r["weights_sha256"] for r in reports(full)}


def test_a_mistake_or_a_strategy_that_needs_its_own_launcher_is_refused_before_anything_is_queued(cli, tmp_path):
    folder = tmp_path / "submitit"
    bad = cli("submit", "-c", "examples/digits/torch.yaml", "--trainer.max_epoch", "3", "--folder", str(folder))
    assert bad.returncode == 2 and "trainer.max_epoch" in bad.stderr, bad.stderr
    horovod = cli("submit", "-c", "examples/digits/torch.yaml", "--trainer.strategy", "horovod", "--local")
    assert horovod.returncode == 2 and "horovod under unifit submit" in horovod.stderr, horovod.stderr
    assert not folder.exists()
