"""Progress on rank 0: one summary line per epoch always, a tqdm bar only on a terminal."""

from __future__ import annotations

import sys
from typing import Any

from unifit.callbacks.base import Callback


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


class EpochSummary(Callback):
    """Plain lines (fit as logs): the set-up, each epoch's averaged metrics, the final metrics."""

    rank_zero_only = True

    def on_setup(self, ctx: Any) -> None:
        cfg = ctx.config
        print(f"unifit: strategy {cfg.strategy}, world size {ctx.world_size}, "
              f"global batch {ctx.global_batch}, "
              f"{ctx.batches_per_epoch} batches/epoch per rank", flush=True)

    def on_epoch_end(self, ctx: Any) -> None:
        print(f"epoch {ctx.state.epoch}/{ctx.config.max_epochs}  step {ctx.state.global_step}  "
              f"{format_metrics(ctx.state.metrics)}", flush=True)

    def on_fit_end(self, ctx: Any) -> None:
        print(f"final metrics: {format_metrics(ctx.state.metrics)}", flush=True)


class ProgressBar(Callback):
    """A tqdm bar per epoch; only added when stderr is a terminal (see `wanted`)."""

    rank_zero_only = True

    def __init__(self, refresh_every_n_steps: int = 20) -> None:
        self.every = refresh_every_n_steps
        self._bar: Any = None

    @staticmethod
    def wanted(enabled: bool) -> bool:
        return enabled and sys.stderr.isatty()

    def on_train_epoch_start(self, ctx: Any) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=ctx.batches_per_epoch, desc=f"epoch {ctx.state.epoch + 1}/{ctx.config.max_epochs}",
                         leave=False, dynamic_ncols=True)

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        self._bar.update(1)
        if batch_idx % self.every == 0:
            self._bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)

    def on_train_epoch_end(self, ctx: Any) -> None:
        self._close()

    def on_teardown(self, ctx: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
