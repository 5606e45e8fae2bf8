"""The pieces benchmarks/lr_parity.py trains besides the digits example: a synthetic teacher task
(data provider and MLP module, used by benchmarks/lr_parity.yaml) and a callback that keeps
rank 0's step losses and learning rates, for the early-training curves.

The synthetic task: x ~ N(0, I_dim); the label is the argmax of a fixed random one-hidden-layer
tanh network (the teacher, dim -> teacher_hidden -> classes). Low input dimension and plenty of
samples make it learnable but slow: a 2x128 ReLU MLP trained with SGD at batch 32 is still
gaining accuracy after 15 epochs (about 73% after 1 epoch, 83-84% after 15), unlike digits, which
is near its ceiling after a few epochs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import unifit


class TeacherData:
    """Train/validation arrays of the teacher task; identical on every rank (generated from `seed`)."""

    def __init__(
        self,
        n_train: int = 8192,
        n_val: int = 4096,
        dim: int = 8,
        teacher_hidden: int = 32,
        classes: int = 10,
        seed: int = 0,
    ) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        w1 = torch.randn(dim, teacher_hidden, generator=g) / dim**0.5
        w2 = torch.randn(teacher_hidden, classes, generator=g) / teacher_hidden**0.5
        x = torch.randn(n_train + n_val, dim, generator=g)
        y = (torch.tanh(1.5 * (x @ w1)) @ w2).argmax(1)
        x_np, y_np = x.numpy().astype(np.float32), y.numpy().astype(np.int64)
        self._train = (x_np[:n_train], y_np[:n_train])
        self._val = (x_np[n_train:], y_np[n_train:])

    def train_dataset(self) -> tuple[np.ndarray, np.ndarray]:
        return self._train

    def val_dataset(self) -> tuple[np.ndarray, np.ndarray]:
        return self._val


class MLPClassifier(unifit.TrainModule):
    """ReLU MLP, cross-entropy, SGD with momentum; `lr` is the base rate for base_batch_size."""

    def __init__(
        self,
        in_dim: int = 8,
        hidden: int = 128,
        layers: int = 2,
        classes: int = 10,
        lr: float = 0.02,
        momentum: float = 0.9,
    ) -> None:
        super().__init__()
        import torch

        blocks: list[Any] = []
        width = in_dim
        for _ in range(layers):
            blocks += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
            width = hidden
        self.net = torch.nn.Sequential(*blocks, torch.nn.Linear(width, classes))
        self.lr, self.momentum = lr, momentum

    def forward(self, x: Any) -> Any:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        import torch.nn.functional as F

        x, y = batch
        logits = self(x)
        self.log("train/acc", (logits.argmax(1) == y).float().mean())
        return F.cross_entropy(logits, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        import torch.nn.functional as F

        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y))
        self.log("val/acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self) -> Any:
        import torch

        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class StepLog(unifit.Callback):
    """Rank 0 writes <root_dir>/steps.jsonl at the end: per optimizer step its own loss (one replica's
    batch, the same size at every world size) and the lr that step used (warmup ramp included)."""

    rank_zero_only = True

    def __init__(self) -> None:
        self.rows: list[list[float]] = []

    def on_fit_start(self, ctx: Any) -> None:
        self.rows = []

    def on_train_batch_start(self, ctx: Any, batch: Any, batch_idx: int) -> None:
        self._lr = ctx.current_lrs()[0]

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        self.rows.append([float(loss), self._lr])

    def on_fit_end(self, ctx: Any) -> None:
        progress = ctx.state.progress
        out = Path(ctx.config.root_dir) / "steps.jsonl"
        out.write_text(
            json.dumps(
                {
                    "steps_per_epoch": progress.steps_per_epoch,
                    "global_batch": progress.global_batch,
                    "loss_lr": self.rows,
                }
            )
            + "\n"
        )
