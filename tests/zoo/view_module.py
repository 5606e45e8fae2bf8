"""Not a zoo model: the case FSDP2 warns about, a unit whose output is a view, modified in place before
backward (`out += 1` on `self.lin(x).view(-1)`): unifit refuses it under fsdp in one line; written out of
place it trains. Run by the zoo driver's --checks."""

from __future__ import annotations

import torch

import unifit


class Flat(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(-1)


class ViewModule(unifit.TrainModule):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Flat()])
        self.head = torch.nn.Linear(1, 1)
        self.inplace = inplace

    def train_dataset(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return torch.randn(32, 4, generator=g), torch.randn(32, generator=g)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        out = self.blocks[0](x)
        if self.inplace:
            out += 1.0
        else:
            out = out + 1.0
        return self.head(out.unsqueeze(-1)).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


CHECKS = {
    "view-inplace": (lambda b: (ViewModule(inplace=True), None), False),
    "view-copy": (lambda b: (ViewModule(inplace=False), None), False),
}
