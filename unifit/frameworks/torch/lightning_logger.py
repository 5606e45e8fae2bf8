"""`trainer.logger` / `self.logger` for Lightning code run by unifit: the surface of Lightning's TensorBoardLogger.

Rank 0 writes into the run's TensorBoard directory (its own event file beside unifit's, synced to S3 with
them); `experiment` is TensorBoard's own `SummaryWriter`, so unchanged code that calls
`self.logger.experiment.add_image(...)` or `add_histogram(...)` works. On the other ranks every call is a
no-op, as Lightning's `rank_zero_only` loggers are.
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

log = logging.getLogger("unifit")


class _NoOp:
    """What `experiment` is on ranks other than 0: every attribute a method that does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class TensorBoardView:
    name = "tensorboard"
    version = 0

    def __init__(self, log_dir: str | None, writes: bool) -> None:
        self._log_dir = log_dir
        self._writes = writes
        self._writer: Any = None

    @property
    def save_dir(self) -> str | None:
        return self._log_dir

    @property
    def log_dir(self) -> str | None:
        return self._log_dir

    @property
    def experiment(self) -> Any:
        if not self._writes:
            return _NoOp()
        if self._writer is None:
            from unifit._imports import tensorboard_without_tensorflow

            tensorboard_without_tensorflow()
            from torch.utils.tensorboard import SummaryWriter

            if self._log_dir is None:  # root_dir is a URL and no local log_dir was given
                self._log_dir = tempfile.mkdtemp(prefix="unifit-logger-")
                log.warning("trainer.logger writes to %s (set trainer.tensorboard.log_dir to keep it)", self._log_dir)
            self._writer = SummaryWriter(self._log_dir)
        return self._writer

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if not self._writes:
            return
        for name, value in metrics.items():
            self.experiment.add_scalar(name, float(value), step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """unifit saves the resolved config with every run (config.yaml); written here as text too."""
        if self._writes:
            self.experiment.add_text("hparams", str(dict(params) if hasattr(params, "items") else params))

    def log_graph(self, model: Any, input_array: Any = None) -> None: ...

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str = "success") -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
