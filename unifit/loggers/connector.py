"""One callback feeds every logger of the run, on rank 0: the resolved config once, the step loss, lr and what the
module logged with on_step=True every `log_every_n_steps` optimizer steps, each epoch's metrics at its last step,
each validation inside an epoch (trainer.val_check_interval) at the step it ran at, the last checkpoint at the end (for loggers that keep artifacts), and the run's outcome. Each value is read once and
handed to all loggers, so they record the same steps and epochs.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml

from unifit.loggers.base import Logger, RunInfo, flatten
from unifit.loggers.device_stats import device_stats
from unifit.loop.validations import RecordsMidEpochValidations

log = logging.getLogger("unifit")


class LoggerConnector(RecordsMidEpochValidations):
    rank_zero_only = True

    def __init__(self, loggers: list[Logger], log_every_n_steps: int) -> None:
        self.loggers = loggers
        self.every = log_every_n_steps
        self._next_step = log_every_n_steps
        self._status = "success"

    @property
    def state_key(self) -> str:
        return "Loggers"

    def _keys(self) -> list[tuple[str, Logger]]:
        seen: dict[str, int] = {}
        keys = []
        for logger in self.loggers:
            seen[logger.name] = seen.get(logger.name, 0) + 1
            keys.append((logger.name if seen[logger.name] == 1 else f"{logger.name}_{seen[logger.name]}", logger))
        return keys

    def on_setup(self, ctx: Any) -> None:
        run = RunInfo(
            root_dir=ctx.config.root_dir,
            hyperparameters=flatten(yaml.safe_load(ctx.resolved_config)),
            resumed_at_step=ctx.state.global_step if ctx.resumed_from else None,
            storage_options=ctx.config.storage_options,
        )
        for logger in self.loggers:
            logger.start(run)
            logger.log_text(ctx.resolved_config, "config.yaml")
        self._next_step = (ctx.state.global_step // self.every + 1) * self.every

    def start_evaluation(self, run: RunInfo, checkpoint_state: Any) -> None:
        """validate/test (rank 0), before the first batch: the loggers open the tracked run the evaluated checkpoint
        belongs to (its ids are in `checkpoint_state`, the checkpoint's state of this callback), else a new one;
        `log_evaluation` records the metrics, `finish` closes them."""
        self.load_state_dict(checkpoint_state or {})
        for logger in self.loggers:
            logger.start(run)

    def log_evaluation(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        step = ctx.state.global_step
        if step < self._next_step or not self.loggers:
            return
        self._next_step = (step // self.every + 1) * self.every  # a call of several steps may pass a multiple
        logged = {name: float(value) for name, value in ctx.step_metrics().items()}  # self.log(..., on_step=True)
        if loss is not None:  # None: a skipped batch
            logged["train/loss_step"] = float(loss)
        logged["lr_step"] = ctx.current_lrs()[0]
        logged.update(self._step_extras())
        for logger in self.loggers:
            logger.log_metrics(logged, step)

    def _step_extras(self) -> dict[str, float]:
        """More values for a logged step (DeviceStatsConnector's)."""
        return {}

    def on_mid_epoch_validation(self, ctx: Any, metrics: dict[str, float]) -> None:
        """Its metrics alone (no `epoch`: rows and events with `epoch` are the epochs' ends)."""
        for logger in self.loggers:
            logger.log_metrics(metrics, ctx.state.global_step)

    def on_epoch_end(self, ctx: Any) -> None:
        metrics = {**ctx.state.metrics, "epoch": ctx.state.epoch}
        for logger in self.loggers:
            logger.log_metrics(metrics, ctx.state.global_step)
            logger.epoch_end()

    def on_fit_end(self, ctx: Any) -> None:
        if ctx.last_checkpoint:
            for logger in self.loggers:
                logger.log_checkpoint(ctx.last_checkpoint)

    def on_exception(self, ctx: Any, error: BaseException) -> None:
        self._status = "failed"

    def on_teardown(self, ctx: Any) -> None:
        self.finish(self._status)

    def finish(self, status: str) -> None:
        """Every logger is finished, even when one of them fails to."""
        for logger in self.loggers:
            if not logger.started:
                continue
            try:
                logger.finish(status)
            except Exception as exc:  # the run's own outcome matters more than a logger's
                log.warning("%s logger did not finish cleanly: %s: %s", logger.name, type(exc).__name__, exc)

    def state_dict(self) -> dict[str, Any]:
        return {key: state for key, logger in self._keys() if (state := logger.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, logger in self._keys():
            if key in state:
                logger.load_state_dict(state[key])


class DeviceStatsConnector(LoggerConnector):
    """LoggerConnector with trainer.device_stats (Lightning's DeviceStatsMonitor): each logged step also gets the
    device's statistics read at its start and its end. A class of its own, so that runs without it have no
    callback at each batch's start."""

    def __init__(self, loggers: list[Logger], log_every_n_steps: int, settings: Any) -> None:
        super().__init__(loggers, log_every_n_steps)
        self.settings = settings
        self._at_batch_start: dict[str, float] = {}  # DeviceStatsMonitor's on_train_batch_start values

    def on_train_batch_start(self, ctx: Any, batch: Any, batch_idx: int) -> None:
        if ctx.state.global_step + 1 >= self._next_step:  # a logged step ahead
            self._at_batch_start = self._read("on_train_batch_start")

    def _step_extras(self) -> dict[str, float]:
        extras = {**self._at_batch_start, **self._read("on_train_batch_end")}
        self._at_batch_start = {}
        return extras

    def _read(self, hook: str) -> dict[str, float]:
        stats = device_stats(self.settings.cpu_stats)
        return {f"DeviceStatsMonitor.{hook}/{key}": value for key, value in stats.items()}
