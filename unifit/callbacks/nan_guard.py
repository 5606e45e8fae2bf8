"""Stop every rank together on a NaN/inf loss, before a bad checkpoint can be written."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from unifit.callbacks.base import Callback
from unifit.errors import NonFiniteLossError
from unifit.trainer.config import NanGuardConfig


class NanGuard(Callback):
    """Checks the step loss every N steps (all ranks agree through one tiny all-reduce) and
    the epoch's averaged metrics at epoch end (already identical on every rank). It raises on
    every rank at the same point, so the checkpoint callback never saves poisoned weights."""

    def __init__(self, config: NanGuardConfig) -> None:
        self.every = config.check_every_n_steps

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % self.every:
            return
        bad = 0.0 if ctx.is_finite(loss) else float(ctx.rank + 1)
        flagged = ctx.all_reduce_max(np.array([bad]))[0]
        if flagged:
            self._stop(ctx, f"non-finite loss at step {ctx.state.global_step} on rank {int(flagged) - 1}")

    def on_train_epoch_end(self, ctx: Any) -> None:
        bad = sorted(k for k, v in ctx.state.metrics.items() if not math.isfinite(v))
        if bad:
            self._stop(ctx, f"non-finite {', '.join(bad)} in epoch {ctx.state.epoch + 1}")

    def _stop(self, ctx: Any, what: str) -> None:
        last = ctx.extra.get("last_checkpoint")
        kept = f"last good checkpoint: {last}" if last else "no checkpoint was written before it"
        raise NonFiniteLossError(f"training stopped on all ranks: {what}; {kept}; lower the lr or enable gradient_clip_val")
