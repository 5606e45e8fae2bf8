"""Checkpoint every N epochs (and every N optimizer steps or M minutes) on rank 0, keep the last N,
track the best (and the k best) by a monitored metric."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import numpy as np

from unifit.callbacks.monitor import check_monitor
from unifit.checkpoint.store import checkpoint_name
from unifit.config.schema import CheckpointConfig
from unifit.loop.callback import Callback

log = logging.getLogger("unifit")
ON_EXCEPTION = "on_exception"  # the checkpoint's name, Lightning's OnExceptionCheckpoint's default filename


class ModelCheckpoint(Callback):
    """Runs on every rank: saving gathers each rank's random state and ends at a barrier."""

    runs_last = True

    def __init__(self, config: CheckpointConfig, report: Callable[..., None] | None = None) -> None:
        self.config = config
        self.report = report  # tells a mapped Lightning ModelCheckpoint its paths (best_model_path, ...)
        self.best_value: float | None = None
        self.best_name: str | None = None
        self.best_k: dict[str, float] = {}  # the k best checkpoints by the monitor: name -> value

    def on_validation_end(self, ctx: Any) -> None:
        check_monitor("trainer.checkpoint.monitor", self.config.monitor, ctx.state.metrics, final=False)

    def on_epoch_end(self, ctx: Any) -> None:
        cfg, state = self.config, ctx.state
        last = state.epoch == ctx.config.max_epochs or state.should_stop
        if state.epoch % cfg.every_n_epochs and not last:
            return
        self._save(ctx, scored=True)

    def on_exception(self, ctx: Any, error: BaseException) -> None:
        """checkpoint.save_on_exception: on one process, the state after the last finished batch, saved before
        the error ends the fit (a failure to save is logged, never raised over the error)."""
        if not self.config.save_on_exception:
            return
        if ctx.world_size > 1:
            log.warning(
                "checkpoint.save_on_exception: not saved, since %d ranks cannot all join a checkpoint after one "
                "failed; resume from the last committed checkpoint (%s)",
                ctx.world_size,
                ctx.last_checkpoint or "none yet",
            )
            return
        try:
            ctx.save_checkpoint(ON_EXCEPTION)
        except Exception as exc:
            log.warning("checkpoint.save_on_exception: could not save (%s: %s)", type(exc).__name__, exc)
            return
        log.info("checkpoint.save_on_exception: saved %s before the error", ctx.last_checkpoint)

    def _save(self, ctx: Any, scored: bool = False) -> None:
        """Save now; `scored`: the checkpoint competes for best and the k best by the monitor."""
        cfg = self.config
        name = checkpoint_name(ctx.state.epoch, ctx.state.global_step)
        improved = scored and self._score(ctx, name)
        protected = {ctx.resumed_from} if ctx.resumed_from else set()
        protected |= set(self.best_k)
        best_value = self.best_value

        def after_commit(store: Any, name: str) -> None:  # rank 0, once the checkpoint is committed
            if improved:
                store.set_best(name, cfg.monitor, best_value)
            store.prune(cfg.keep_last_n, protected)

        ctx.save_checkpoint(name, after_commit=after_commit)
        if self.report is not None:
            self._report(ctx.last_checkpoint)

    def _score(self, ctx: Any, name: str) -> bool:
        """Whether checkpoint `name` is the best so far; it joins the k best if it is among them."""
        monitor = self.config.monitor
        if monitor is None:
            return False
        check_monitor("trainer.checkpoint.monitor", monitor, ctx.state.metrics, final=True)
        value = float(ctx.state.metrics[monitor])
        if not math.isfinite(value):
            return False
        sign = 1.0 if self.config.mode == "max" else -1.0
        ranked = sorted({**self.best_k, name: value}.items(), key=lambda item: -sign * item[1])
        self.best_k = dict(ranked[: self.config.keep_best_k])
        better = self.best_value is None or sign * (value - self.best_value) > 0
        if better:
            self.best_value, self.best_name = value, name
        return better

    def _report(self, last_path: str | None) -> None:
        folder = (last_path or "").rsplit("/", 1)[0]
        assert self.report is not None
        self.report(
            last_path=last_path or "",
            best_path=f"{folder}/{self.best_name}" if self.best_name else None,
            best_value=self.best_value,
            best_k={f"{folder}/{name}": value for name, value in self.best_k.items()},
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value, "best_name": self.best_name, "best_k": dict(self.best_k)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value = state.get("best_value")
        self.best_name = state.get("best_name")
        self.best_k = dict(state.get("best_k", {}))


class IntervalCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also saves mid-epoch: every `every_n_steps` optimizer steps, and when
    `every_n_minutes` passed on rank 0's clock (all ranks agree every 10 optimizer steps, one tiny
    all-reduce). Decisions fall on optimizer-step boundaries, so no accumulated gradient is lost."""

    AGREE_EVERY = 10

    def __init__(self, config: CheckpointConfig, report: Callable[..., None] | None = None) -> None:
        super().__init__(config, report)
        self._last_save = time.monotonic()

    @property
    def state_key(self) -> str:
        return "ModelCheckpoint"  # the same state, whichever of the two saves it

    def on_fit_start(self, ctx: Any) -> None:
        self._last_save = time.monotonic()

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        cfg = self.config  # on an accumulation micro-batch no step is passed (no optimizer step happened)
        due = cfg.every_n_steps is not None and ctx.passed_step(cfg.every_n_steps)
        if cfg.every_n_minutes is not None and ctx.passed_step(self.AGREE_EVERY) and not due:
            late = ctx.is_global_zero and time.monotonic() - self._last_save >= 60 * cfg.every_n_minutes
            due = bool(ctx.all_reduce_max(np.array([1.0 if late else 0.0]))[0])
        if due:
            self._save(ctx)

    def _save(self, ctx: Any, scored: bool = False) -> None:
        super()._save(ctx, scored)
        self._last_save = time.monotonic()
