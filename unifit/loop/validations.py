"""Validations inside an epoch (trainer.val_check_interval), for the callbacks that record metrics.

The epoch's own validation is recorded with the epoch (at EPOCH_END, with the training metrics); one that runs
inside the epoch has no epoch end of its own, so a recording callback is handed it here, once, at the step it
ran at, as Lightning logs every validation.
"""

from __future__ import annotations

from typing import Any

from unifit.loop.callback import Callback

MID_EPOCH = "mid_epoch"  # marks metrics.jsonl's line of a validation inside an epoch (trainer.val_check_interval)


class RecordsMidEpochValidations(Callback):
    """Calls `on_mid_epoch_validation(ctx, metrics)` after each validation that runs inside an epoch, with what
    that validation reduced (already averaged over the ranks: no collective here).

    Those are the entries it set in `ctx.state.metrics`: a reduce makes a new value object for every key it
    reduced, so the keys whose value object changed since VALIDATION_START are the validation's own, even where
    a value equals the one before (an accuracy of 1.0 twice)."""

    _inside_epoch = False
    _before: dict[str, Any] | None = None

    def on_train_epoch_start(self, ctx: Any) -> None:
        self._inside_epoch = True

    def on_train_epoch_end(self, ctx: Any) -> None:
        self._inside_epoch = False  # the validation that follows is the epoch's own

    def on_validation_start(self, ctx: Any) -> None:
        self._before = dict(ctx.state.metrics) if self._inside_epoch else None

    def on_validation_end(self, ctx: Any) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        missing = object()
        reduced = {key: value for key, value in ctx.state.metrics.items() if before.get(key, missing) is not value}
        if reduced:
            self.on_mid_epoch_validation(ctx, reduced)

    def on_mid_epoch_validation(self, ctx: Any, metrics: dict[str, float]) -> None:
        """A validation inside an epoch ended at optimizer step `ctx.state.global_step` with these metrics."""
