"""Count the host synchronisations a steady-state training step makes: every call of a tensor's
.item(), .cpu(), .tolist(), .numpy() or its conversion to a Python bool/int/float, by who made it.

On a GPU each of these waits for the device queue to drain; on CPU they cost nothing, which is why
they hide there. HostSyncCounter wraps them from the start of training batch `first` of epoch
`epoch` to the start of batch `last` (the steps, their callbacks and the loading of the next batches
in between), and writes host_sync_<rank>.json: the calls per caller module, made on the thread that runs the
steps (a background thread, such as the one committing the previous epoch's checkpoint, is not the step's). With `cuda_error_mode`
it also runs that window under torch.cuda.set_sync_debug_mode("error"), which raises on any sync the
CUDA runtime sees, whoever makes it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

import unifit
from tests.probe.soak_torch import _regression as regression

WATCHED = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostSyncCounter(unifit.Callback):
    def __init__(self, out_dir: str, epoch: int = 1, first: int = 2, last: int = 10, cuda_error_mode: bool = False):
        self.out_dir, self.epoch, self.first, self.last = out_dir, epoch, first, last
        self.cuda_error_mode = cuda_error_mode
        self.calls: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}
        self._steps = 0

    def on_train_batch_start(self, ctx, batch, batch_idx) -> None:
        if ctx.state.epoch != self.epoch:
            return
        if batch_idx == self.first:
            self._watch()
        elif batch_idx == self.last:
            self._unwatch()
        if self.first <= batch_idx < self.last:
            self._steps += 1

    def on_train_epoch_end(self, ctx) -> None:
        self._unwatch()

    def on_fit_end(self, ctx) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        report = {"rank": ctx.rank, "steps": self._steps, "calls": dict(self.calls)}
        with open(os.path.join(self.out_dir, f"host_sync_{ctx.rank}.json"), "w") as f:
            json.dump(report, f)

    def _watch(self) -> None:
        for name in WATCHED:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counting(name, original))
        if self.cuda_error_mode:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

    def _unwatch(self) -> None:
        if self.cuda_error_mode and self._saved:
            torch.cuda.set_sync_debug_mode("default")
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}

    def _counting(self, name: str, original: Any) -> Any:
        calls = self.calls
        stepping = threading.get_ident()  # the thread that runs the steps

        def counted(tensor, *args, **kwargs):
            if threading.get_ident() != stepping:  # the previous epoch's checkpoint being written meanwhile
                return original(tensor, *args, **kwargs)
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "?")
            calls[f"{module}:{caller.f_code.co_name}:{caller.f_lineno} .{name}"] += 1
            return original(tensor, *args, **kwargs)

        return counted


class SyncFreeModule(unifit.TrainModule):
    """What a user writes: in-memory tensors, a loss, a metric logged per step and per epoch."""

    def __init__(self, n_train: int = 512, n_val: int = 64, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused  # AdamW(fused=True): takes float16's overflow flag on the device
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.n_train, self.n_val = n_train, n_val

    def train_dataset(self):
        return regression(self.n_train, seed=1)

    def val_dataset(self):
        return regression(self.n_val, seed=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x).squeeze(1)
        loss = F.mse_loss(out, y)
        self.log("train/mae", (out - y).abs().mean(), on_step=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x).squeeze(1), y))

    def configure_optimizers(self):
        if self.fused:
            return torch.optim.AdamW(self.parameters(), lr=0.001, fused=True)
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
