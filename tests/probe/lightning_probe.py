"""A LightningModule written the way Lightning users write them (nothing unifit in it), and a unifit
callback that reports what each rank ended with."""

from __future__ import annotations

import hashlib
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import unifit


class Regressor(L.LightningModule):
    """Linear-ish regression with the Lightning API surface real modules use."""

    def __init__(self, lr: float = 0.05, hidden: int = 16, n: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.calls: list[str] = []
        self.seen_at_epoch_end: list[dict] = []
        self.saved_counter = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_mse", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True, batch_size=len(x))
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log_dict({"val_mse": F.mse_loss(self(x), y)}, on_epoch=True, sync_dist=True, batch_size=len(x))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8, shuffle=False)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:20], self.y[:20]), batch_size=8)

    # ---- the module's own hooks ----------------------------------------------------------------
    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{getattr(stage, 'value', stage)}")  # Lightning passes a str enum

    def on_fit_start(self) -> None:
        self.calls.append("on_fit_start")

    def on_train_epoch_start(self) -> None:
        self.calls.append("on_train_epoch_start")

    def on_validation_epoch_end(self) -> None:
        self.calls.append("on_validation_epoch_end")

    def on_train_epoch_end(self) -> None:
        self.calls.append("on_train_epoch_end")
        self.seen_at_epoch_end.append(
            {
                "epoch": self.current_epoch,
                "step": self.global_step,
                "rank": self.global_rank,
                "world": self.trainer.world_size,
                "device": str(self.device),
            }
        )

    def on_fit_end(self) -> None:
        self.calls.append("on_fit_end")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.saved_counter += 1
        checkpoint["saved_counter"] = self.saved_counter

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.saved_counter = checkpoint["saved_counter"]


class BatchNormRegressor(Regressor):
    """Regressor with a BatchNorm layer (running statistics: StochasticWeightAveraging's extra epoch)."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )


class LightningReport(unifit.Callback):
    """report_<rank>.json at the end of fit: the weights' digest and the LightningModule's records."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, ctx) -> None:
        state = ctx.module.state_dict()
        whole = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in state.values()]  # fsdp: gathered
        flat = torch.cat([v.detach().reshape(-1).double() for v in whole])
        lm = ctx.module.lightning
        report = {
            "rank": ctx.rank,
            "keys": sorted(state),
            "weights_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "metrics": ctx.state.metrics,
            "calls": getattr(lm, "calls", []),
            "seen_at_epoch_end": getattr(lm, "seen_at_epoch_end", []),
        }
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"report_{ctx.rank}.json"), "w") as f:
            json.dump(report, f)


class OneCycleRegressor(Regressor):
    """Regressor with a OneCycleLR sized by self.trainer.estimated_stepping_batches, test/predict steps,
    and the test/predict hooks recorded."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        total = self.trainer.estimated_stepping_batches
        self.calls.append(f"estimated_stepping_batches:{total}")
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_mse", F.mse_loss(self(x), y), batch_size=len(x))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_dataloader(self):
        return self.val_dataloader()

    def on_test_start(self) -> None:
        self.calls.append("on_test_start")

    def on_test_epoch_start(self) -> None:
        self.calls.append("on_test_epoch_start")

    def on_test_batch_end(self, outputs, batch, batch_idx) -> None:
        self.calls.append(f"on_test_batch_end:{batch_idx}")

    def on_test_epoch_end(self) -> None:
        self.calls.append("on_test_epoch_end")

    def on_test_end(self) -> None:
        self.calls.append("on_test_end")

    def on_predict_start(self) -> None:
        self.calls.append("on_predict_start")

    def on_predict_batch_start(self, batch, batch_idx) -> None:
        self.calls.append(f"on_predict_batch_start:{batch_idx}")

    def on_predict_end(self) -> None:
        self.calls.append("on_predict_end")

    def teardown(self, stage: str) -> None:
        self.calls.append(f"teardown:{getattr(stage, 'value', stage)}")
