"""Keras' private API (keras.src), in one place: each use named for what it does.

unifit calls Keras' own helpers where Keras has no public name for them (checked with Keras 3.15), so its compiled
losses and metrics behave as model.fit's do. A release that moves one breaks a function here, and
tests/test_tf_compat.py, which checks every name on the installed Keras, rather than a training run.
"""

from __future__ import annotations

from typing import Any

__all__ = ["same_rank", "binary_or_sparse", "metrics_list", "wrapped_function", "layers_of", "seed_generators"]


def same_rank(y: Any, y_pred: Any) -> tuple[Any, Any]:
    """Keras' rank alignment of a target and a prediction (a (N,) target against (N, 1) outputs is squeezed), as
    its Loss and MeanMetricWrapper do."""
    from keras.src.losses.loss import squeeze_or_expand_to_same_rank

    return squeeze_or_expand_to_same_rank(y, y_pred)


def binary_or_sparse(y: Any, y_pred: Any) -> tuple[bool, bool]:
    """Keras' own rule for a string loss or metric ("crossentropy", "accuracy"): binary? sparse?"""
    from keras.src.trainers.compile_utils import is_binary_or_sparse_categorical

    return is_binary_or_sparse_categorical(y, y_pred)


def metrics_list(metrics: list[Any]) -> Any:
    """The container compiled metrics sit in, as Keras' callbacks look for them (`model.metrics[...]`)."""
    from keras.src.trainers.compile_utils import MetricsList

    return MetricsList(metrics)


def wrapped_function(metric: Any) -> tuple[Any, dict[str, Any]]:
    """A MeanMetricWrapper's function and the keyword arguments it calls it with."""
    return metric._fn, dict(metric._fn_kwargs)


def layers_of(model: Any, include_self: bool) -> list[Any]:
    """Every layer inside `model`, nested ones too (what Keras walks to track weights)."""
    return list(model._flatten_layers(include_self=include_self))


def seed_generators(layer: Any) -> list[Any]:
    """A layer's own random streams (Dropout's, ...): the RNG state a checkpoint keeps besides the weights."""
    return list(getattr(layer, "_seed_generators", []))
