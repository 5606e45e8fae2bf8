"""Submit an experiment to SLURM through submitit, from Python or the command line.

    unifit submit -c exp.yaml --nodes 2 --gpus-per-node 4 [--partition gpu] [--time-min 240] [overrides]
    unifit.slurm.submit("exp.yaml", ["--trainer.max_epochs", "20"], nodes=2, gpus_per_node=4)   (unifit/slurm.py)

One task per GPU (submitit's srun), each running `unifit fit -c exp.yaml ... --ckpt-path auto` inside submitit's
task process, with torch's rank variables from submitit's TorchDistributedEnvironment. submitit asks SLURM for
SIGUSR2 before the time limit (`--signal=USR2@90`) and requeues the job on it: unifit's preemption takes the
signal first on every rank, commits one checkpoint at the step the ranks agree on, then hands the signal to
submitit, which requeues the job; the requeued job continues from that checkpoint. `executor="local"` (`--local`)
runs the tasks as processes of this machine (submitit's LocalExecutor), for a try without SLURM.

The experiment is loaded and checked here, before anything is queued.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from unifit.errors import ConfigError

# strategies whose ranks are one process per GPU that rendezvous by torch's variables (what submitit's tasks are);
# horovod, mwms and the parameter servers need their own launcher (horovodrun, TF_CONFIG)
TASK_STRATEGIES = ("single", "ddp", "smddp-like", "fsdp", "model-parallel")


def _submitit() -> Any:
    try:
        import submitit
    except ImportError:
        raise ConfigError(
            "unifit submit needs submitit, which is not installed; pip install 'unifit[slurm]' (or submitit)"
        ) from None
    return submitit


class ExperimentJob:
    """What each task runs: `unifit fit ARGV` in submitit's process. Checkpointable (submitit's protocol): on
    SIGUSR2 submitit calls checkpoint() and requeues the job with the same command, whose --ckpt-path auto
    continues from the checkpoint unifit committed."""

    def __init__(self, argv: list[str], runner: Callable[[list[str]], int]) -> None:
        self.argv, self.runner = argv, runner  # runner: unifit.cli.main.run (pickled by its name)

    def __call__(self) -> int:
        submitit = _submitit()
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        code = self.runner(self.argv)  # rank 0, preempted, leaves inside: submitit's requeue exits the process
        if code in NOTICE_CODES:
            _await_requeue(submitit.JobEnvironment(), code)
        if code:
            raise RuntimeError(f"unifit {' '.join(self.argv)} ended with exit code {code} (its log says why)")
        return code

    def checkpoint(self) -> Any:
        return _submitit().helpers.DelayedSubmission(ExperimentJob(self.argv, self.runner))


NOTICE_CODES = (128 + signal.SIGUSR1, 128 + signal.SIGUSR2)  # a rank stopped by a preemption notice
REQUEUE_GRACE_S = 60.0


def _await_requeue(env: Any, code: int) -> None:
    """A task other than rank 0 stopped by the notice: rank 0's submitit handler is having the job requeued,
    which ends every task. This one leaves no result behind (one written now would read as the job's outcome);
    on SLURM it first waits for the requeue to end it, so that its own exit cannot end the job step before rank 0
    has asked for the requeue. The local executor waits for every task to exit before it starts the job again."""
    if env.cluster != "local":
        time.sleep(REQUEUE_GRACE_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def queue(
    config: str,
    overrides: Sequence[str],
    experiment: Any,
    runner: Callable[[list[str]], int],
    *,
    nodes: int = 1,
    gpus_per_node: int = 0,
    tasks_per_node: int | None = None,
    partition: str | None = None,
    time_min: int = 60,
    folder: str = "submitit",
    executor: str = "auto",
    signal_delay_s: int = 90,
    slurm_parameters: dict[str, Any] | None = None,
) -> Any:
    """Queue `unifit fit -c config OVERRIDES --ckpt-path auto` (`experiment`: that file, loaded and checked) on
    `nodes` x one task per GPU (or `tasks_per_node`); the submitit Job. `executor`: "auto" (SLURM where sbatch is
    found, else local), "slurm" or "local"; `slurm_parameters`: more of submitit's slurm_* settings (e.g.
    {"slurm_account": "ml"})."""
    strategy = experiment.trainer.strategy
    if strategy not in TASK_STRATEGIES:
        raise ConfigError(
            f"trainer.strategy: {strategy} under unifit submit: its processes need their own launcher "
            f"(horovodrun, TF_CONFIG); submit one of {', '.join(TASK_STRATEGIES)}, or run "
            "`srun unifit launch` in a batch script (docs/clusters.md)"
        )
    tasks = tasks_per_node or max(1, gpus_per_node)
    if nodes < 1 or tasks < 1 or gpus_per_node < 0:
        raise ConfigError(
            f"--nodes {nodes} --tasks-per-node {tasks} --gpus-per-node {gpus_per_node}: give 1 or more nodes and "
            "tasks, 0 or more GPUs"
        )
    submitit = _submitit()
    cluster = None if executor == "auto" else executor
    executor_ = submitit.AutoExecutor(folder=folder, cluster=cluster)
    parameters: dict[str, Any] = {"nodes": nodes, "tasks_per_node": tasks, "timeout_min": time_min, "name": "unifit"}
    if gpus_per_node:
        parameters["gpus_per_node"] = gpus_per_node
    if executor_.cluster == "slurm":
        parameters.update(slurm_signal_delay_s=signal_delay_s, slurm_partition=partition, **(slurm_parameters or {}))
    executor_.update_parameters(**{k: v for k, v in parameters.items() if v is not None})
    argv = ["fit", "-c", os.path.abspath(config), *overrides, "--ckpt-path", "auto"]
    return executor_.submit(ExperimentJob(argv, runner))


def main_submit(args: Any, overrides: list[str], experiment: Any, runner: Callable[[list[str]], int]) -> int:
    """`unifit submit`: queue the job, say where its logs go; with --wait, wait for it and return its outcome."""
    job = queue(
        args.config,
        overrides,
        experiment,
        runner,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        partition=args.partition,
        time_min=args.time_min,
        folder=args.folder,
        executor="local" if args.local else "auto",
    )
    print(f"unifit submit: job {job.job_id} queued; its logs: {job.paths.folder}", file=sys.stderr)
    if not args.wait:
        return 0
    job.results()  # a failed task raises submitit's error, which names its log
    return 0
