"""TensorBoard scalars from rank 0: epoch metrics, plus step loss and lr every N steps.

Writes event files with TensorBoard's own writer and protos (no TensorFlow or torch needed),
so the same callback serves PyTorch and Keras modules. Files are written locally; with
`sync_to` a background thread mirrors them (see directory_sync.py), and the writer starts a
new event file past `rotate_mb` so no upload ever re-sends a large file.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from unifit._imports import require, tensorboard_without_tensorflow
from unifit.callbacks.directory_sync import DirectorySync
from unifit.loop.callback import Callback

_RECORD_FRAMING = 16  # bytes around each event record (length, crcs)


class TensorBoardLogger(Callback):
    rank_zero_only = True

    def __init__(
        self,
        log_dir: str | None,
        log_every_n_steps: int,
        *,
        sync_to: str | None = None,
        sync_every_s: float = 30.0,
        rotate_mb: float = 4.0,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.every = log_every_n_steps
        self.rotate_bytes = int(rotate_mb * 2**20)
        self.sync_to, self.sync_every_s, self.storage_options = sync_to, sync_every_s, storage_options
        self.sync: DirectorySync | None = None
        self._writer: Any = None
        self._bytes = 0
        self._next_step = log_every_n_steps

    def on_setup(self, ctx: Any) -> None:
        require("tensorboard", purpose="TensorBoard logging (trainer.tensorboard)")
        if self.log_dir is None:  # root_dir is a URL: write locally, sync there
            self.log_dir = tempfile.mkdtemp(prefix="unifit-tensorboard-")
        self._open()
        self._next_step = (ctx.state.global_step // self.every + 1) * self.every
        if self.sync_to:
            self.sync = DirectorySync(self.log_dir, self.sync_to, self.storage_options, self.sync_every_s).start()

    def _open(self) -> None:
        tensorboard_without_tensorflow()
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(self.log_dir)
        self._bytes = 0

    def scalars(self, values: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in sorted(values.items())])
        event = Event(wall_time=time.time(), step=step, summary=summary)
        self._writer.add_event(event)
        self._bytes += event.ByteSize() + _RECORD_FRAMING

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        step = ctx.state.global_step
        if step < self._next_step:
            return
        self._next_step = step + self.every
        logged = {name: float(value) for name, value in ctx.step_metrics().items()}  # self.log(..., on_step=True)
        if loss is not None:  # None: a skipped batch
            logged["train/loss_step"] = float(loss)
        self.scalars({**logged, "lr_step": ctx.current_lrs()[0]}, step)

    def on_epoch_end(self, ctx: Any) -> None:
        self.scalars({**ctx.state.metrics, "epoch": ctx.state.epoch}, ctx.state.global_step)
        if self._bytes >= self.rotate_bytes:
            self._writer.close()  # complete: uploaded one last time, then never again
            self._open()
        else:
            self._writer.flush()
        if self.sync is not None:
            self.sync.request()

    def on_teardown(self, ctx: Any) -> None:
        """Also runs when training failed: the logs up to the failure still reach sync_to."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.sync is not None:
            self.sync.close()
            self.sync = None
