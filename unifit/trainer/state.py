"""Where training stands; saved in every checkpoint and restored on resume."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed
    global_step: int = 0  # optimizer steps taken
    batch_idx: int = 0  # micro-batch index within the current epoch
    steps_per_epoch: int = 0  # optimizer steps per epoch on each rank
    metrics: dict[str, float] = field(default_factory=dict)  # last epoch's metrics, averaged over ranks
    should_stop: bool = False
    stop_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainState":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def request_stop(self, reason: str) -> None:
        self.should_stop = True
        self.stop_reason = self.stop_reason or reason
