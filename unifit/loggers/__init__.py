"""Loggers: where a run's metrics go (TensorBoard, metrics.csv, MLflow, Weights & Biases, your own), fed by one
callback on rank 0 (connector.py). Each logger is one file; `build_loggers` makes those trainer.loggers names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from unifit._imports import load_object
from unifit.config.schema import ClassPath, TrainerConfig
from unifit.errors import ConfigError
from unifit.loggers.base import Logger, NoOpExperiment, RunInfo
from unifit.loggers.connector import DeviceStatsConnector, LoggerConnector

__all__ = ["DeviceStatsConnector", "Logger", "LoggerConnector", "NoOpExperiment", "RunInfo", "build_loggers"]


# a logger name in trainer.loggers -> its class (imported only when named)
LOGGERS = {
    "tensorboard": "unifit.loggers.tensorboard:TensorBoardLogger",
    "csv": "unifit.loggers.csv:CSVLogger",
    "mlflow": "unifit.loggers.mlflow:MLflowLogger",
    "wandb": "unifit.loggers.wandb:WandbLogger",
}


def build_loggers(cfg: TrainerConfig, objects: Sequence[Any] = ()) -> list[Logger]:
    """The run's loggers, made on every rank (only rank 0 starts them); backends import when started. `objects`:
    logger instances given to Trainer(loggers=[...]), after the ones named in the config."""
    from unifit.config.init_args import build

    made: list[Logger] = []
    for i, spec in enumerate(cfg.logger_specs):
        field = f"trainer.loggers.{i}"
        if isinstance(spec, ClassPath):
            made.append(_as_logger(build(spec.class_path, spec.init_args, field), field))
        else:
            logger = load_object(LOGGERS[spec.name], field=field).from_config(spec, cfg)
            logger.field = field
            made.append(logger)
    return made + [_as_logger(obj, f"Trainer(loggers=[...]) item {i}") for i, obj in enumerate(objects)]


def _as_logger(made: Any, field: str) -> Logger:
    from unifit.loggers.foreign import LightningLoggerAdapter

    if isinstance(made, Logger):
        return made
    if callable(getattr(made, "log_metrics", None)) and callable(getattr(made, "log_hyperparams", None)):
        return LightningLoggerAdapter(made)
    raise ConfigError(
        f"{field}: received a {type(made).__name__}, which is neither a unifit.loggers.Logger nor a Lightning "
        "logger (log_metrics and log_hyperparams); subclass unifit.loggers.Logger"
    )
