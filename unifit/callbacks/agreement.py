"""Stops that one rank's own code asks for (a LightningModule or Lightning callback setting trainer.should_stop, a
Keras callback setting model.stop_training) become every rank's at points every rank reaches, so that no rank
leaves the training loop alone while the others wait for it at the next collective."""

from __future__ import annotations

from typing import Any

import numpy as np


def agree_on_asked_stop(ctx: Any) -> None:
    """Every rank calls this at the same point: one tiny all-reduce; a stop any rank asked for stops them all."""
    if ctx.world_size == 1:
        return
    asked = ctx.state.stop_asked
    if ctx.all_reduce_max(np.array([1.0 if asked else 0.0]))[0]:
        ctx.state.request_stop(asked or "another rank's code asked to stop (trainer.should_stop, model.stop_training)")
