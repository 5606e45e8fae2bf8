"""A binary classifier that logs metrics which are not means (torchmetrics AUROC and F1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchmetrics

import unifit


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = ((x @ torch.linspace(-1, 1, 8) + 0.8 * torch.randn(n, generator=g)) > 0).float()
    return x, y


class MetricsProbe(unifit.TrainModule):
    def __init__(self, n_val: int = 37) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.n_val = n_val
        self.auroc = torchmetrics.classification.BinaryAUROC()
        self.f1 = torchmetrics.classification.BinaryF1Score()

    def train_dataset(self):
        return _data(64, seed=1)

    def val_dataset(self):
        return _data(self.n_val, seed=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.binary_cross_entropy_with_logits(self.net(x).squeeze(1), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        probs = torch.sigmoid(self.net(x).squeeze(1))
        self.auroc.update(probs, y.int())
        self.f1.update(probs, y.int())
        self.log("val/auroc", self.auroc)
        self.log("val/f1", self.f1)
        self.log("val/loss", F.binary_cross_entropy(probs, y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TrainMetricsProbe(MetricsProbe):
    """Logs a torchmetrics object during training too, so a mid-epoch checkpoint holds its state."""

    def __init__(self, n_val: int = 37) -> None:
        super().__init__(n_val)
        self.train_auroc = torchmetrics.classification.BinaryAUROC()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x).squeeze(1)
        self.train_auroc.update(torch.sigmoid(logits).detach(), y.int())
        self.log("train/auroc", self.train_auroc)
        return F.binary_cross_entropy_with_logits(logits, y)


class StopAt(unifit.Callback):
    """Raises after batch `batch` of the first epoch (in-process: a crash after a mid-epoch checkpoint)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        if ctx.progress.epoch == 0 and ctx.progress.batch_in_epoch == self.batch:
            raise RuntimeError("stopped on purpose")
