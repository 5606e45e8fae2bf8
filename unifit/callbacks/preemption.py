"""Preemption: a notice on any rank stops every rank at the same step, with a checkpoint.

What spot instances, SLURM (`--signal=TERM@120`, `USR1` for Lightning's requeue), submitit (`USR2`), Kubernetes
pod deletion and Ctrl-C send (trainer.preemption.signals). The handler only records the signal; every
`check_every_n_steps` optimizer steps (and at each epoch end) all ranks agree with one tiny all-reduce whether
any rank got one, then each saves its part of one checkpoint. The handler that was there before unifit's (a
Python one: submitit's, which requeues the job; a user's own) is then called, as if the signal came now; then
`Preempted` is raised (exit code 128 + signal number). Restart the same command with `--ckpt-path auto` (or
`trainer.resume: auto`) and it continues from that step, mid-epoch included.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import numpy as np

from unifit.config.schema import PreemptionConfig
from unifit.errors import Preempted
from unifit.loop.callback import Callback

log = logging.getLogger("unifit")


class Preemption(Callback):
    runs_last = True  # after ModelCheckpoint: an epoch-end checkpoint already taken is not taken twice

    def __init__(self, config: PreemptionConfig, save: bool) -> None:
        self.every = config.check_every_n_steps
        self.signals = [signal.Signals[name] for name in config.signals]
        self.save = save
        self._received = 0
        self._previous: dict[int, Any] = {}

    def on_fit_start(self, ctx: Any) -> None:
        self._received = 0
        if threading.current_thread() is not threading.main_thread():
            log.info("fit() runs outside the main thread: its signals are not turned into a checkpointed stop")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        if not self._received:
            log.warning(
                "received %s: stopping at the next agreement (within %d optimizer steps) with a checkpoint",
                signal.Signals(signum).name,
                self.every,
            )
        self._received = self._received or signum

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        if ctx.passed_step(self.every):  # not on an accumulation micro-batch (no optimizer step)
            self._agree(ctx)

    def on_epoch_end(self, ctx: Any) -> None:
        self._agree(ctx)

    def _agree(self, ctx: Any) -> None:
        if ctx.world_size == 1:  # one process: its own flag is the agreement
            signum = self._received
        else:
            signum = int(ctx.all_reduce_max(np.array([float(self._received)]))[0])  # every rank, same steps
        if not signum:
            return
        name = signal.Signals(signum).name
        if self.save and not _saved_now(ctx):
            ctx.save_checkpoint()  # sets last_checkpoint on every rank (it returns the path on rank 0 only)
        path = ctx.last_checkpoint
        ctx.wait_for_checkpoints()  # committed (it commits in the background) before the chained handler requeues
        self._chain(signum)
        kept = f"checkpoint {path} is committed" if path else "no checkpoint was written"
        raise Preempted(
            f"preempted by {name} at step {ctx.progress.optimizer_step} (epoch {ctx.progress.epoch + 1}, "
            f"batch {ctx.progress.batch_in_epoch}); {kept}; run the same command with --ckpt-path auto "
            "to continue",
            signum,
        )

    def _chain(self, signum: int) -> None:
        """The handler unifit's replaced, called now that the checkpoint is committed: submitit's asks its job's
        function for a resubmission (`--ckpt-path auto`) and requeues (it may end the process there)."""
        previous = self._previous.get(signum)
        if not callable(previous) or previous is signal.default_int_handler:  # Python's own Ctrl-C: ours instead
            return
        self.on_teardown(None)  # the handlers put back first: what the chained one does is its own business
        log.info("passing %s on to the handler that was there before unifit's", signal.Signals(signum).name)
        previous(signum, None)

    def on_teardown(self, ctx: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _saved_now(ctx: Any) -> bool:
    """Whether the newest checkpoint already holds this exact point of training."""
    from unifit.checkpoint.store import checkpoint_name

    last = (ctx.last_checkpoint or "").rstrip("/").rsplit("/", 1)[-1]
    return last == checkpoint_name(ctx.progress.epoch, ctx.progress.optimizer_step)
