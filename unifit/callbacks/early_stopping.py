"""Stop when a monitored metric stops improving; every rank sees the same averaged metrics,
so every rank decides the same. The criteria are Lightning's EarlyStopping's, in its order: a
value that is not finite, one past `stopping_threshold` or `divergence_threshold`, then patience."""

from __future__ import annotations

import math
from typing import Any, Callable

from unifit.callbacks.monitor import check_monitor
from unifit.config.schema import EarlyStoppingConfig
from unifit.loop.callback import Callback


class EarlyStopping(Callback):
    def __init__(self, config: EarlyStoppingConfig, report: Callable[..., None] | None = None) -> None:
        self.config = config
        self.report = report  # tells a mapped Lightning EarlyStopping what happened (wait_count, stopped_epoch...)
        self.best: float | None = None
        self.bad_epochs = 0

    def on_validation_end(self, ctx: Any) -> None:
        if self.config.strict:
            check_monitor("trainer.early_stopping.monitor", self.config.monitor, ctx.state.metrics, final=False)

    def on_epoch_end(self, ctx: Any) -> None:
        cfg = self.config
        if cfg.monitor not in ctx.state.metrics:
            if not cfg.strict:
                return
            check_monitor("trainer.early_stopping.monitor", cfg.monitor, ctx.state.metrics, final=True)
        reason = self._stop_reason(float(ctx.state.metrics[cfg.monitor]))
        if reason is not None:
            ctx.state.request_stop(f"early stopping: {reason}")
        if self.report is not None:
            stopped = ctx.state.epoch - 1 if reason is not None else None  # Lightning's current_epoch then
            self.report(wait=self.bad_epochs, best=self.best, stopped_epoch=stopped)

    def _stop_reason(self, value: float) -> str | None:
        cfg = self.config
        better = (lambda a, b: a > b) if cfg.mode == "max" else (lambda a, b: a < b)
        if cfg.check_finite and not math.isfinite(value):
            return f"{cfg.monitor} = {value} is not finite"
        if cfg.stopping_threshold is not None and better(value, cfg.stopping_threshold):
            return f"{cfg.monitor} = {value:.6g} reached stopping_threshold {cfg.stopping_threshold}"
        if cfg.divergence_threshold is not None and better(cfg.divergence_threshold, value):
            return f"{cfg.monitor} = {value:.6g} passed divergence_threshold {cfg.divergence_threshold}"
        sign = 1.0 if cfg.mode == "max" else -1.0
        if self.best is None or sign * (value - self.best) > cfg.min_delta:
            self.best, self.bad_epochs = value, 0
            return None
        self.bad_epochs += 1
        if self.bad_epochs >= cfg.patience:
            return f"{cfg.monitor} did not improve for {cfg.patience} epochs (best {self.best:.6g})"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
        self.bad_epochs = state.get("bad_epochs", 0)
