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


class ProbeReport(unifit.Callback):
    """Writes report_<rank>.json at the end of fit: shards seen, weights digest, metrics."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_epoch_start(self, ctx) -> None:
        ctx.module._unifit_epoch = ctx.state.epoch

    def on_fit_end(self, ctx) -> None:
        flat = np.concatenate([w.ravel() for w in ctx.module.weights()])
        report = {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "seen": ctx.module.seen,
            "seen_by_replica": getattr(ctx.module, "seen_by_replica", {}),
            "replicas_identical": ctx.module.replicas_identical(),
            "weights_sha256": hashlib.sha256(flat.tobytes()).hexdigest(),
            "weights_sum": float(flat.sum()),
            "metrics": ctx.state.metrics,
            "global_step": ctx.state.global_step,
        }
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"report_{ctx.rank}.json"), "w") as f:
            json.dump(report, f)


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


class SaveOnRankZeroOnly(unifit.Callback):
    """The classic mistake: saving inside `if rank == 0`. It must fail, not hang."""

    def on_train_epoch_end(self, ctx) -> None:
        if ctx.rank == 0:
            ctx.save_checkpoint()


class SlowEpochs(unifit.Callback):
    """Makes each epoch last a while, so a test can act while training runs."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_epoch_end(self, ctx) -> None:
        import time

        time.sleep(self.seconds)


class SignalAt(unifit.Callback):
    """Sends `signum` to this process (rank `rank` only) after batch `batch` of the second epoch: a
    preemption notice that arrives mid-epoch on one rank."""

    def __init__(self, rank: int = 0, batch: int = 1, signum: int = 15) -> None:
        self.rank, self.batch, self.signum = rank, batch, signum

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        p = ctx.progress
        if ctx.rank == self.rank and p.epoch == 1 and p.batch_in_epoch == self.batch:
            os.kill(os.getpid(), self.signum)


class KillOnce(unifit.Callback):
    """kill -9 of rank `rank` after batch `batch` of the second epoch, the first time only (a marker
    file remembers), so a restarted job runs through."""

    def __init__(self, marker: str, rank: int = 1, batch: int = 1) -> None:
        self.marker, self.rank, self.batch = marker, rank, batch

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        p = ctx.progress
        if (
            ctx.rank == self.rank
            and p.epoch == 1
            and p.batch_in_epoch == self.batch
            and not os.path.exists(self.marker)
        ):
            open(self.marker, "w").close()
            os.kill(os.getpid(), 9)


class SlowSteps(unifit.Callback):
    """Makes every batch take a while, so a test can signal a run that is in the middle of training."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        import time

        time.sleep(self.seconds)


class StreamProbe(ProbeModule):
    """The probe with its training and validation data as streams (IterableDatasets)."""

    def train_dataset(self):
        return Stream(self.n_train, seed=1)

    def val_dataset(self):
        return Stream(self.n_val, seed=2)


class ValidationLog(unifit.Callback):
    """Writes validations_<rank>.json at the end of fit: (epoch, batch in epoch, val/loss) of every validation."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.seen = out_dir, []

    def on_validation_end(self, ctx) -> None:
        self.seen.append([ctx.progress.epoch, ctx.progress.batch_in_epoch, ctx.state.metrics["val/loss"]])

    def on_fit_end(self, ctx) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"validations_{ctx.rank}.json"), "w") as f:
            json.dump(self.seen, f)
