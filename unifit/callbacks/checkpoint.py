"""Checkpoint every N epochs on rank 0, keep the last N, track the best by a monitored metric."""

from __future__ import annotations

import math
from typing import Any

from unifit.callbacks.base import Callback
from unifit.errors import ConfigError
from unifit.trainer.config import CheckpointConfig


class ModelCheckpoint(Callback):
    """Runs on every rank: saving gathers each rank's random state and ends at a barrier."""

    runs_last = True

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.best_value: float | None = None

    def on_epoch_end(self, ctx: Any) -> None:
        cfg, state = self.config, ctx.state
        last = state.epoch == ctx.config.max_epochs or state.should_stop
        if state.epoch % cfg.every_n_epochs and not last:
            return
        improved = self._improved(ctx)
        protected = {ctx.resumed_from} if ctx.resumed_from else set()
        best_value = self.best_value

        def after_commit(store: Any, name: str) -> None:  # rank 0, once the checkpoint is committed
            if improved:
                store.set_best(name, cfg.monitor, best_value)
            store.prune(cfg.keep_last_n, protected)

        ctx.save_checkpoint(after_commit=after_commit)

    def _improved(self, ctx: Any) -> bool:
        monitor = self.config.monitor
        if monitor is None:
            return False
        if monitor not in ctx.state.metrics:
            raise ConfigError(
                f"trainer.checkpoint.monitor: '{monitor}' was not logged; logged metrics: "
                f"{', '.join(sorted(ctx.state.metrics))}")
        value = ctx.state.metrics[monitor]
        if not math.isfinite(value):
            return False
        better = self.best_value is None or (value > self.best_value if self.config.mode == "max" else value < self.best_value)
        if better:
            self.best_value = value
        return better

    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value = state.get("best_value")
