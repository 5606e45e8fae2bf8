"""A small conv classifier that records, on each rank, where and in which dtype it computed."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import unifit


class GpuProbe(unifit.TrainModule):
    def __init__(self, n_train: int = 512, n_val: int = 128, lr: float = 0.05, nan_at_step: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(4),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 16, 10),
        )
        self.n_train, self.n_val, self.lr = n_train, n_val, lr
        self.facts: dict[str, str] = {}
        self.nan_at_step, self._steps = nan_at_step, 0

    def _data(self, n: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(0, 10, (n,), generator=g)
        x = torch.randn(n, 3, 16, 16, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float() / 5  # learnable
        return TensorDataset(x, y)

    def train_dataset(self):
        return self._data(self.n_train, 1)

    def val_dataset(self):
        return self._data(self.n_val, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.facts.update(
            batch_device=str(x.device), logits_dtype=str(logits.dtype), param_device=str(next(self.parameters()).device)
        )
        self._steps += 1
        loss = F.cross_entropy(logits.float(), y)
        return loss * float("nan") if self._steps == self.nan_at_step else loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val/loss", F.cross_entropy(logits.float(), y))
        self.log("val/acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class GpuReport(unifit.Callback):
    """report_<rank>.json: the module's facts, backend, metrics and a weights sum."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, ctx) -> None:

        report = {
            **ctx.module.facts,
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "metrics": ctx.state.metrics,
            "global_step": ctx.state.global_step,
            "weights_sum": _weights_sum(ctx.module),
            "max_memory_allocated": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
        }
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"report_{ctx.rank}.json"), "w") as f:
            json.dump(report, f)


def _weights_sum(module: torch.nn.Module) -> float:
    """The sum of every weight; fsdp's shards summed where they are and the sums gathered as objects (every rank
    calls this). Not DTensor.full_tensor(): over gloo on CUDA tensors (share_gpus) its all-gather crashes the
    process (pytorch#152645)."""
    whole, sharded = 0.0, 0.0
    for p in module.parameters():
        if hasattr(p, "to_local"):
            sharded += p.to_local().detach().double().sum().item()
        else:
            whole += p.detach().double().sum().item()
    if sharded and dist.is_initialized():
        sums: list = [None] * dist.get_world_size()
        dist.all_gather_object(sums, sharded)
        sharded = sum(sums)
    return whole + sharded
