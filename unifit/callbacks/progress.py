"""Progress on rank 0: a tqdm bar when attached to a terminal, one line per epoch always."""

from __future__ import annotations

import sys
from typing import Any

from unifit.callbacks.base import Callback


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


class ProgressBar(Callback):
    rank_zero_only = True

    def __init__(self, enabled: bool = True, refresh_every_n_steps: int = 20) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.every = refresh_every_n_steps
        self._bar: Any = None

    def on_setup(self, ctx: Any) -> None:
        print(f"unifit: strategy {ctx.config.strategy}, world size {ctx.world_size}, "
              f"global batch {ctx.config.batch_size * ctx.world_size * ctx.config.accumulate_grad_batches}, "
              f"{ctx.batches_per_epoch} batches/epoch per rank", flush=True)

    def on_train_epoch_start(self, ctx: Any) -> None:
        if self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=ctx.batches_per_epoch, desc=f"epoch {ctx.state.epoch + 1}/{ctx.config.max_epochs}",
                             leave=False, dynamic_ncols=True)

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.update(1)
        if batch_idx % self.every == 0:
            bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)

    def on_train_epoch_end(self, ctx: Any) -> None:
        self._close()

    def on_epoch_end(self, ctx: Any) -> None:
        print(f"epoch {ctx.state.epoch}/{ctx.config.max_epochs}  step {ctx.state.global_step}  "
              f"{format_metrics(ctx.state.metrics)}", flush=True)

    def on_fit_end(self, ctx: Any) -> None:
        print(f"final metrics: {format_metrics(ctx.state.metrics)}", flush=True)

    def on_teardown(self, ctx: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
