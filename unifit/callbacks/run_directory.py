"""The run directory, written by rank 0: the resolved config and one JSON line per epoch."""

from __future__ import annotations

import json
from typing import Any

import fsspec

from unifit.callbacks.base import Callback


class RunDirectory(Callback):
    rank_zero_only = True

    def __init__(self, root_dir: str) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(root_dir)

    def on_setup(self, ctx: Any) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        self.fs.pipe_file(f"{self.root}/config.yaml", ctx.extra["resolved_config"].encode())
        if not ctx.extra.get("resumed_from"):
            self.fs.pipe_file(f"{self.root}/metrics.jsonl", b"")

    def on_epoch_end(self, ctx: Any) -> None:
        line = json.dumps({"epoch": ctx.state.epoch, "step": ctx.state.global_step, **ctx.state.metrics})
        with self.fs.open(f"{self.root}/metrics.jsonl", "a") as f:
            f.write(line + "\n")
