"""What every zoo driver records in a run, whatever the framework: each micro-batch's loss and the epoch
metrics (Recorder), and a crash a step after a mid-epoch checkpoint (Crash)."""

from __future__ import annotations

from typing import Any

import unifit


class Recorder(unifit.Callback):
    """Every micro-batch's loss on this rank, and the epoch metrics (averaged over every rank)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.epochs: list[dict[str, float]] = []

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        self.losses.append(float(loss))

    def on_epoch_end(self, ctx: Any) -> None:
        self.epochs.append(dict(ctx.state.metrics))


class Crash(unifit.Callback):
    """A checkpoint in the middle of the second epoch, then a crash a step later (its checkpoint stays)."""

    def __init__(self) -> None:
        self.saved_at: int | None = None

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        step, per_epoch = ctx.progress.optimizer_step, ctx.progress.steps_per_epoch
        if self.saved_at is None and step == per_epoch + max(1, per_epoch // 2):
            ctx.save_checkpoint()
            self.saved_at = step
        elif self.saved_at is not None and step > self.saved_at:
            raise SimulatedCrash(f"crashed at step {step} after a checkpoint at step {self.saved_at}")


class SimulatedCrash(RuntimeError):
    pass
