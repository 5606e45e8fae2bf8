"""A DataLoader the user built (a LightningModule's train_dataloader(), a data provider's), sharded
for this rank the way unifit shards its own: the same dataset, batch size, collate_fn, workers,
pinning and worker_init_fn; only the sampler is replaced (as Lightning does under DDP), so every
rank sees a disjoint part, reshuffled each epoch when the loader shuffled, resumable mid-epoch.

What cannot be sharded without changing what the loader means is refused in one line: a custom
sampler or batch sampler, or a batch size other than trainer.batch_size (the number unifit scales
the learning rate and counts samples by). A loader over an IterableDataset goes to iterable.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from unifit.errors import ConfigError
from unifit.frameworks.torch import iterable
from unifit.frameworks.torch.data import ResumableSampler, ShardSampler, as_dataset, val_loader


def is_loader(data: Any) -> bool:
    return isinstance(data, DataLoader)


def train_loader_from(loader: DataLoader, what: str, *, batch_size: int, world_size: int, rank: int, seed: int,
                      drop_last: bool) -> DataLoader:
    shuffle = _check(loader, what, batch_size)
    drop = drop_last or loader.drop_last
    sampler = ResumableSampler(DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank,
                                                  shuffle=shuffle, seed=seed, drop_last=drop))
    return _rebuilt(loader, sampler, drop_last=drop, generator=torch.Generator().manual_seed(seed))


def val_loader_from(loader: DataLoader, what: str, *, batch_size: int, world_size: int, rank: int) -> DataLoader:
    _check(loader, what, batch_size)
    return _rebuilt(loader, ShardSampler(len(loader.dataset), world_size, rank), drop_last=False)


def evaluation_loader(data: Any, what: str, *, batch_size: int, world_size: int, rank: int, num_workers: int,
                      pin_memory: bool) -> DataLoader:
    """This rank's disjoint part of validation, test or predict data, whatever form it came in: a
    stream, the user's DataLoader, or a dataset / arrays for unifit's own loader."""
    if iterable.is_stream(data):
        return iterable.stream_loader(data, what, batch_size=batch_size, world_size=world_size, rank=rank,
                                      train=False, limit=None, num_workers=num_workers, pin_memory=pin_memory)
    if is_loader(data):
        return val_loader_from(data, what, batch_size=batch_size, world_size=world_size, rank=rank)
    return val_loader(as_dataset(data, what), batch_size=batch_size, world_size=world_size, rank=rank,
                      num_workers=num_workers, pin_memory=pin_memory)


def _check(loader: DataLoader, what: str, batch_size: int) -> bool:
    """Whether the loader shuffles; refuses what cannot be sharded faithfully."""
    if type(loader.batch_sampler) is not BatchSampler:
        raise ConfigError(f"{what}: the DataLoader has a custom batch_sampler ({type(loader.batch_sampler).__name__}), "
                          "which unifit cannot shard over ranks; use batch_size= and shuffle= instead")
    if type(loader.sampler) not in (RandomSampler, SequentialSampler):
        raise ConfigError(f"{what}: the DataLoader has a {type(loader.sampler).__name__} sampler; unifit replaces the "
                          "sampler to shard the data over ranks (shuffle=True or False only): remove sampler=")
    if loader.batch_size != batch_size:
        raise ConfigError(f"{what}: the DataLoader's batch_size is {loader.batch_size} but trainer.batch_size is "
                          f"{batch_size}; unifit scales the learning rate and counts samples by trainer.batch_size "
                          f"(per replica): set trainer.batch_size: {loader.batch_size}, or change the DataLoader")
    return isinstance(loader.sampler, RandomSampler)


def _rebuilt(loader: DataLoader, sampler: Sampler, drop_last: bool, generator: Any = None) -> DataLoader:
    workers = loader.num_workers
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, drop_last=drop_last,
                      collate_fn=loader.collate_fn, num_workers=workers, pin_memory=loader.pin_memory,
                      worker_init_fn=loader.worker_init_fn, timeout=loader.timeout,
                      multiprocessing_context=loader.multiprocessing_context if workers else None,
                      prefetch_factor=loader.prefetch_factor if workers else None,
                      persistent_workers=workers > 0, generator=generator or loader.generator)
