"""trainer.max_time: stop once training has run that long, as Lightning's Timer does.

Wall time counts across resumes (it is kept in the checkpoint). The ranks agree every
preemption.check_every_n_steps optimizer steps, with one all-reduce then and none in between
(any rank over the limit stops them all), so every rank stops after the same step. The stop is
an early end of the epoch: validated, checkpointed, then the fit ends normally.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from unifit.loop.callback import Callback


class TimeLimit(Callback):
    def __init__(self, seconds: float, every: int) -> None:
        self.seconds, self.every = seconds, every
        self._before = 0.0  # trained before a resume
        self._started = time.monotonic()

    def on_fit_start(self, ctx: Any) -> None:
        self._started = time.monotonic() - self._before

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        if not ctx.passed_step(self.every):
            return
        over = np.array([float(self.elapsed() >= self.seconds)])
        if ctx.world_size > 1:
            over = ctx.all_reduce_max(over)
        if over[0]:
            ctx.state.request_stop(f"max_time={self.seconds:g}s reached")

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed_s": self.elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._before = float(state.get("elapsed_s", 0.0))
