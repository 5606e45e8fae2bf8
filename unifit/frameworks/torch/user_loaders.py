"""A DataLoader the user built (a LightningModule's train_dataloader(), a data provider's), sharded
for this rank the way unifit shards its own: the same dataset, batch size, collate_fn, workers,
pinning and worker_init_fn; only the sampling is sharded (as Lightning does under DDP), so every
rank sees a disjoint part, reshuffled each epoch when the loader shuffled, resumable mid-epoch.

- shuffle=True / False: a DistributedSampler in its place (evaluation: positions r, r+W, ...);
- its own sampler or batch_sampler (weighted, bucketing, custom): kept and sharded by
  user_samplers.py (each rank a disjoint share of what it draws each epoch).

The batch size is the loader's: when trainer.batch_size was not set, fit adopts the training
loader's (the number unifit scales the learning rate and counts samples by); when both were set and
differ, fit is refused in one line. Evaluation loaders keep their own batch size (their metrics are
sample-weighted, so it changes nothing but the batching). A loader over an IterableDataset goes to
iterable.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from unifit.errors import ConfigError
from unifit.frameworks.torch import iterable
from unifit.frameworks.torch.data import ResumableSampler, ShardSampler, as_dataset, train_loader, val_loader
from unifit.frameworks.torch.user_samplers import ShardedBatchSampler, ShardedUserSampler


class Several(list):
    """Several loaders for one evaluation stage (a LightningModule's list of val or test dataloaders): run one
    after another, each sharded on its own, the step told which (`dataloader_idx`)."""


def each_loader(data: Any) -> list[Any]:
    return list(data) if isinstance(data, Several) else [data]


def is_loader(data: Any) -> bool:
    return isinstance(data, DataLoader)


def loader_batch_size(loader: DataLoader) -> int | None:
    """The samples per batch a DataLoader gives: its batch_size, or its batch sampler's."""
    if loader.batch_size is not None:
        return loader.batch_size
    return getattr(loader.batch_sampler, "batch_size", None)


def check_batch_size(loader: DataLoader, what: str, batch_size: int | None) -> int:
    """The batch size training uses: the loader's when trainer.batch_size was not set (None); refused
    when both were set and differ."""
    own = loader_batch_size(loader)
    if batch_size is None:
        if own is None:
            raise ConfigError(
                f"{what}: the DataLoader's batch sampler ({type(loader.batch_sampler).__name__}) has no "
                "batch_size, so unifit cannot tell the batch size to scale the learning rate by; set "
                "trainer.batch_size (samples per batch, per replica)"
            )
        return own
    if own is not None and own != batch_size:
        raise ConfigError(
            f"{what}: the DataLoader's batch_size is {own} but trainer.batch_size is {batch_size}; "
            f"unifit scales the learning rate and counts samples by the batch size (per replica): "
            f"leave trainer.batch_size unset to use the DataLoader's, set it to {own}, or change the "
            "DataLoader"
        )
    return batch_size


def train_loader_from(
    loader: DataLoader, what: str, *, world_size: int, rank: int, seed: int, drop_last: bool
) -> DataLoader:
    """This rank's training loader; call set_epoch(loader, epoch, skip_batches) each epoch."""
    if _own_batch_sampler(loader):
        batches = ShardedBatchSampler(
            loader.batch_sampler, what, world_size=world_size, rank=rank, seed=seed, train=True
        )
        return _rebuilt(loader, batch_sampler=batches, generator=torch.Generator().manual_seed(seed))
    drop = drop_last or loader.drop_last
    sampler: Sampler
    if _own_sampler(loader):
        sampler = ShardedUserSampler(loader.sampler, what, world_size=world_size, rank=rank, seed=seed, train=True)
    else:
        sampler = ResumableSampler(
            DistributedSampler(
                loader.dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=isinstance(loader.sampler, RandomSampler),
                seed=seed,
                drop_last=drop,
            )
        )
    return _rebuilt(loader, sampler=sampler, drop_last=drop, generator=torch.Generator().manual_seed(seed))


def train_loader_for(
    data: Any,
    what: str,
    *,
    batch_size: int,
    world_size: int,
    rank: int,
    seed: int,
    drop_last: bool,
    num_workers: int,
    pin_memory: bool,
) -> DataLoader:
    """This rank's training loader for map-style data: the user's DataLoader with its settings kept and its sampling
    sharded, or unifit's own loader over a dataset or arrays."""
    if is_loader(data):
        return train_loader_from(data, what, world_size=world_size, rank=rank, seed=seed, drop_last=drop_last)
    return train_loader(
        as_dataset(data, what),
        batch_size=batch_size,
        world_size=world_size,
        rank=rank,
        seed=seed,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


def set_epoch(loader: DataLoader, epoch: int, skip_batches: int) -> None:
    """Start a training loader's epoch `epoch` past its first `skip_batches` batches (never loaded; a stream's are
    read and dropped)."""
    if isinstance(loader.dataset, iterable.RankBatches):
        loader.dataset.set_epoch(epoch, skip_batches)
    elif isinstance(loader.batch_sampler, ShardedBatchSampler):
        loader.batch_sampler.set_epoch(epoch, skip_batches)
    else:
        loader.sampler.set_epoch(epoch, skip_batches * loader.batch_size)


def val_loader_from(loader: DataLoader, what: str, *, world_size: int, rank: int) -> DataLoader:
    if _own_batch_sampler(loader):
        return _rebuilt(
            loader,
            batch_sampler=ShardedBatchSampler(
                loader.batch_sampler, what, world_size=world_size, rank=rank, seed=0, train=False
            ),
        )
    sampler: Sampler = (
        ShardedUserSampler(loader.sampler, what, world_size=world_size, rank=rank, seed=0, train=False)
        if _own_sampler(loader)
        else ShardSampler(len(loader.dataset), world_size, rank)
    )
    return _rebuilt(loader, sampler=sampler, drop_last=False)


def evaluation_loader(
    data: Any, what: str, *, batch_size: int, world_size: int, rank: int, num_workers: int, pin_memory: bool
) -> DataLoader:
    """This rank's disjoint part of validation, test or predict data, whatever form it came in: a
    stream, the user's DataLoader (its own batch size), or a dataset / arrays for unifit's own loader."""
    if iterable.is_stream(data):
        own = loader_batch_size(data) if is_loader(data) else None
        return iterable.stream_loader(
            data,
            what,
            batch_size=own or batch_size,
            world_size=world_size,
            rank=rank,
            train=False,
            limit=None,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
    if is_loader(data):
        return val_loader_from(data, what, world_size=world_size, rank=rank)
    return val_loader(
        as_dataset(data, what),
        batch_size=batch_size,
        world_size=world_size,
        rank=rank,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


def shard_indices(loader: DataLoader) -> list[int]:
    """The dataset indices an evaluation loader gives this rank, in order."""
    sampling = loader.batch_sampler if isinstance(loader.batch_sampler, ShardedBatchSampler) else loader.sampler
    return list(sampling.indices)


def shard_batches(loader: DataLoader) -> list[list[int]]:
    """The dataset indices of each batch an evaluation loader gives this rank, in order (what Lightning's
    prediction writers receive as batch_indices), known from the sampling without loading anything."""
    if isinstance(loader.batch_sampler, ShardedBatchSampler):
        return [list(batch) for batch in loader.batch_sampler._share()]
    indices, size = shard_indices(loader), loader.batch_size or 1
    return [list(indices[i : i + size]) for i in range(0, len(indices), size)]


def _own_batch_sampler(loader: DataLoader) -> bool:
    return loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler


def _own_sampler(loader: DataLoader) -> bool:
    return type(loader.sampler) not in (RandomSampler, SequentialSampler)


def _rebuilt(
    loader: DataLoader,
    *,
    sampler: Sampler | None = None,
    batch_sampler: Sampler | None = None,
    drop_last: bool = False,
    generator: Any = None,
) -> DataLoader:
    workers = loader.num_workers
    batching: dict[str, Any] = (
        {"batch_sampler": batch_sampler}
        if batch_sampler is not None
        else {"batch_size": loader.batch_size, "sampler": sampler, "drop_last": drop_last}
    )
    return DataLoader(
        loader.dataset,
        **batching,
        collate_fn=loader.collate_fn,
        num_workers=workers,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
        timeout=loader.timeout,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=workers > 0,
        generator=generator or loader.generator,
    )
