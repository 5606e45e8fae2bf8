"""TrainModule: the LightningModule-like base class for PyTorch users."""

from __future__ import annotations

from typing import Any

import torch

from unifit.errors import ConfigError
from unifit.frameworks.module import ModuleBase
from unifit.frameworks.torch.stateful import TorchmetricValue, is_torchmetric


class TrainModule(ModuleBase, torch.nn.Module):
    """Subclass it: define the network in __init__, then the steps, optimizers and data.

    - training_step(batch, batch_idx) -> loss tensor, or a dict with "loss"
      (the returned loss is logged as train/loss automatically)
    - validation_step(batch, batch_idx) -> None; log metrics with self.log
    - test_step(batch, batch_idx) -> None (Trainer.test), predict_step(batch, batch_idx) -> outputs
      with one row per sample (Trainer.predict; default: self(x) for a batch (x, ...) or x)
    - configure_optimizers() -> optimizer, or (optimizer, scheduler) with the scheduler stepped
      once per epoch, or {"optimizer": o, "lr_scheduler": s, "interval": "epoch" | "step"}
    - train_dataset() / val_dataset() / test_dataset() / predict_dataset() -> torch Dataset, tuple of
      arrays or DataLoader (sharded for you)
    """

    framework = "torch"
    engine = "unifit.frameworks.torch.engine:TorchEngine"

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)

    @property
    def state_module(self) -> torch.nn.Module:
        """The module whose state_dict() a checkpoint holds, by its parameter names: this one (an
        adapter names the module it wraps)."""
        return self

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Optional; without it validation is skipped."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        raise ConfigError(
            f"{type(self).__name__} has no test_step(batch, batch_idx); define it (log metrics with "
            "self.log, as in validation_step) to run Trainer.test"
        )

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define configure_optimizers()")

    def _detach(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach()
        return TorchmetricValue(value) if is_torchmetric(value) else value
