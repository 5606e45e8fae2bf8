"""What a KerasModule's data methods return, as NumPy arrays (the engine shards and batches them)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from unifit.errors import ConfigError


def arrays(data: Any, what: str) -> tuple[np.ndarray, ...]:
    """(x, y) arrays; a finite, unbatched tf.data.Dataset of (x, y) is read into arrays once."""
    if isinstance(data, tf.data.Dataset):
        data = tuple(np.stack(column) for column in zip(*data.as_numpy_iterator()))
    if isinstance(data, (tuple, list)) and len(data) > 2:
        raise ConfigError(f"{what}: received {len(data)} arrays (x, y, sample weights?); unifit's Keras engine reads "
                          "(x, y) only and would ignore the rest: sample weights are not supported yet — drop them, "
                          "or weight the per-example losses in loss()")
    if isinstance(data, (tuple, list)) and len(data) >= 2:
        result = tuple(np.asarray(a) for a in data)
        result = tuple(a.astype(np.float32) if a.dtype == np.float64 else a for a in result)
        if len({len(a) for a in result}) != 1:
            raise ConfigError(f"{what}: arrays have different lengths {[len(a) for a in result]}; give arrays of equal length")
        return result
    raise ConfigError(f"{what}: received {type(data).__name__}; return a tuple of arrays (x, y) or a tf.data.Dataset of (x, y)")
