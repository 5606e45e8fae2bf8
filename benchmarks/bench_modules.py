"""The classifier every overhead benchmark trains, written once per framework: a network and a
dataset in, cross-entropy and SGD (lr 0.01, momentum 0.9) as the hand-written loops use them."""

from __future__ import annotations

from typing import Any


def unifit_classifier(net: Any, dataset: Any) -> Any:
    import torch
    import torch.nn.functional as F

    import unifit

    class Classifier(unifit.TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def train_dataset(self) -> Any:
            return dataset

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return Classifier()


def lightning_classifier(net: Any) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return Classifier()
