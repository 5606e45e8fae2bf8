"""Checkpoint every N epochs (and every N optimizer steps or M minutes) on rank 0, keep the last N,
track the best by a monitored metric."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from unifit.config.schema import CheckpointConfig
from unifit.errors import ConfigError
from unifit.loop.callback import Callback


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
        self._save(ctx, self._improved(ctx))

    def _save(self, ctx: Any, improved: bool = False) -> None:
        cfg = self.config
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
                f"{', '.join(sorted(ctx.state.metrics))}"
            )
        value = ctx.state.metrics[monitor]
        if not math.isfinite(value):
            return False
        better = self.best_value is None or (
            value > self.best_value if self.config.mode == "max" else value < self.best_value
        )
        if better:
            self.best_value = value
        return better

    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value = state.get("best_value")


class IntervalCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also saves mid-epoch: every `every_n_steps` optimizer steps, and when
    `every_n_minutes` passed on rank 0's clock (all ranks agree every 10 optimizer steps, one tiny
    all-reduce). Decisions fall on optimizer-step boundaries, so no accumulated gradient is lost."""

    AGREE_EVERY = 10

    def __init__(self, config: CheckpointConfig) -> None:
        super().__init__(config)
        self._seen_step = -1
        self._last_save = time.monotonic()

    @property
    def state_key(self) -> str:
        return "ModelCheckpoint"  # the same state, whichever of the two saves it

    def on_fit_start(self, ctx: Any) -> None:
        self._seen_step, self._last_save = ctx.progress.optimizer_step, time.monotonic()

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        step = ctx.progress.optimizer_step
        if step == self._seen_step:  # an accumulation micro-batch: no optimizer step happened
            return
        self._seen_step = step
        cfg = self.config
        due = cfg.every_n_steps is not None and step % cfg.every_n_steps == 0
        if cfg.every_n_minutes is not None and step % self.AGREE_EVERY == 0 and not due:
            late = ctx.is_global_zero and time.monotonic() - self._last_save >= 60 * cfg.every_n_minutes
            due = bool(ctx.all_reduce_max(np.array([1.0 if late else 0.0]))[0])
        if due:
            self._save(ctx)

    def on_epoch_end(self, ctx: Any) -> None:
        super().on_epoch_end(ctx)
        self._seen_step = ctx.progress.optimizer_step

    def _save(self, ctx: Any, improved: bool = False) -> None:
        super()._save(ctx, improved)
        self._last_save = time.monotonic()
