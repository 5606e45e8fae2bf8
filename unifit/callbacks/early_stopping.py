"""Stop when a monitored metric stops improving; every rank sees the same averaged metrics,
so every rank decides the same."""

from __future__ import annotations

from typing import Any

from unifit.config.schema import EarlyStoppingConfig
from unifit.errors import ConfigError
from unifit.loop.callback import Callback


class EarlyStopping(Callback):
    def __init__(self, config: EarlyStoppingConfig) -> None:
        self.config = config
        self.best: float | None = None
        self.bad_epochs = 0

    def on_epoch_end(self, ctx: Any) -> None:
        cfg = self.config
        if cfg.monitor not in ctx.state.metrics:
            raise ConfigError(
                f"trainer.early_stopping.monitor: '{cfg.monitor}' was not logged; logged metrics: "
                f"{', '.join(sorted(ctx.state.metrics))}"
            )
        value = ctx.state.metrics[cfg.monitor]
        sign = 1.0 if cfg.mode == "max" else -1.0
        if self.best is None or sign * (value - self.best) > cfg.min_delta:
            self.best, self.bad_epochs = value, 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= cfg.patience:
            ctx.state.request_stop(
                f"early stopping: {cfg.monitor} did not improve for {cfg.patience} epochs (best {self.best:.6g})"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
        self.bad_epochs = state.get("bad_epochs", 0)
