"""After: plain_loop.py's model trained by unifit. The nn.Module is imported unchanged; the loop's body
became two steps, the optimizer configure_optimizers(); everything else (data loading, devices, the
epochs, validation, averaging over ranks, logging, checkpoints) is exp.yaml and unifit's.

    unifit fit -c examples/from_pytorch/exp.yaml                                     # one process
    unifit launch --nproc-per-node 2 -c examples/from_pytorch/exp.yaml --trainer.strategy ddp   # 2 ranks
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import unifit
from examples.from_pytorch.plain_loop import MLP


class DigitsModule(unifit.TrainModule):
    def __init__(self, hidden: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.model = MLP(hidden)  # the same network as the plain loop's
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):  # the inside of `for x, y in train_loader:`
        x, y = batch  # already on the device
        return F.cross_entropy(self(x), y)  # unifit does zero_grad, backward, step; logs train/loss

    def validation_step(self, batch, batch_idx):  # the inside of the validation loop
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y))  # epoch means over every rank, weighted by batch size
        self.log("val/acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):  # lr is the base (one-process) lr; lr_scaling multiplies it
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
