"""Stop every rank together on a NaN/inf loss, before a bad checkpoint can be written."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from unifit.config.schema import NanGuardConfig
from unifit.errors import NonFiniteLossError
from unifit.loop.callback import Callback


class NanGuard(Callback):
    """Checks the step loss every N steps (all ranks agree through one tiny all-reduce) and
    the epoch's averaged metrics at epoch end (already identical on every rank). It raises on
    every rank at the same point, so the checkpoint callback never saves poisoned weights.

    A step's check is started without waiting for the device (on GPUs the flag is copied in the
    background) and counted at the first agreement after it is known, so the guard never stalls
    the GPU; on CPU that is the same step. Every rank joins every agreement, known or not."""

    def __init__(self, config: NanGuardConfig) -> None:
        self.every = config.check_every_n_steps
        self._pending: list[tuple[int, Any]] = []

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        if not ctx.passed_batch(self.every):
            return
        self._pending.append((ctx.state.global_step, ctx.finite_probe(loss)))
        bad_step, waiting = None, []
        for step, probe in self._pending:
            finite = probe()
            if finite is None:
                waiting.append((step, probe))
            elif not finite and bad_step is None:
                bad_step = step
        self._pending = waiting
        found = bad_step is not None  # step 0 is a step (accumulation: checks before the first optimizer step)
        if ctx.world_size == 1:  # nothing to agree on: no all-reduce
            if found:
                self._stop(ctx, f"non-finite loss at step {bad_step} on rank 0")
            return
        flagged = ctx.all_reduce_max(np.array([float(ctx.rank + 1) if found else 0.0, float(bad_step or 0)]))
        if flagged[0]:  # the highest flagged rank, and the latest step flagged on any rank
            self._stop(ctx, f"non-finite loss at step {int(flagged[1])} on rank {int(flagged[0]) - 1}")

    def on_train_epoch_start(self, ctx: Any) -> None:
        self._pending = []  # the epoch-end check has covered the last epoch's steps

    def on_train_epoch_end(self, ctx: Any) -> None:
        bad = sorted(k for k, v in ctx.state.metrics.items() if not math.isfinite(v))
        if bad:
            self._stop(ctx, f"non-finite {', '.join(bad)} in epoch {ctx.state.epoch + 1}")

    def _stop(self, ctx: Any, what: str) -> None:
        last = ctx.last_checkpoint
        kept = f"last good checkpoint: {last}" if last else "no checkpoint was written before it"
        raise NonFiniteLossError(
            f"training stopped on all ranks: {what}; {kept}; lower the lr or enable gradient_clip_val"
        )
