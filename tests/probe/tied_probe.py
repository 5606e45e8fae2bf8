"""A language-model-shaped module whose output layer shares the embedding's weight (as GPT-2 ties them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import unifit


class TiedLM(unifit.TrainModule):
    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.body = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # one parameter, used by two submodules
        self.vocab = vocab

    def train_dataset(self):
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, self.vocab, (64,), generator=g), torch.randint(0, self.vocab, (64,), generator=g)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(torch.tanh(self.body(self.embed(x)))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
