"""A DataLoader's own sampler or batch_sampler (weighted, bucketing, custom), kept and sharded over ranks.

Each epoch the user's sampler is drawn once, under a random state seeded by (trainer.seed, epoch) and
identical on every rank (the global RNG is left as it was, so a resumed run continues exactly), and
each rank takes its disjoint share, as Lightning's DistributedSamplerWrapper does:
- a sampler of indices: positions r, r+W, ... of the epoch's index list (padded by wrapping around so
  every rank takes the same number of steps, as DistributedSampler pads);
- a batch sampler (lists of indices): whole batches, batch j to rank j mod W, so what it groups together
  (similar lengths, one class per batch, consecutive chunks) stays together; every rank takes
  len(batch_sampler) // W batches, the last (at most W-1) batches of an epoch are not used.
Evaluation takes every index or batch once (the shares may be uneven). A mid-epoch resume skips the
batches the checkpoint already saw without loading them.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Sized

import numpy as np
import torch
from torch.utils.data import Sampler

from unifit.errors import ConfigError


def _draw(sampler: Any, seed: int) -> list[Any]:
    """The sampler's epoch, drawn under a random state every rank shares (torch's, NumPy's and Python's
    global generators; their states are put back, so the training's own randomness is not moved)."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            return list(sampler)
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def _length(sampler: Any, what: str) -> int:
    if not isinstance(sampler, Sized):
        raise ConfigError(
            f"{what}: the DataLoader's {type(sampler).__name__} has no __len__, so no rank knows where an "
            "epoch ends; give it a __len__"
        )
    return len(sampler)


class ShardedUserSampler(Sampler[int]):
    """This rank's positions of the user's sampler's epoch: r, r+W, ... (training: padded to equal shares)."""

    def __init__(self, sampler: Any, what: str, *, world_size: int, rank: int, seed: int, train: bool) -> None:
        self.sampler, self.world_size, self.rank, self.seed, self.train = sampler, world_size, rank, seed, train
        self.epoch, self._skip = 0, 0
        n = _length(sampler, what)
        self.num_samples = -(-n // world_size) if train else len(range(rank, n, world_size))

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """`skip`: samples of this rank's share already trained on (a mid-epoch resume)."""
        self.epoch, self._skip = epoch, skip

    def _share(self) -> list[int]:
        drawn = _draw(self.sampler, self.seed * 1_000_003 + self.epoch)
        if self.train and len(drawn) % self.world_size:
            drawn += drawn[: self.world_size - len(drawn) % self.world_size]
        return drawn[self.rank :: self.world_size]

    @property
    def indices(self) -> list[int]:
        return self._share()

    def __iter__(self) -> Iterator[int]:
        return iter(self._share()[self._skip :])

    def __len__(self) -> int:
        return self.num_samples


class ShardedBatchSampler(Sampler[list[int]]):
    """This rank's batches of the user's batch sampler's epoch: batch j goes to rank j mod W."""

    def __init__(self, batch_sampler: Any, what: str, *, world_size: int, rank: int, seed: int, train: bool) -> None:
        self.batch_sampler, self.world_size, self.rank, self.seed, self.train = (
            batch_sampler,
            world_size,
            rank,
            seed,
            train,
        )
        self.epoch, self._skip = 0, 0
        n = _length(batch_sampler, what)
        self.num_batches = n // world_size if train else len(range(rank, n, world_size))
        if train and self.num_batches == 0:
            raise ConfigError(
                f"{what}: the DataLoader's batch sampler gives {n} batches per epoch, fewer than the "
                f"{world_size} ranks; give it more batches or use fewer ranks"
            )

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """`skip`: batches of this rank's share already trained on (a mid-epoch resume)."""
        self.epoch, self._skip = epoch, skip

    def _share(self) -> list[list[int]]:
        drawn = _draw(self.batch_sampler, self.seed * 1_000_003 + self.epoch)
        mine = drawn[self.rank :: self.world_size]
        return mine[: self.num_batches]

    @property
    def indices(self) -> list[int]:
        return [i for batch in self._share() for i in batch]

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", None)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._share()[self._skip :])

    def __len__(self) -> int:
        return self.num_batches
