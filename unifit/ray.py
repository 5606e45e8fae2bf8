"""Run an experiment in Ray Train: Ray starts the workers, unifit trains in each.

    result = unifit.ray.fit("exp.yaml", ["--trainer.max_epochs", "20"], num_workers=4, use_gpu=True,
                            storage_path="s3://bucket/runs", max_failures=2)

or, with a TorchTrainer of your own, `TorchTrainer(unifit.ray.train_loop_per_worker, train_loop_config=
unifit.ray.loop_config("exp.yaml", [...], storage_path=..., name=...), ...)`.

Each worker runs `unifit fit` in its process with Ray's ranks and Ray's process group (made by Ray, used as is:
unifit makes none and starts no process). The run directory (checkpoints, logs, metrics) is Ray's run directory,
`<storage_path>/<name>`; every checkpoint unifit commits is reported to Ray with the epoch's metrics
(unifit/callbacks/ray_report.py), and a worker group Ray restarts (FailureConfig) or re-forms continues from the
newest checkpoint committed there (`--ckpt-path auto`; another world size under the rules a resume has anywhere).
The same call with the same name continues a stopped run.
The strategies that run one process per worker are Ray's: single, ddp, smddp-like, fsdp, model-parallel on Ray's
TorchTrainer, and Keras' mwms on its TensorflowTrainer (each worker's TF_CONFIG is Ray's).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unifit.cli.main import load_experiment, parse_overrides, run
from unifit.cli.submit import TASK_STRATEGIES
from unifit.errors import ConfigError, UnifitError
from unifit.strategies.environment import RAY_TRAIN_MARKER

__all__ = ["fit", "loop_config", "train_loop_per_worker"]

# one process per worker, a world Ray's trainer makes: torch's process group (TorchTrainer) or TF_CONFIG for
# Keras' mwms (TensorflowTrainer)
RAY_STRATEGIES = (*TASK_STRATEGIES, "mwms")


def fit(
    config: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    num_workers: int | tuple[int, int] = 1,
    use_gpu: bool = False,
    storage_path: str | None = None,
    name: str | None = None,
    max_failures: int = 0,
    scaling_config: Any = None,
) -> Any:
    """Check the experiment, then train it on `num_workers` Ray Train workers (`(min, max)`: elastic, Ray re-forms
    the group as workers come and go); Ray's Result (its metrics: rank 0's last report; `checkpoint`: the newest
    unifit checkpoint). `scaling_config`: a ray.train.ScalingConfig of your own instead of num_workers and use_gpu
    (resources per worker, accelerator type, ...). Needs a Ray cluster (`ray.init()` is called when none is
    connected, as Ray does)."""
    try:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
    except ImportError:
        raise ConfigError("unifit.ray needs Ray Train, which is not installed; pip install 'unifit[ray]'") from None
    if max_failures < -1:
        raise ConfigError(f"max_failures={max_failures}: give 0 or more restarts (-1: without end)")
    if scaling_config is None:
        _check_workers(num_workers)
        scaling_config = ScalingConfig(num_workers=num_workers, use_gpu=use_gpu)  # type: ignore[arg-type]  # v2: (min, max)
    settings = loop_config(config, overrides, storage_path=storage_path, name=name)
    trainer = _ray_trainer(settings["backend"])(
        train_loop_per_worker,
        train_loop_config=settings,
        scaling_config=scaling_config,
        run_config=RunConfig(
            name=settings["name"],
            storage_path=settings["storage_path"],
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def _check_workers(num_workers: int | tuple[int, int]) -> None:
    low, high = (num_workers, num_workers) if isinstance(num_workers, int) else tuple(num_workers)
    if not 1 <= low <= high:
        raise ConfigError(
            f"num_workers={num_workers!r}: give 1 or more workers, or (min, max) with 1 <= min <= max (elastic)"
        )


def _ray_trainer(backend: str) -> Any:
    """Ray's trainer for the workers' backend: TorchTrainer makes torch's process group, TensorflowTrainer sets
    each worker's TF_CONFIG (MultiWorkerMirroredStrategy's cluster)."""
    if backend == "tensorflow":
        from ray.train.tensorflow import TensorflowTrainer

        return TensorflowTrainer
    from ray.train.torch import TorchTrainer

    return TorchTrainer


def loop_config(
    config: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    storage_path: str | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """The experiment checked here, in one line on a mistake, before any worker starts; what each worker needs."""
    experiment = load_experiment(str(config), parse_overrides(list(overrides)))
    strategy = experiment.trainer.strategy
    if strategy not in RAY_STRATEGIES:
        raise ConfigError(
            f"trainer.strategy: {strategy} under Ray Train: its processes need their own launcher (horovodrun, "
            f"parameter servers); run one of {', '.join(RAY_STRATEGIES)}, or `unifit launch` outside Ray"
        )
    storage = storage_path or os.path.expanduser("~/ray_results")
    storage = storage if "://" in storage else os.path.abspath(storage)
    name = name or time.strftime("unifit-%Y%m%d-%H%M%S")
    return {
        "config": os.path.abspath(config),
        "overrides": list(overrides),
        "storage_path": storage,
        "name": name,
        "root_dir": f"{storage.rstrip('/')}/{name}",
        "cwd": os.getcwd(),
        "backend": "tensorflow" if strategy == "mwms" else "torch",  # which of Ray's trainers starts the workers
    }


def train_loop_per_worker(settings: dict[str, Any]) -> None:
    """One Ray Train worker's fit (Ray's `train_loop_per_worker`); an error ends it with the fit's one line."""
    os.environ[RAY_TRAIN_MARKER] = "1"  # the environment reader takes Ray's ranks and process group
    if Path(settings["cwd"]).is_dir():  # the driver's directory, where the experiment's relative paths point
        os.chdir(settings["cwd"])
    # always the newest checkpoint committed in this run's directory: none in a new run; after Ray restarts or
    # re-forms the group, the one the last group committed (newer than the last Ray registered, which it polls
    # every 2 s: a report just before a failure may not be registered)
    argv = ["fit", "-c", settings["config"], *settings["overrides"], "--trainer.root_dir", settings["root_dir"]]
    argv += ["--ckpt-path", "auto"]
    code = run(argv)
    if code != 0:
        rank = os.environ.get("RANK", "?")
        raise UnifitError(f"unifit fit on Ray Train worker {rank} ended with exit code {code}; its error is above")
