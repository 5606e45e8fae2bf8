"""A probe module + callback that record what each rank saw, for the strategy conformance tests."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import unifit
from unifit.strategies import environment


class Indexed(Dataset):
    """Regression samples that carry their own index, so tests can see the shards."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Stream(torch.utils.data.IterableDataset):
    """Indexed samples as a stream (no __getitem__); with __len__ unless told not to have one."""

    def __init__(self, n: int, seed: int) -> None:
        self.samples = Indexed(n, seed)

    def __iter__(self):
        return (self.samples[i] for i in range(len(self.samples)))

    def __len__(self) -> int:
        return len(self.samples)


class ProbeModule(unifit.TrainModule):
    def __init__(
        self,
        n_train: int = 64,
        n_val: int = 37,
        lr: float = 0.05,
        dropout: float = 0.2,
        nan_at_step: int | None = None,
        nan_rank: int | None = None,
        log_rank_only: str | None = None,
        save_on_rank_zero_only: bool = False,
        hidden: int = 16,
    ) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(hidden, 1)
        )
        self.n_train, self.n_val, self.lr = n_train, n_val, lr
        self.nan_at_step, self.nan_rank = nan_at_step, nan_rank
        self.log_rank_only = log_rank_only
        self.seen: dict[str, list[int]] = {}
        self.rank = environment.detect().rank  # whichever launcher started this process
        self._steps = 0

    def train_dataset(self):
        return Indexed(self.n_train, seed=1)

    def val_dataset(self):
        return Indexed(self.n_val, seed=2)

    def test_dataset(self):
        return Indexed(29, seed=3)

    def predict_dataset(self):
        return Indexed(23, seed=4)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.setdefault(f"train_epoch_{self._epoch()}", []).extend(idx.tolist())
        loss = F.mse_loss(self.net(x).squeeze(1), y)
        self._steps += 1
        if self.nan_at_step == self._steps and self.nan_rank in (None, self.rank):
            loss = loss * float("nan")
        if self.log_rank_only is not None and self.rank == 0:
            self.log(self.log_rank_only, 1.0)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.setdefault("val", []).extend(idx.tolist())
        self.log("val/loss", F.mse_loss(self.net(x).squeeze(1), y))
        self.log("val/index_mean", idx.double().mean())  # exact global value: (n_val - 1) / 2
        self.log("val/rank_plus_one", float(self.rank + 1))  # weighted by each rank's shard size

    def test_step(self, batch, batch_idx):
        x, y, idx = batch
        self.log("test/loss", F.mse_loss(self.net(x).squeeze(1), y))
        self.log("test/index_mean", idx.double().mean())  # exact global value: 14 for 29 samples

    def predict_step(self, batch, batch_idx):
        x, _, idx = batch  # each row: its dataset index, then the prediction
        return torch.stack([idx.double(), self.net(x).squeeze(1).double()], dim=1)

    def configure_optimizers(self):
        self.optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return self.optimizer

    def weights(self) -> list[np.ndarray]:
        return [_whole(p).detach().double().numpy().ravel() for p in self.parameters()]

    def replicas_identical(self) -> bool:
        return True  # one replica per process

    def _epoch(self) -> int:
        return self._unifit_epoch

    _unifit_epoch = 0


def _whole(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter sharded over the ranks (fsdp), gathered whole: every rank calls this."""
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter


class ShardReport(unifit.Callback):
    """Writes shards_<rank>.json: how many parameter and optimizer-state elements this rank holds
    (its shards under fsdp) against the whole model's, and the whole weights' digest as fit starts
    (after a resume) and ends."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.report: dict = {}

    def on_fit_start(self, ctx) -> None:
        self.report["start_sha256"] = _digest(ctx.module)

    def on_fit_end(self, ctx) -> None:
        params = list(ctx.module.parameters())
        momenta = [s["momentum_buffer"] for s in ctx.module.optimizer.state.values()]
        self.report.update(
            rank=ctx.rank,
            end_sha256=_digest(ctx.module),
            lr=ctx.module.optimizer.param_groups[0]["lr"],
            params_local=sum(_local(p).numel() for p in params),
            params_total=sum(p.numel() for p in params),
            optimizer_local=sum(_local(m).numel() for m in momenta),
            optimizer_total=sum(m.numel() for m in momenta),
        )
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"shards_{ctx.rank}.json"), "w") as f:
            json.dump(self.report, f)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _digest(module) -> str:
    flat = np.concatenate([w.ravel() for w in module.weights()])
    return hashlib.sha256(flat.tobytes()).hexdigest()


class StreamProbe(ProbeModule):
    """The probe with its training and validation data as streams (IterableDatasets)."""

    def train_dataset(self):
        return Stream(self.n_train, seed=1)

    def val_dataset(self):
        return Stream(self.n_val, seed=2)
