"""Precision for Keras: the dtype policy the model is built under, and loss scaling for float16.

One object per run owns everything that differs between `32-true`, `bf16-mixed` and `16-mixed`,
so the engine's compiled step reads the same for all three (the twin of strategies/torch_precision.py):

    scaled = precision.scale_loss(loss)            # x loss scale (float16), else the loss itself
    grads = training.reduce_gradients(grads)       # Horovod: every rank holds the same scale
    tf.clip_by_global_norm(grads, precision.clip_norm(clip))   # clipping scaled grads at clip x scale
    step_optimizer.apply_gradients(...)            # float16: unscale, skip on inf/NaN, adapt the scale

Mixed policies (Keras' `mixed_bfloat16` / `mixed_float16`) keep variables in float32 and compute
in the low dtype. The global policy is set only while the model is built (layers keep the policy
they were created with) and restored afterwards, so nothing leaks into a later fit in the process.
The model's floating outputs are cast to float32, so losses and metrics are computed in float32,
as Keras' mixed precision guide asks of the last layer.

Loss scaling is Keras' LossScaleOptimizer with one change: whether the gradients are finite is
decided over every replica of every worker (one scalar all-reduce). Keras' own check reads the
first local replica only, which under MirroredStrategy applies another replica's inf to the
weights, and under MultiWorkerMirroredStrategy lets workers take different branches (one applies,
with an all-reduce inside, while the other skips: a hang). Under Horovod the gradients are
averaged before the optimizer sees them, so every rank already decides the same.
The scale and its growth counter are saved in the checkpoint's state.json (engine.precision).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, ContextManager

import keras
import tensorflow as tf

_PLAIN = contextlib.nullcontext()


class Precision:
    """Full precision: the user's policy (float32 unless they set another), nothing scaled."""

    name = "32-true"
    policy: str | None = None

    def building(self) -> ContextManager[Any]:
        """Context for building the model (and its variables)."""
        return _PLAIN

    def prepare_model(self, model: Any) -> Any:
        return model

    def step_optimizer(self, optimizer: Any) -> Any:
        """The optimizer the compiled step applies gradients with (the user's, or a wrapper around it)."""
        return optimizer

    def scale_loss(self, loss: Any) -> Any:
        return loss

    def clip_norm(self, clip: float) -> Any:
        """Gradient-norm threshold in the gradients' scale."""
        return clip

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class MixedPrecision(Precision):
    """A Keras mixed policy while building; float32 outputs; float16 adds dynamic loss scaling."""

    def __init__(self, name: str, policy: str) -> None:
        self.name, self.policy = name, policy
        self.loss_scaler: GlobalLossScaleOptimizer | None = None

    @contextlib.contextmanager
    def building(self) -> Any:
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(self.policy)
        try:
            yield
        finally:
            keras.config.set_dtype_policy(previous)

    def prepare_model(self, model: Any) -> Any:
        return float32_outputs(model)

    def step_optimizer(self, optimizer: Any) -> Any:
        if self.policy != "mixed_float16":
            return optimizer  # bfloat16 has float32's range: no loss scaling
        self.loss_scaler = GlobalLossScaleOptimizer(optimizer)
        return self.loss_scaler

    def scale_loss(self, loss: Any) -> Any:
        return loss if self.loss_scaler is None else self.loss_scaler.scale_loss(loss)

    def clip_norm(self, clip: float) -> Any:
        # a power-of-two scale is exact: norm(s*g) = s*norm(g), so clipping s*g at s*clip is
        # clipping g at clip, and the LossScaleOptimizer's unscaling follows
        return clip if self.loss_scaler is None else clip * self.loss_scaler.dynamic_scale

    def state_dict(self) -> dict[str, Any]:
        if self.loss_scaler is None:
            return {}
        return {
            "loss_scale": float(self.loss_scaler.dynamic_scale.numpy()),
            "good_steps": int(self.loss_scaler.step_counter.numpy()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.loss_scaler is not None and "loss_scale" in state:
            self.loss_scaler.dynamic_scale.assign(float(state["loss_scale"]))
            self.loss_scaler.step_counter.assign(int(state["good_steps"]))


class GlobalLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """keras.optimizers.LossScaleOptimizer whose skip decision is the same on every replica and worker."""

    def check_finite(self, grads: list[Any]) -> Any:
        finite = super().check_finite(grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        overflowed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(overflowed, 0.0)


def float32_outputs(model: Any) -> Any:
    """Make `model(...)` return its floating outputs in float32 (layers keep their compute dtype)."""
    call = model.call

    @functools.wraps(call)
    def call_in_float32(*args: Any, **kwargs: Any) -> Any:
        return tf.nest.map_structure(_to_float32, call(*args, **kwargs))

    model.call = call_in_float32
    return model


def _to_float32(value: Any) -> Any:
    dtype = getattr(value, "dtype", None)
    if dtype is not None and tf.as_dtype(dtype).is_floating and tf.as_dtype(dtype) != tf.float32:
        return tf.cast(value, tf.float32)
    return value


_POLICIES = {"bf16-mixed": "mixed_bfloat16", "16-mixed": "mixed_float16"}


def make_precision(name: str) -> Precision:
    """The Precision for `trainer.precision` (the config schema has already checked the name)."""
    return Precision() if name == "32-true" else MixedPrecision(name, _POLICIES[name])
