"""Lightning callbacks given to unifit (`trainer.callbacks`, a LightningModule's `configure_callbacks()`).

Each is taken one of three ways (callbacks/foreign.py decides at set-up, all problems reported at once):
- run as it is, its hooks called where Lightning's Trainer calls them (a user's own `lightning.Callback`,
  `LambdaCallback`, `ModelSummary`...): with a LightningModule;
- mapped onto what unifit does itself, with the same behaviour (docs/lightning.md#callbacks):
  `ModelCheckpoint` -> trainer.checkpoint, `EarlyStopping` -> trainer.early_stopping, `Timer` ->
  trainer.max_time, `GradientAccumulationScheduler` -> accumulate_grad_batches / accumulation_schedule, the progress
  bars -> trainer.progress_bar, `LearningRateMonitor` / `ThroughputMonitor` -> the lr and throughput unifit
  logs, `DeviceStatsMonitor` -> trainer.device_stats, `LearningRateFinder` -> trainer.lr_find, `BatchSizeFinder` -> trainer.batch_size_find. The user's ModelCheckpoint / EarlyStopping objects are kept up to date (`best_model_path`,
  `best_model_score`, `stopped_epoch`...), as Lightning's would be;
- refused in one line that says why and what to do (`REFUSED`).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Callable

from unifit._imports import LIGHTNING, derives_from
from unifit.errors import ConfigError
from unifit.frameworks.torch.lightning_compat import lr_finder_result, made_with

log = logging.getLogger("unifit")

# Lightning callbacks unifit refuses, and why (each is a feature Lightning has that unifit does not offer yet, or
# cannot honour under its strategies)
REFUSED: dict[str, str] = {}
_PROGRESS_BARS = ("ProgressBar", "TQDMProgressBar", "RichProgressBar")
_LOGGED_ALREADY = {
    "LearningRateMonitor": "unifit logs each param group's lr every epoch (lr, lr/group1, ...) and every "
    "tensorboard.log_every_n_steps steps (lr_step)",
    "ThroughputMonitor": "unifit logs throughput/samples_per_s every epoch",
}


# ---- the mapped callbacks --------------------------------------------------------------------------
def _model_checkpoint(cb: Any, plan: Any) -> dict[str, Any]:
    k, monitor = int(cb.save_top_k), cb.monitor
    every = made_with(cb, ("every_n_epochs", "every_n_train_steps", "train_time_interval"))
    if k == 0 and not cb.save_last:
        return {"checkpoint": {"enabled": False}}
    updates: dict[str, Any] = {
        "checkpoint": {
            "enabled": True,
            "monitor": monitor,
            "mode": cb.mode,
            "keep_last_n": None if k == -1 else 1,  # the newest is always kept: resume and preemption start there
            "keep_best_k": max(k, 1) if monitor else 1,
            "every_n_epochs": max(1, int(every["every_n_epochs"] or 1)),
            "every_n_steps": int(every["every_n_train_steps"]) or None,
            "every_n_minutes": _minutes(every["train_time_interval"]),
        }
    }
    if getattr(cb, "save_on_exception", False):
        updates["checkpoint"]["save_on_exception"] = True
    if cb.dirpath is not None:
        updates["checkpoint"]["dir"] = str(cb.dirpath)
    if getattr(cb, "filename", None):
        log.info("ModelCheckpoint(filename=%r): unifit names checkpoints epoch=E-step=S", cb.filename)
    updates["checkpoint"] = {key: value for key, value in updates["checkpoint"].items() if value is not None}
    plan.reports["checkpoint"] = lambda **facts: _mirror_checkpoint(cb, **facts)
    return updates


def _on_exception(cb: Any, plan: Any) -> dict[str, Any]:
    """The checkpoint goes where the run's others go, named on_exception (Lightning's default filename)."""
    log.info(
        "OnExceptionCheckpoint(dirpath=%r): unifit saves it with the run's checkpoints as on_exception", cb.dirpath
    )
    return {"checkpoint": {"save_on_exception": True}}


def _mirror_checkpoint(cb: Any, last_path: str, best_path: str | None, best_value: Any, best_k: dict) -> None:
    import torch

    cb.last_model_path = last_path
    if best_path is not None:
        cb.best_model_path = best_path
        cb.best_model_score = torch.tensor(best_value)
    cb.best_k_models = {path: torch.tensor(value) for path, value in best_k.items()}
    if best_k:
        cb.kth_best_model_path = max(best_k, key=best_k.get) if cb.mode == "min" else min(best_k, key=best_k.get)


def _early_stopping(cb: Any, plan: Any) -> dict[str, Any]:
    plan.reports["early_stopping"] = lambda **facts: _mirror_early_stopping(cb, **facts)
    settings = {
        "monitor": cb.monitor,
        "mode": cb.mode,
        "patience": int(cb.patience),
        "min_delta": abs(float(cb.min_delta)),  # Lightning keeps it signed by mode
        "strict": bool(cb.strict),
        "check_finite": bool(cb.check_finite),
        "stopping_threshold": cb.stopping_threshold,
        "divergence_threshold": cb.divergence_threshold,
    }
    return {"early_stopping": {key: value for key, value in settings.items() if value is not None}}


def _mirror_early_stopping(cb: Any, wait: int, best: Any, stopped_epoch: int | None) -> None:
    import torch

    cb.wait_count = wait
    if best is not None:
        cb.best_score = torch.tensor(best)
    if stopped_epoch is not None:
        cb.stopped_epoch = stopped_epoch


def _timer(cb: Any, plan: Any) -> dict[str, Any]:
    duration = made_with(cb, ("duration",))["duration"]
    return {} if duration is None else {"max_time": float(duration)}


def _accumulation(cb: Any, plan: Any) -> dict[str, Any]:
    scheduling = {int(epoch): int(factor) for epoch, factor in dict(cb.scheduling).items()}
    if set(scheduling) == {0}:
        return {"accumulate_grad_batches": scheduling[0]}
    return {"accumulation_schedule": scheduling}


def _progress_bar(cb: Any, plan: Any) -> dict[str, Any]:
    enabled = getattr(cb, "refresh_rate", 1) != 0 and not getattr(cb, "is_disabled", False)
    return {"progress_bar": bool(enabled)}


def _lr_finder(cb: Any, plan: Any) -> dict[str, Any]:
    plan.reports["lr_find"] = lambda **found: _mirror_lr_finder(cb, **found)
    return {"lr_find": made_with(cb, _LR_FINDER_ARGUMENTS)}


_LR_FINDER_ARGUMENTS = (
    "min_lr",
    "max_lr",
    "num_training_steps",
    "mode",
    "early_stop_threshold",
    "update_attr",
    "attr_name",
)


def _mirror_lr_finder(cb: Any, lrs: list[float], losses: list[float]) -> None:
    """The callback's `optimal_lr`, Lightning's own result object (its suggestion() and plot() work)."""
    made = made_with(cb, ("mode", "min_lr", "max_lr", "num_training_steps"))
    cb.optimal_lr = lr_finder_result(*made.values(), lrs, losses)


def _batch_size_finder(cb: Any, plan: Any) -> dict[str, Any]:
    def report(found: int) -> None:
        cb.optimal_batch_size = found  # as Lightning's callback holds it

    plan.reports["batch_size_find"] = report
    names = ("mode", "steps_per_trial", "init_val", "max_trials", "batch_arg_name")
    return {"batch_size_find": made_with(cb, names, optional={"margin": 0.05, "max_val": 8192})}


def _device_stats(cb: Any, plan: Any) -> dict[str, Any]:
    return {"device_stats": {"enabled": True, **made_with(cb, ("cpu_stats",))}}


def _logged_already(cb: Any, plan: Any) -> dict[str, Any]:
    return {}


def _minutes(interval: timedelta | None) -> float | None:
    return interval.total_seconds() / 60 if interval is not None else None


# Lightning's class name -> the updates to the trainer config it becomes (none: nothing to do)
MAPPED: dict[str, Callable[[Any, Any], dict[str, Any]]] = {
    "ModelCheckpoint": _model_checkpoint,
    "OnExceptionCheckpoint": _on_exception,
    "EarlyStopping": _early_stopping,
    "Timer": _timer,
    "GradientAccumulationScheduler": _accumulation,
    "ProgressBar": _progress_bar,
    "DeviceStatsMonitor": _device_stats,
    "LearningRateFinder": _lr_finder,
    "BatchSizeFinder": _batch_size_finder,
    **{kind: _logged_already for kind in _LOGGED_ALREADY},
}


def is_lightning_callback(obj: Any) -> bool:
    """A lightning.Callback (or pytorch_lightning's), checked by name: lightning is not imported to ask."""
    return derives_from(obj, "Callback", *LIGHTNING)


def lightning_kind(callback: Any) -> str | None:
    """The name of the first Lightning class `callback` is (itself or a base), ignoring the Callback base."""
    for cls in type(callback).__mro__:
        if cls.__module__.startswith(("lightning", "pytorch_lightning")) and cls.__name__ != "Callback":
            return "ProgressBar" if cls.__name__ in _PROGRESS_BARS else cls.__name__
    return None


def check_not_customised(callback: Any, kind: str) -> None:
    """A subclass of a mapped callback that overrides a hook would lose that code: refused."""
    base = next(c for c in type(callback).__mro__ if c.__module__.startswith(("lightning", "pytorch_lightning")))
    own = [
        name
        for cls in type(callback).__mro__
        if cls is not base and cls.__module__ and not cls.__module__.startswith(("lightning", "pytorch_lightning"))
        for name in vars(cls)
        if callable(getattr(base, name, None)) and (name.startswith("on_") or name in ("setup", "teardown"))
    ]
    if own and kind != "ProgressBar":
        raise ConfigError(
            f"a subclass of Lightning's {kind} that overrides {', '.join(sorted(set(own)))}; unifit maps {kind} onto "
            f"its own, so that code would not run: move it into a lightning.Callback of its own"
        )
