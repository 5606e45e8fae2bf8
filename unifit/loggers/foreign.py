"""A Lightning logger (CometLogger, NeptuneLogger, your own Logger subclass...) named by class path in
trainer.loggers, driven as Lightning's Trainer drives it: hyperparameters once, metrics at their steps, `save()` at
each epoch's end, `finalize(status)` at the end. Its `experiment` is its own."""

from __future__ import annotations

from typing import Any

from unifit.loggers.base import Logger, NoOpExperiment, RunInfo


class LightningLoggerAdapter(Logger):
    def __init__(self, logger: Any) -> None:
        super().__init__()
        self.logger = logger
        # the class name, not the logger's `name`: reading that may open its run (MLFlowLogger), on any rank
        self.name = type(logger).__name__

    def start(self, run: RunInfo) -> None:
        super().start(run)
        self.logger.log_hyperparams(run.hyperparameters)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.started:
            self.logger.log_metrics(metrics, step)

    def epoch_end(self) -> None:
        self.logger.save()

    def finish(self, status: str) -> None:
        self.logger.finalize(status)
        super().finish(status)

    @property
    def version(self) -> Any:  # type: ignore[override]
        return self.logger.version

    @property
    def save_dir(self) -> str | None:
        return getattr(self.logger, "save_dir", None)

    @property
    def log_dir(self) -> str | None:
        return getattr(self.logger, "log_dir", self.save_dir)

    @property
    def experiment(self) -> Any:
        """Its own on rank 0; elsewhere a no-op (Lightning's rank check may not know the rank, under horovod)."""
        return self.logger.experiment if self.started else NoOpExperiment()

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if self.started:
            self.logger.log_hyperparams(params, *args, **kwargs)
