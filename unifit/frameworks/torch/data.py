"""Turn what a module provides into per-rank DataLoaders: sharded, reseeded every epoch."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from unifit.errors import ConfigError
from unifit.frameworks.torch.input_path import GatheredTensors, batched, gathered


def as_dataset(data: Any, what: str) -> Dataset:
    """Accept a torch Dataset, or a tuple/list of arrays or tensors (float64 becomes float32)."""
    if isinstance(data, Dataset):
        return data
    if isinstance(data, (tuple, list)) and data and all(hasattr(a, "__len__") for a in data):
        tensors = [_to_tensor(a) for a in data]
        lengths = {len(t) for t in tensors}
        if len(lengths) != 1:
            raise ConfigError(f"{what}: arrays have different lengths {sorted(lengths)}; give arrays of equal length")
        return TensorDataset(*tensors)
    raise ConfigError(f"{what}: received {type(data).__name__}; return a torch Dataset or a tuple of arrays (x, y)")


def _to_tensor(array: Any) -> torch.Tensor:
    tensor = array if isinstance(array, torch.Tensor) else torch.as_tensor(np.asarray(array))
    return tensor.float() if tensor.dtype == torch.float64 else tensor


class ShardSampler(Sampler[int]):
    """Rank r takes indices r, r+W, r+2W, ... in order: disjoint, covering, no padding.

    Used for validation, where padding would count samples twice; the shards may be uneven,
    which the sample-weighted metric average handles exactly.
    """

    def __init__(self, length: int, num_replicas: int, rank: int) -> None:
        self.indices = list(range(rank, length, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableSampler(Sampler[int]):
    """A DistributedSampler whose next epoch can start past the samples a checkpoint already saw:
    they are skipped as indices, never loaded, so a mid-epoch resume continues with the same batches."""

    def __init__(self, sampler: DistributedSampler) -> None:
        self.sampler = sampler
        self._skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self._skip = skip

    def __iter__(self) -> Iterator[int]:
        indices = iter(self.sampler)
        for _ in range(self._skip):
            next(indices, None)
        return indices

    def __len__(self) -> int:
        return len(self.sampler)


def train_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    world_size: int,
    rank: int,
    seed: int,
    drop_last: bool,
    num_workers: int,
    pin_memory: bool,
) -> DataLoader:
    """Each rank sees a disjoint 1/W of every epoch (torch pads the last shard to equal length,
    so every rank takes the same number of steps); call `.sampler.set_epoch(e, skip)` each epoch.
    The loader draws its worker seeds from its own generator, so iterating never moves the global
    RNG: a resumed run's dropout continues exactly where the checkpoint left it."""
    sampler = ResumableSampler(
        DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
    )
    dataset = gathered(dataset)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=batched if isinstance(dataset, GatheredTensors) else None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )


def val_loader(
    dataset: Dataset, *, batch_size: int, world_size: int, rank: int, num_workers: int, pin_memory: bool
) -> DataLoader:
    sampler = ShardSampler(len(dataset), world_size, rank)
    dataset = gathered(dataset)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=batched if isinstance(dataset, GatheredTensors) else None,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


def batch_sizes(loader: DataLoader, batches: int) -> tuple[int, int]:
    """Samples in each of the first `batches` batches of a train_loader: (every batch but the last,
    the last), from its sampler's length, so a step need not look into its batch."""
    size, length = loader.batch_size, len(loader.sampler)
    if loader.drop_last or batches < len(loader):
        return size, size
    return size, length - size * (len(loader) - 1)


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (tensor, tuple/list or dict)."""
    while True:
        if isinstance(batch, torch.Tensor):
            return batch.shape[0] if batch.dim() else 1
        if isinstance(batch, (tuple, list)) and batch:
            batch = batch[0]
        elif isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        else:
            return 1
