"""Callbacks: checkpointing, loggers, progress, early stopping, NaN guard, run directory."""

from __future__ import annotations

from typing import Any

from unifit.callbacks import kubeflow_progress, ray_report
from unifit.callbacks.checkpoint import IntervalCheckpoint, ModelCheckpoint
from unifit.callbacks.early_stopping import EarlyStopping
from unifit.callbacks.foreign import CallbackPlan, is_foreign_callback, plan_callbacks
from unifit.callbacks.nan_guard import NanGuard
from unifit.callbacks.preemption import Preemption
from unifit.callbacks.progress import EpochSummary, ProgressBar
from unifit.callbacks.run_directory import ModelExport, RunDirectory
from unifit.callbacks.time_limit import TimeLimit
from unifit.config.schema import TrainerConfig
from unifit.errors import ConfigError
from unifit.loggers import DeviceStatsConnector, Logger, LoggerConnector
from unifit.loop.callback import Callback

__all__ = [
    "Callback",
    "CallbackPlan",
    "IntervalCheckpoint",
    "ModelCheckpoint",
    "Preemption",
    "EarlyStopping",
    "EpochSummary",
    "ModelExport",
    "NanGuard",
    "ProgressBar",
    "RunDirectory",
    "TimeLimit",
    "default_callbacks",
    "is_foreign_callback",
    "plan_callbacks",
]


def default_callbacks(
    cfg: TrainerConfig, reports: dict[str, Any] | None = None, loggers: list[Logger] | None = None
) -> list[Callback]:
    """The built-in callbacks a config asks for, in the order they must run:
    the NaN guard before anything saves, early stopping before the checkpoint that follows it.
    `reports`: what mapped Lightning callbacks are told ("checkpoint", "early_stopping": lightning_mapping.py);
    `loggers`: the run's (unifit.loggers.build_loggers), fed by one LoggerConnector."""
    reports = reports or {}
    callbacks: list[Callback] = []
    if cfg.nan_guard.enabled:
        callbacks.append(NanGuard(cfg.nan_guard))
    if cfg.max_time is not None:  # its stop, like early stopping's, is seen by the checkpoint that follows
        callbacks.append(TimeLimit(cfg.max_time, cfg.preemption.check_every_n_steps))
    if cfg.early_stopping is not None:
        callbacks.append(EarlyStopping(cfg.early_stopping, reports.get("early_stopping")))
    if cfg.checkpoint.enabled:
        intervals = cfg.checkpoint.every_n_steps is not None or cfg.checkpoint.every_n_minutes is not None
        callbacks.append(
            (IntervalCheckpoint if intervals else ModelCheckpoint)(cfg.checkpoint, reports.get("checkpoint"))
        )
    if cfg.preemption.enabled:
        callbacks.append(Preemption(cfg.preemption, save=cfg.preemption.checkpoint and cfg.checkpoint.enabled))
    if cfg.device_stats.enabled and not loggers:
        raise ConfigError(
            "trainer.device_stats.enabled: true needs a logger to write to, and trainer.loggers is empty; "
            "add one (e.g. trainer.loggers: [tensorboard]) or turn device_stats off"
        )
    if loggers:
        every = cfg.tensorboard.log_every_n_steps
        if cfg.device_stats.enabled:
            callbacks.append(DeviceStatsConnector(loggers, every, cfg.device_stats))
        else:
            callbacks.append(LoggerConnector(loggers, every))
    callbacks.append(RunDirectory(cfg.root_dir, cfg.storage_options))
    if cfg.export_dir:
        callbacks.append(ModelExport(cfg.export_dir, cfg.storage_options))
    callbacks.append(EpochSummary())
    if kubeflow_progress.wanted():  # a Kubeflow TrainJob asked for its progress
        callbacks.append(kubeflow_progress.KubeflowProgress())
    if ray_report.wanted():  # a Ray Train worker (unifit.ray): metrics and checkpoints to Ray
        callbacks.append(ray_report.RayTrainReport())
    if ProgressBar.wanted(cfg.progress_bar):
        callbacks.append(ProgressBar())
    return callbacks
