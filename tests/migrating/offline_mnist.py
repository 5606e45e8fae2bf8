"""Offline stand-in for the MNIST downloads of the public scripts in this folder (no network in CI).

sklearn's embedded digits (1,797 8x8 images, 0..16) scaled x3 and padded to MNIST's 28x28 uint8, split
1,200 train / 596 test (even, so 2 ranks shard the test set without padding): the same shapes and dtypes as
`tf.keras.datasets.mnist.load_data` (which `load_data` replaces); torchvision's MNIST is offline_torchvision.py.
"""

from __future__ import annotations

import numpy as np

N_TRAIN = 1200


def load_data(path: str = "mnist.npz") -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((x_train, y_train), (x_test, y_test)): uint8 (N, 28, 28) images and uint8 labels, as Keras' MNIST."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.kron(digits.images, np.ones((3, 3))) * (255.0 / 16.0)  # 8x8 -> 24x24, 0..255
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))).round().astype(np.uint8)[:1796]
    labels = digits.target.astype(np.uint8)[:1796]
    return (images[:N_TRAIN], labels[:N_TRAIN]), (images[N_TRAIN:], labels[N_TRAIN:])
