"""The LR policy (frameworks/lr_policy.py) as a Keras schedule: the user's rate or schedule, scaled,
with the gradual warmup ramp, evaluated at the optimizer's step inside the compiled step; and what a
Keras callback's `model.optimizer.learning_rate = x` (ReduceLROnPlateau, LearningRateScheduler) changes."""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from unifit.errors import ConfigError
from unifit.frameworks.lr_policy import LRPolicy


class ScaledWarmup(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, base: Any, factor: float, warmup_steps: int) -> None:
        self.base, self.factor, self.warmup_steps = base, float(factor), int(warmup_steps)
        # what callbacks setting the learning rate multiply the whole schedule by (LearningRateControl)
        self.scale = tf.Variable(1.0, trainable=False, dtype=tf.float32, name="lr_scale")

    def __call__(self, step: Any) -> Any:
        step = tf.cast(step, tf.float32)
        base = self.base(step) if callable(self.base) else tf.constant(self.base, tf.float32)
        base = base * tf.cast(self.scale, base.dtype)
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


class LearningRateControl:
    """`model.optimizer.learning_rate` as Keras callbacks read and set it: the rate of the next step, and setting
    it scales the whole schedule (the user's, LR scaling, warmup) so that the next step takes that rate, as
    `optimizer.learning_rate = x` does in model.fit (where the rate is a constant)."""

    def __init__(self, schedule: ScaledWarmup, step: Callable[[], int]) -> None:
        self.schedule, self.step = schedule, step

    def get(self) -> float:
        return float(self.schedule(self.step()))

    def set(self, value: float) -> None:
        current = self.get()
        if current <= 0:
            raise ConfigError(
                f"model.optimizer.learning_rate = {value}: the current rate is {current}, not a rate to scale"
            )
        self.schedule.scale.assign(float(self.schedule.scale.numpy()) * float(value) / current)

    @property
    def scale(self) -> float:
        return float(self.schedule.scale.numpy())

    @scale.setter
    def scale(self, value: float) -> None:
        self.schedule.scale.assign(float(value))


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
