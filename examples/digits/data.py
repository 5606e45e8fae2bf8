"""The real 8x8 handwritten digits set shipped inside scikit-learn (no download)."""

from __future__ import annotations

import numpy as np


class DigitsData:
    """Train/validation split of sklearn's digits, as (x, y) arrays any framework can use.

    Pixels are scaled to [0, 1]; x has shape (n, 64), y holds the digit 0-9.
    """

    def __init__(self, val_fraction: float = 0.2, split_seed: int = 0) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = (digits.data / 16.0).astype(np.float32)
        y = digits.target.astype(np.int64)
        order = np.random.default_rng(split_seed).permutation(len(x))
        n_val = int(len(x) * val_fraction)
        self._val = (x[order[:n_val]], y[order[:n_val]])
        self._train = (x[order[n_val:]], y[order[n_val:]])

    def train_dataset(self) -> tuple[np.ndarray, np.ndarray]:
        return self._train

    def val_dataset(self) -> tuple[np.ndarray, np.ndarray]:
        return self._val
