"""TensorBoard event files from rank 0, optionally mirrored to S3 (or any fsspec URL) while training runs.

Scalars are written with TensorBoard's own writer and protos (no TensorFlow or torch needed), so the same
logger serves PyTorch and Keras modules. Files are written locally; with `sync_to` a background thread mirrors
them (directory_sync.py), and the writer starts a new event file past `rotate_mb`, so no upload ever re-sends a
large file. `experiment` is TensorBoard's `SummaryWriter` (torch's) on the same directory, so unchanged Lightning
code that calls `self.logger.experiment.add_image(...)` or `add_histogram(...)` works.
"""

from __future__ import annotations

import logging
import tempfile
import time
from typing import Any

from unifit._imports import require, tensorboard_without_tensorflow
from unifit.loggers.base import Logger, NoOpExperiment, RunInfo
from unifit.loggers.directory_sync import DirectorySync

log = logging.getLogger("unifit")
_RECORD_FRAMING = 16  # bytes around each event record (length, crcs)


class TensorBoardLogger(Logger):
    name = "tensorboard"
    version = 0

    def __init__(
        self,
        log_dir: str | None,
        *,
        sync_to: str | None = None,
        sync_every_s: float = 30.0,
        rotate_mb: float = 4.0,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._log_dir = log_dir
        self.rotate_bytes = int(rotate_mb * 2**20)
        self.sync_to, self.sync_every_s, self.storage_options = sync_to, sync_every_s, storage_options
        self.sync: DirectorySync | None = None
        self._events: Any = None
        self._summary_writer: Any = None
        self._bytes = 0

    @classmethod
    def from_config(cls, spec: Any, cfg: Any) -> TensorBoardLogger:
        """Its options are trainer.tensorboard's."""
        tb = cfg.tensorboard
        return cls(
            cfg.tensorboard_dir,
            sync_to=cfg.tensorboard_sync_to,
            sync_every_s=tb.sync_every_s,
            rotate_mb=tb.rotate_mb,
            storage_options=cfg.storage_options,
        )

    def start(self, run: RunInfo) -> None:
        require("tensorboard", purpose="TensorBoard logging (trainer.loggers: tensorboard)")
        super().start(run)
        if self._log_dir is None:  # root_dir is a URL: write locally, sync there
            self._log_dir = tempfile.mkdtemp(prefix="unifit-tensorboard-")
        self._open()
        if self.sync_to:
            self.sync = DirectorySync(self._log_dir, self.sync_to, self.storage_options, self.sync_every_s).start()

    def _open(self) -> None:
        tensorboard_without_tensorflow()
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._events = EventFileWriter(self._log_dir)
        self._bytes = 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not self.started:
            return
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in sorted(metrics.items())]
        event = Event(wall_time=time.time(), step=step or 0, summary=Summary(value=values))
        self._events.add_event(event)
        self._bytes += event.ByteSize() + _RECORD_FRAMING

    def epoch_end(self) -> None:
        if self._bytes >= self.rotate_bytes:
            self._events.close()  # complete: uploaded one last time, then never again
            self._open()
        else:
            self._events.flush()
        if self._summary_writer is not None:
            self._summary_writer.flush()
        if self.sync is not None:
            self.sync.request()

    def finish(self, status: str) -> None:
        """Also runs when training failed: the logs up to the failure still reach sync_to."""
        for writer in (self._events, self._summary_writer):
            if writer is not None:
                writer.close()
        self._events = self._summary_writer = None
        if self.sync is not None:
            self.sync.close()
            self.sync = None
        super().finish(status)

    @property
    def save_dir(self) -> str | None:
        return self._log_dir

    @property
    def experiment(self) -> Any:
        if not self.started:
            return NoOpExperiment()
        if self._summary_writer is None:
            tensorboard_without_tensorflow()
            from torch.utils.tensorboard import SummaryWriter

            self._summary_writer = SummaryWriter(self._log_dir)
        return self._summary_writer

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """unifit saves the resolved config with every run (config.yaml); a module's own call is written as text."""
        if self.started:
            self.experiment.add_text("hparams", str(dict(params) if hasattr(params, "items") else params))

    def save(self) -> None:
        if self._summary_writer is not None:
            self._summary_writer.flush()
