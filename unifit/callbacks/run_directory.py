"""The run directory, written by rank 0: the resolved config and one JSON line per epoch
(with `elapsed_s`, training wall time that continues across resumes, for `unifit plot`), and one per
validation inside an epoch (trainer.val_check_interval), marked `"mid_epoch": true`, with that validation's
metrics, its step and `epoch` the epochs completed before it.

Works on any fsspec location. On a local disk each epoch's line is appended (nothing is kept in
memory, so a run of many thousand epochs costs no more per epoch than its first); an object store
cannot append, so there metrics.jsonl is rewritten whole each epoch from the lines kept here.
"""

from __future__ import annotations

import json
import time
from typing import Any

from unifit.loop.callback import Callback
from unifit.loop.validations import MID_EPOCH, RecordsMidEpochValidations
from unifit.storage import filesystem


class RunDirectory(RecordsMidEpochValidations):
    rank_zero_only = True

    def __init__(self, root_dir: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, self.root = filesystem(root_dir, storage_options)
        self.lines: list[str] = []  # every line so far, where the file is rewritten whole (object stores)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self._appends = bool({"file", "local"} & set(protocols))
        self._started = 0.0

    def on_setup(self, ctx: Any) -> None:
        self._started = time.monotonic()
        self.fs.makedirs(self.root, exist_ok=True)
        self.fs.pipe_file(f"{self.root}/config.yaml", ctx.resolved_config.encode())
        if ctx.resumed_from:  # keep the lines before the checkpoint, drop any after it
            try:
                old = self.fs.cat_file(f"{self.root}/metrics.jsonl").decode().splitlines()
            except FileNotFoundError:
                old = []
            self.lines = [line for line in old if line and _before_checkpoint(json.loads(line), ctx.state)]
            before = json.loads(self.lines[-1]).get("elapsed_s", 0.0) if self.lines else 0.0
            self._started -= before
        self._write()
        if self._appends:
            self.lines = []  # on disk already: from now on each epoch's line is appended

    def on_epoch_end(self, ctx: Any) -> None:
        self._add(ctx, ctx.state.metrics)

    def on_mid_epoch_validation(self, ctx: Any, metrics: dict[str, float]) -> None:
        self._add(ctx, {MID_EPOCH: True, **metrics})

    def _add(self, ctx: Any, metrics: dict[str, Any]) -> None:
        elapsed = round(time.monotonic() - self._started, 3)
        line = json.dumps({"epoch": ctx.state.epoch, "step": ctx.state.global_step, "elapsed_s": elapsed, **metrics})
        if self._appends:
            with self.fs.open(f"{self.root}/metrics.jsonl", "a") as f:
                f.write(line + "\n")
        else:
            self.lines.append(line)
            self._write()

    def _write(self) -> None:
        self.fs.pipe_file(f"{self.root}/metrics.jsonl", "".join(line + "\n" for line in self.lines).encode())


def _before_checkpoint(record: dict[str, Any], state: Any) -> bool:
    """An epoch's line up to the checkpoint's epoch; a mid-epoch validation's up to its step."""
    return record["step"] <= state.global_step if record.get(MID_EPOCH) else record["epoch"] <= state.epoch


class ModelExport(Callback):
    """Rank 0 writes the final model to `export_dir` (e.g. SageMaker's model dir) when fit ends:
    whole, for inference in one process. Every rank takes part, since a sharded model is gathered."""

    runs_last = True

    def __init__(self, export_dir: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, self.root = filesystem(export_dir, storage_options)

    def on_fit_end(self, ctx: Any) -> None:
        files = ctx.model_files()
        if not ctx.is_global_zero:
            return
        self.fs.makedirs(self.root, exist_ok=True)
        for name, data in files.items():
            self.fs.pipe_file(f"{self.root}/{name}", data)
