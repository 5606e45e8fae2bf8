"""The probes' callbacks that know no framework: each works in a torch rank and in a Keras one alike, and this file
imports neither (a Keras rank that imported torch for them would pay seconds of start-up)."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

import unifit


class ProbeReport(unifit.Callback):
    """Writes report_<rank>.json at the end of fit: shards seen, weights digest, metrics."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_epoch_start(self, ctx) -> None:
        ctx.module._unifit_epoch = ctx.state.epoch

    def on_fit_end(self, ctx) -> None:
        flat = np.concatenate([w.ravel() for w in ctx.module.weights()])
        report = {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "seen": ctx.module.seen,
            "seen_by_replica": getattr(ctx.module, "seen_by_replica", {}),
            "replicas_identical": ctx.module.replicas_identical(),
            "weights_sha256": hashlib.sha256(flat.tobytes()).hexdigest(),
            "weights_sum": float(flat.sum()),
            "metrics": ctx.state.metrics,
            "global_step": ctx.state.global_step,
        }
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"report_{ctx.rank}.json"), "w") as f:
            json.dump(report, f)


class SaveOnRankZeroOnly(unifit.Callback):
    """The classic mistake: saving inside `if rank == 0`. It must fail, not hang."""

    def on_train_epoch_end(self, ctx) -> None:
        if ctx.rank == 0:
            ctx.save_checkpoint()


class SignalAt(unifit.Callback):
    """Sends `signum` to this process (rank `rank` only) after batch `batch` of the second epoch: a
    preemption notice that arrives mid-epoch on one rank."""

    def __init__(self, rank: int = 0, batch: int = 1, signum: int = 15) -> None:
        self.rank, self.batch, self.signum = rank, batch, signum

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        p = ctx.progress
        if ctx.rank == self.rank and p.epoch == 1 and p.batch_in_epoch == self.batch:
            os.kill(os.getpid(), self.signum)


class KillOnce(unifit.Callback):
    """kill -9 of rank `rank` after batch `batch` of the second epoch, the first time only (a marker
    file remembers), so a restarted job runs through."""

    def __init__(self, marker: str, rank: int = 1, batch: int = 1) -> None:
        self.marker, self.rank, self.batch = marker, rank, batch

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        p = ctx.progress
        if (
            ctx.rank == self.rank
            and p.epoch == 1
            and p.batch_in_epoch == self.batch
            and not os.path.exists(self.marker)
        ):
            open(self.marker, "w").close()
            os.kill(os.getpid(), 9)


class SlowSteps(unifit.Callback):
    """Makes every batch take a while, so a test can signal a run that is in the middle of training."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        import time

        time.sleep(self.seconds)


class ValidationLog(unifit.Callback):
    """Writes validations_<rank>.json at the end of fit: (epoch, batch in epoch, val/loss) of every validation."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.seen = out_dir, []

    def on_validation_end(self, ctx) -> None:
        self.seen.append([ctx.progress.epoch, ctx.progress.batch_in_epoch, ctx.state.metrics["val/loss"]])

    def on_fit_end(self, ctx) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"validations_{ctx.rank}.json"), "w") as f:
            json.dump(self.seen, f)
