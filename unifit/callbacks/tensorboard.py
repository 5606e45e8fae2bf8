"""TensorBoard scalars from rank 0: epoch metrics, plus step loss and lr every N steps.

Writes event files with TensorBoard's own writer and protos (no TensorFlow or torch needed),
so the same callback serves PyTorch and Keras modules.
"""

from __future__ import annotations

import time
from typing import Any

from unifit._imports import require
from unifit.callbacks.base import Callback


class TensorBoardLogger(Callback):
    rank_zero_only = True

    def __init__(self, log_dir: str, log_every_n_steps: int) -> None:
        self.log_dir = log_dir
        self.every = log_every_n_steps
        self._writer: Any = None
        self._next_step = log_every_n_steps

    def on_setup(self, ctx: Any) -> None:
        require("tensorboard", purpose="TensorBoard logging (trainer.tensorboard)")
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(self.log_dir)
        self._next_step = (ctx.state.global_step // self.every + 1) * self.every

    def scalars(self, values: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in sorted(values.items())])
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        step = ctx.state.global_step
        if step < self._next_step:
            return
        self._next_step = step + self.every
        self.scalars({"train/loss_step": float(loss), "lr_step": ctx.current_lrs()[0]}, step)

    def on_epoch_end(self, ctx: Any) -> None:
        self.scalars({**ctx.state.metrics, "epoch": ctx.state.epoch}, ctx.state.global_step)
        self._writer.flush()

    def on_teardown(self, ctx: Any) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
