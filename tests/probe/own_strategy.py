"""A strategy of a user's own that extends no registered strategy: one file, no registry row. It names
its training part per framework and its launcher, and counts the collectives the loop asks of it."""

from __future__ import annotations

from typing import Any

import numpy as np

from unifit.strategies.base import Strategy
from unifit.strategies.torch_training import TorchTraining


class CountingTorchTraining(TorchTraining):
    """The plain torch part, counting optimizer steps."""

    steps = 0

    def optimizer_step(self, optimizer: Any, module: Any, clip_val: float | None) -> None:
        type(self).steps += 1
        super().optimizer_step(optimizer, module, clip_val)


class OneProcessOfMyOwn(Strategy):
    """One process; its torch training part named below."""

    name = "one-process-of-my-own"
    launcher = "unifit.strategies.launchers.base:SingleProcessLauncher"
    trainings = {"torch": "tests.probe.own_strategy:CountingTorchTraining"}
    reductions = 0

    def attach(self, training: Any) -> None:
        self.training = training

    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        type(self).reductions += 1
        return values


class TrainsNothing(Strategy):
    name = "trains-nothing"
