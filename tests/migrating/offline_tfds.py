"""Offline stand-in for `tensorflow_datasets.load(name='mnist', with_info=True, as_supervised=True)` (no download
in CI): offline_mnist's digits as tfds gives MNIST, (28, 28, 1) uint8 images and int64 labels, with `info.splits`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from offline_mnist import load_data


def load(name: str, with_info: bool = False, as_supervised: bool = False) -> Any:
    import tensorflow as tf

    assert name == "mnist" and as_supervised, "only what the tutorials here call"
    splits = dict(zip(("train", "test"), load_data()))
    datasets = {
        split: tf.data.Dataset.from_tensor_slices((images[..., None], labels.astype("int64")))
        for split, (images, labels) in splits.items()
    }
    info = SimpleNamespace(splits={split: SimpleNamespace(num_examples=len(y)) for split, (_, y) in splits.items()})
    return (datasets, info) if with_info else datasets
