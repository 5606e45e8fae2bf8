"""The LR policy (frameworks/lr_policy.py) as a Keras schedule: the user's rate or schedule, scaled,
with the gradual warmup ramp, evaluated at the optimizer's step inside the compiled step."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from unifit.errors import ConfigError
from unifit.frameworks.lr_policy import LRPolicy


class ScaledWarmup(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, base: Any, factor: float, warmup_steps: int) -> None:
        self.base, self.factor, self.warmup_steps = base, float(factor), int(warmup_steps)

    def __call__(self, step: Any) -> Any:
        step = tf.cast(step, tf.float32)
        base = self.base(step) if callable(self.base) else tf.constant(self.base, tf.float32)
        if self.warmup_steps == 0:
            return base * self.factor
        ramp = (1.0 + (self.factor - 1.0) * step / self.warmup_steps) / self.factor
        return base * self.factor * tf.where(step < self.warmup_steps, ramp, 1.0)

    def get_config(self) -> dict[str, Any]:
        return {
            "base": self.base if not callable(self.base) else keras.saving.serialize_keras_object(self.base),
            "factor": self.factor,
            "warmup_steps": self.warmup_steps,
        }


def with_policy(optimizer: Any, policy: LRPolicy) -> tuple[Any, ScaledWarmup]:
    """A fresh optimizer like `optimizer` whose learning rate follows `policy` (base lrs are the user's)."""
    config = optimizer.get_config()
    user = getattr(optimizer, "_learning_rate", None)
    base = user if isinstance(user, keras.optimizers.schedules.LearningRateSchedule) else float(config["learning_rate"])
    if not callable(base) and base < 0:
        raise ConfigError(f"configure_optimizers(): learning_rate={base}; the learning rate must be >= 0")
    schedule = ScaledWarmup(base, policy.factor, policy.warmup_steps)
    config["learning_rate"] = schedule
    return type(optimizer).from_config(config), schedule
