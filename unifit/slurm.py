"""SLURM jobs through submitit, from Python; `unifit submit` is the same from the command line (both described in
unifit/cli/submit.py).

    job = unifit.slurm.submit("exp.yaml", ["--trainer.max_epochs", "20"], nodes=2, gpus_per_node=4, partition="gpu")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from unifit.cli.main import load_experiment, parse_overrides, run
from unifit.cli.submit import TASK_STRATEGIES, ExperimentJob, queue

__all__ = ["TASK_STRATEGIES", "ExperimentJob", "submit"]


def submit(config: str, overrides: Sequence[str] = (), **options: Any) -> Any:
    """Check the experiment `config` with `overrides` (dotted flags, as on the command line), then queue it; the
    submitit Job. `options`: nodes, gpus_per_node, tasks_per_node, partition, time_min, folder, executor
    ("auto", "slurm", "local"), signal_delay_s, slurm_parameters (see unifit.cli.submit.queue)."""
    experiment = load_experiment(config, parse_overrides(list(overrides)))  # a mistake fails now, in one line
    return queue(config, overrides, experiment, run, **options)
