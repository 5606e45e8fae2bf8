"""Offline stand-in for torchvision's `datasets.MNIST` and `transforms` (torchvision is not installed here):
the same call signatures, over offline_mnist's digits.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch.utils.data
from offline_mnist import load_data


class MNIST(torch.utils.data.Dataset):
    """torchvision.datasets.MNIST's interface: (transform(image), int label) per index."""

    def __init__(self, root: str, train: bool = True, download: bool = False, transform: Callable | None = None):
        train_part, test_part = load_data()
        self.data, self.targets = train_part if train else test_part
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = self.data[index]
        return (self.transform(image) if self.transform else image), int(self.targets[index])


class Compose:
    def __init__(self, steps: list[Callable]) -> None:
        self.steps = steps

    def __call__(self, image: Any) -> Any:
        for step in self.steps:
            image = step(image)
        return image


class ToTensor:
    """uint8 HxW -> float 1xHxW in [0, 1], as torchvision's."""

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(image.astype(np.float32) / 255.0)[None]


class Normalize:
    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.mean, self.std = mean[0], std[0]

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std


datasets = SimpleNamespace(MNIST=MNIST)
transforms = SimpleNamespace(Compose=Compose, ToTensor=ToTensor, Normalize=Normalize)
