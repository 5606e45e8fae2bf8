"""A tiny PyTorch module for the soak tests: many cheap steps, nothing kept between steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import unifit


def _regression(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(n, generator=g))


class SoakModule(unifit.TrainModule):
    def __init__(self, n_train: int = 200, n_val: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.n_train, self.n_val, self.lr = n_train, n_val, lr

    def train_dataset(self):
        return _regression(self.n_train, seed=1)

    def val_dataset(self):
        return _regression(self.n_val, seed=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(1), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x).squeeze(1), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
