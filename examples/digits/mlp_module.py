"""A deeper digits classifier for the sharded strategies (fsdp.yaml, model_parallel.yaml): an input
projection, residual MLP blocks (the transformer's feed-forward half), a head. Its Linear layers are
what a tensor-parallel plan splits (each block's `up` by output features, `down` by input features)
and its blocks what fsdp shards unit by unit and pipeline stages are cut between."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import unifit
from examples.digits.torch_module import DigitsClassifier


class Block(torch.nn.Module):
    def __init__(self, width: int, expansion: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, expansion * width)
        self.down = torch.nn.Linear(expansion * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(torch.nn.Module):
    def __init__(self, width: int, depth: int, expansion: int) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(64, width)
        self.blocks = torch.nn.ModuleList(Block(width, expansion) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class DigitsMLP(DigitsClassifier):
    """width 128, depth 4, expansion 4: about 0.54 M parameters (4 blocks of 2 x 128 x 512 weights). The steps are
    DigitsClassifier's; the network and the optimizer are its own."""

    def __init__(self, width: int = 128, depth: int = 4, expansion: int = 4, lr: float = 0.002) -> None:
        unifit.TrainModule.__init__(self)
        self.net = ResidualMLP(width, depth, expansion)  # the network the steps call: what the strategy splits
        self.lr = lr

    def configure_optimizers(self):  # the base lr; lr_scaling multiplies it by the data-parallel replicas
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
