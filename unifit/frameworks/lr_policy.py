"""LR scaling with the world size and gradual warmup (Goyal et al. 2017), framework-neutral.

The module's optimizer is built with *base* learning rates, meant for `base_batch_size`.
The target rate is base x factor, factor = global/base (linear), its square root (sqrt) or 1.
During warmup, optimizer step k (0-based) uses the scheduled rate x ramp(k), where the ramp
goes linearly from 1/factor (the base rate) at k = 0 to 1 (the scaled rate) at k = warmup_steps;
after warmup the user's own schedule runs on the scaled rates untouched.
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

    @classmethod
    def from_config(cls, cfg: TrainerConfig, world_size: int, steps_per_epoch: int | Callable[[int], int]) -> LRPolicy:
        """`steps_per_epoch`: a number, or epoch -> its optimizer steps (accumulation that changes by epoch)."""
        global_batch = cfg.batch_size * world_size * cfg.accumulation_at(0)
        ratio = global_batch / (cfg.base_batch_size or cfg.batch_size)
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
        return cls(factor=factor, warmup_steps=warmup)

    def ramp(self, step: int) -> float:
        """Multiplier on the (already scaled) scheduled lr for optimizer step `step`."""
        if step >= self.warmup_steps:
            return 1.0
        return (1.0 + (self.factor - 1.0) * step / self.warmup_steps) / self.factor
