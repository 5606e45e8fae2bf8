"""SLURM jobs through submitit, from Python: `unifit.slurm.submit("exp.yaml", nodes=2, gpus_per_node=4)`.

The command line's `unifit submit` does the same; both live in unifit/cli/submit.py."""

from unifit.cli.submit import TASK_STRATEGIES, ExperimentJob, submit

__all__ = ["TASK_STRATEGIES", "ExperimentJob", "submit"]
