"""A small MLP classifier for the 8x8 digits, as a unifit TrainModule."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import unifit


class DigitsClassifier(unifit.TrainModule):
    def __init__(self, hidden: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("train/acc", (logits.argmax(1) == y).float().mean())
        return F.cross_entropy(logits, y)  # logged as train/loss, averaged over ranks

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y))
        self.log("val/acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):  # lr is the BASE lr; lr_scaling multiplies it
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
