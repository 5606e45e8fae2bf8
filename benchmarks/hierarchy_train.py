"""One rank of the hierarchy benchmark (started by benchmarks/hierarchy_netns.py under torchrun).

A communication-heavy model: ~8.4 M parameters (a 33.6 MB float32 gradient) and little compute.
Prints, on rank 0, a JSON line with the median step time after warm-up.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import unifit

WIDTH, STEPS, WARMUP = 2048, 8, 2


class Wide(unifit.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))

    def train_dataset(self):
        g = torch.Generator().manual_seed(0)
        return torch.randn(64 * STEPS, WIDTH, generator=g), torch.randn(64 * STEPS, WIDTH, generator=g)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.001)


class StepClock(unifit.Callback):
    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_batch_start(self, ctx, batch, batch_idx) -> None:
        self.marks.append(time.perf_counter())

    def on_train_epoch_end(self, ctx) -> None:
        self.marks.append(time.perf_counter())
        if ctx.rank == 0:
            steps = [b - a for a, b in zip(self.marks, self.marks[1:])][WARMUP:]
            print(
                json.dumps(
                    {
                        "strategy": ctx.config.strategy,
                        "world_size": ctx.world_size,
                        "median_step_s": statistics.median(steps),
                        "steps": steps,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    torch.set_num_threads(1)
    strategy = sys.argv[1]
    params = sum(p.numel() for p in Wide().parameters())
    unifit.Trainer(
        strategy=strategy,
        max_epochs=1,
        batch_size=4,
        progress_bar=False,
        lr_scaling="none",
        checkpoint={"enabled": False},
        tensorboard={"enabled": False},
        nan_guard={"enabled": False},
        root_dir=f"/tmp/unifit-hier-{strategy}",
        callbacks=[StepClock()],
        strategy_options={"bucket_cap_mb": 25},
    ).fit(Wide())
