"""LR scaling with the world size and gradual warmup (Goyal et al. 2017), framework-neutral.

The module's optimizer is built with *base* learning rates, meant for `base_batch_size`.
The target rate is base x factor, factor = global/base (linear), its square root (sqrt) or 1.
During warmup, optimizer step k (0-based) uses the scheduled rate x ramp(k), where the ramp
goes linearly from 1/factor (the base rate) at k = 0 to 1 (the scaled rate) at k = warmup_steps;
after warmup the user's own schedule runs on the scaled rates untouched.

A factor other than 1 changes the lr the module asked for (an unchanged LightningModule's, which Lightning never
scales): `scaling_line` says so, once at the start of each fit, on rank 0 (callbacks/progress.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from unifit.config.schema import TrainerConfig


@dataclass(frozen=True)
class LRPolicy:
    factor: float
    warmup_steps: int
    rule: str = "none"  # trainer.lr_scaling
    global_batch: int = 0
    base_batch: int = 0

    @classmethod
    def from_config(cls, cfg: TrainerConfig, world_size: int, steps_per_epoch: int | Callable[[int], int]) -> LRPolicy:
        """`steps_per_epoch`: a number, or epoch -> its optimizer steps (accumulation that changes by epoch)."""
        global_batch = cfg.batch_size * world_size * cfg.accumulation_at(0)
        base_batch = cfg.base_batch_size or cfg.batch_size
        ratio = global_batch / base_batch
        factor = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[cfg.lr_scaling]
        if cfg.warmup_steps is not None:
            warmup = cfg.warmup_steps
        elif callable(steps_per_epoch):  # the warmup epochs' own steps
            whole = int(cfg.warmup_epochs)
            warmup = math.ceil(
                sum(steps_per_epoch(epoch) for epoch in range(whole))
                + (cfg.warmup_epochs - whole) * steps_per_epoch(whole)
            )
        else:
            warmup = math.ceil(cfg.warmup_epochs * steps_per_epoch)
        return cls(factor, warmup, cfg.lr_scaling, global_batch, base_batch)

    @classmethod
    def of_fit(cls, cfg: TrainerConfig, global_batch: int, batches_per_epoch: int) -> LRPolicy:
        """The policy a fit's engine built, from what its loop knows (engines' `global_batch` is the batch size
        x replicas x the first accumulation, so the replicas follow)."""
        replicas = global_batch // (cfg.batch_size * cfg.accumulation_at(0))
        return cls.from_config(cfg, replicas, lambda epoch: math.ceil(batches_per_epoch / cfg.accumulation_at(epoch)))

    def scaling_line(self, lr_now: float | None, step: int) -> str | None:
        """What the rule does to the module's lr (None where it keeps it), from `lr_now`, the lr optimizer step
        `step` uses (scaled, and ramped during warmup): e.g. "lr 0.1 -> 0.2: lr_scaling linear for a global batch
        2x the base (128 / 64); lr_scaling: none keeps your module's"."""
        if self.factor == 1.0:
            return None
        change = f"learning rates x{self.factor:.4g}"
        if lr_now is not None:
            scaled = lr_now / self.ramp(step)
            change = f"lr {scaled / self.factor:.4g} -> {scaled:.4g}"
        if step < self.warmup_steps:
            change += f" (reached after a warmup of {self.warmup_steps} steps)"
        return (
            f"{change}: lr_scaling {self.rule} for a global batch {self.global_batch / self.base_batch:.4g}x the "
            f"base ({self.global_batch} / {self.base_batch}); lr_scaling: none keeps your module's"
        )

    def ramp(self, step: int) -> float:
        """Multiplier on the (already scaled) scheduled lr for optimizer step `step`."""
        if step >= self.warmup_steps:
            return 1.0
        return (1.0 + (self.factor - 1.0) * step / self.warmup_steps) / self.factor
