"""FitContext: what callbacks may see and do during a fit (a narrow, typed view, not the Trainer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from unifit.config.schema import TrainerConfig
from unifit.loop.state import Progress, TrainState


@dataclass
class FitContext:
    config: TrainerConfig
    state: TrainState
    module: Any
    rank: int
    world_size: int
    # framework-neutral abilities the Trainer hands over
    finite_probe: Callable[[Any], Callable[[], bool | None]]
    current_lrs: Callable[[], list[float]]
    all_reduce_max: Callable[[Any], Any]
    save_checkpoint: Callable[..., str | None]
    # until the checkpoints saved so far are committed (they commit on a background thread)
    wait_for_checkpoints: Callable[[], None]
    model_files: Callable[[], dict[str, bytes]]
    # what the module logged since the last reduce, reduced over the ranks (a collective: every rank calls it)
    reduce_logged: Callable[[], dict[str, float]]
    # what the module logged with on_step=True since the last call: {"<name>_step": value}, this rank's
    step_metrics: Callable[[], dict[str, Any]]
    # the run
    resolved_config: str  # the experiment as YAML, saved with the run
    last_checkpoint: str | None = None  # the newest checkpoint saved or resumed from (same on every rank)
    resumed_from: str | None = None  # the name of the checkpoint this fit resumed from
    threads: int = 1  # CPU threads each rank computes with
    # before the step call the loop last ran: optimizer steps in all, batches of the epoch (a call runs several
    # batches under Keras' steps_per_execution, so the counts may pass an interval's multiple without landing on it)
    steps_before_call: int = 0
    batches_before_call: int = 0

    @property
    def progress(self) -> Progress:
        return self.state.progress

    def passed_step(self, every: int) -> bool:
        """Whether the last step call reached a multiple of `every` optimizer steps (`step % every == 0`, where
        a call runs one step; the first call past the multiple, where it runs several)."""
        return self.progress.optimizer_step // every > self.steps_before_call // every

    def passed_batch(self, every: int) -> bool:
        """The same for the epoch's batches."""
        return self.progress.batch_in_epoch // every > self.batches_before_call // every

    @property
    def batches_per_epoch(self) -> int:
        return self.state.progress.batches_per_epoch

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over every replica of every process."""
        return self.state.progress.global_batch

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0
