"""Where training stands: loop time (Progress) and the epoch's results; saved in every checkpoint.

Progress is Composer's typed timestamp for unifit's loop: the loop alone moves it, callbacks read
it, a checkpoint stores it, so every decision that depends on "when" (checkpoint intervals,
logging, warmup, a resume) reads the same numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Progress:
    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # micro-batches of the current epoch done on each rank
    optimizer_step: int = 0  # optimizer steps taken
    samples_seen: int = 0  # training samples over all ranks in completed epochs
    global_batch: int = 0  # samples per optimizer step over every replica of every process
    batches_per_epoch: int = 0  # micro-batches per epoch on each rank
    steps_per_epoch: int = 0  # optimizer steps per epoch

    def take_sizes(self, global_batch: int, batches_per_epoch: int, accumulate: int) -> Progress:
        """This run's sizes (the engine's: they change with its batch size)."""
        self.global_batch, self.batches_per_epoch = global_batch, batches_per_epoch
        self.steps_per_epoch = -(-batches_per_epoch // accumulate)
        return self

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        return cls(**{k: int(v) for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class TrainState:
    progress: Progress = field(default_factory=Progress)
    metrics: dict[str, float] = field(default_factory=dict)  # last epoch's metrics, averaged over ranks
    should_stop: bool = False
    stop_reason: str | None = None
    stop_asked: str | None = None  # a stop one rank's own code asked for, until the ranks agree on it
    end_epoch: bool = False  # set by a batch-start hook (agreed by every rank): the epoch ends before this batch

    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return self.progress.epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps taken."""
        return self.progress.optimizer_step

    def to_dict(self) -> dict[str, Any]:
        return {"progress": self.progress.to_dict(), "metrics": dict(self.metrics)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        if "progress" in data:
            progress = Progress.from_dict(data["progress"])
        else:  # checkpoints written before Progress existed
            progress = Progress(
                epoch=int(data.get("epoch", 0)),
                optimizer_step=int(data.get("global_step", 0)),
                steps_per_epoch=int(data.get("steps_per_epoch", 0)),
            )
        return cls(progress=progress, metrics=dict(data.get("metrics", {})))

    def request_stop(self, reason: str) -> None:
        """A stop every rank decides alike (from metrics averaged over the ranks, or agreed on)."""
        self.should_stop = True
        self.stop_reason = self.stop_reason or reason

    def ask_to_stop(self, reason: str, world_size: int) -> None:
        """A stop one rank's code asks for (trainer.should_stop, model.stop_training): at once on one process; with
        several, once the ranks agree (callbacks/agreement.py), so that no rank leaves the loop alone."""
        if world_size == 1:
            self.request_stop(reason)
        else:
            self.stop_asked = self.stop_asked or reason
