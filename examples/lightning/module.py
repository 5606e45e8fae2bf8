"""An ordinary LightningModule and LightningDataModule on the 8x8 digits: nothing unifit in them.

    unifit fit -c examples/lightning/exp.yaml                               # one process
    unifit launch --nproc-per-node 2 -c examples/lightning/exp.yaml         # 2 ddp ranks (torchrun)
    python -m examples.lightning.module                                     # Lightning's own Trainer, for comparison

unifit takes the classes as they are (docs/lightning.md): self.log is reduced over every rank, the
DataLoaders' samplers become per-rank shards, and trainer.batch_size must equal the DataLoaders' batch size.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.digits.data import DigitsData


class DigitsDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2) -> None:
        super().__init__()
        self.batch_size, self.val_fraction = batch_size, val_fraction

    def setup(self, stage: str) -> None:
        data = DigitsData(val_fraction=self.val_fraction, split_seed=0)
        self.train_set = TensorDataset(*(torch.from_numpy(a) for a in data.train_dataset()))
        self.val_set = TensorDataset(*(torch.from_numpy(a) for a in data.val_dataset()))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class LitDigits(L.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        steps = self.trainer.estimated_stepping_batches  # every optimizer step of the fit
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


if __name__ == "__main__":  # the same classes under Lightning's own Trainer
    L.seed_everything(0)
    L.Trainer(max_epochs=10, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False).fit(
        LitDigits(), DigitsDataModule()
    )
