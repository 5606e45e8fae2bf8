"""FitContext: what callbacks may see and do during a fit (a narrow view, not the Trainer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from unifit.trainer.config import TrainerConfig
from unifit.trainer.state import TrainState


@dataclass
class FitContext:
    config: TrainerConfig
    state: TrainState
    module: Any
    rank: int
    world_size: int
    batches_per_epoch: int
    global_batch: int  # samples per optimizer step over every replica of every process
    # framework-neutral abilities the Trainer hands over
    finite_probe: Callable[[Any], Callable[[], bool | None]]
    current_lrs: Callable[[], list[float]]
    all_reduce_max: Callable[[Any], Any]
    save_checkpoint: Callable[..., str | None]
    model_files: Callable[[], dict[str, bytes]]
    extra: dict[str, Any] = field(default_factory=dict)  # resumed_from, etc.

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0
