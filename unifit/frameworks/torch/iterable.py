"""An IterableDataset (a stream: no __getitem__, maybe no __len__) split over ranks and loader workers.

The stream is cut into batches of batch_size consecutive elements; batch j goes to rank j mod W, and
within a rank its m-th batch to loader worker m mod K, so every (rank, worker) pair takes disjoint
batches and the DataLoader (batch_size=None, workers served in turn) hands them over in stream order.
Each pair reads the whole stream and keeps its own batches: a dataset that can read only its part
(by file, say) should split itself instead and be given as unifit.data.FileShards.

How a training epoch ends: every rank takes the same number of full batches, len(dataset) //
batch_size // W (or trainer.limit_train_batches; without __len__ that, or max_steps' batches); the
elements after the last such batch are not used that epoch. Validation takes every batch, the last
partial one included (ranks may take one batch more or less; metrics are weighted by samples).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from unifit.errors import ConfigError


class RankBatches(IterableDataset):
    def __init__(
        self,
        stream: IterableDataset,
        *,
        batch_size: int,
        world_size: int,
        rank: int,
        collate_fn: Callable[[list[Any]], Any],
        per_epoch: int | None,
    ) -> None:
        self.stream, self.batch_size, self.world_size, self.rank = stream, batch_size, world_size, rank
        self.collate_fn = collate_fn
        self.per_epoch = per_epoch  # batches this rank takes; None: all of its batches (validation)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """The epoch for a stream that reshuffles itself (its own set_epoch), and the batches a mid-epoch
        resume skips (read and dropped: a stream cannot seek)."""
        if hasattr(self.stream, "set_epoch"):
            self.stream.set_epoch(epoch)
        self.skip = skip

    def __len__(self) -> int:
        if self.per_epoch is None:
            raise TypeError("a validation stream's length is known only once read")
        return self.per_epoch - self.skip

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        buffer: list[Any] = []
        taken = 0  # this rank's batches so far (all workers')
        for i, item in enumerate(self.stream):
            j = i // self.batch_size
            if j % self.world_size != self.rank:
                continue
            mine = (j // self.world_size - self.skip) % workers == worker  # the loader serves workers in turn
            if mine:
                buffer.append(item)
            if (i + 1) % self.batch_size == 0:  # batch j is complete
                m = j // self.world_size
                if self.per_epoch is not None and m >= self.per_epoch:
                    return
                if mine and m >= self.skip:
                    yield self.collate_fn(buffer)
                buffer, taken = [], m + 1
        if buffer and self.per_epoch is None:  # the last, partial batch (validation only)
            yield self.collate_fn(buffer)
        if self.per_epoch is not None and taken < self.per_epoch:
            raise ConfigError(
                f"the IterableDataset ended after {taken} batches on rank {self.rank}, but every rank "
                f"takes {self.per_epoch} per epoch (from its __len__ or trainer.limit_train_batches); "
                "give a stream that is as long as it says"
            )


def is_stream(data: Any) -> bool:
    dataset = data.dataset if isinstance(data, DataLoader) else data
    return isinstance(dataset, IterableDataset)


def stream_loader(
    data: Any,
    what: str,
    *,
    batch_size: int,
    world_size: int,
    rank: int,
    train: bool,
    limit: int | None,
    num_workers: int,
    pin_memory: bool,
) -> DataLoader:
    """A DataLoader over this rank's batches of a stream (given alone or in the user's DataLoader,
    whose collate_fn, workers and pinning are kept)."""
    loader = data if isinstance(data, DataLoader) else None
    stream = loader.dataset if loader is not None else data
    if loader is not None and loader.batch_size not in (None, batch_size):
        raise ConfigError(
            f"{what}: the DataLoader's batch_size is {loader.batch_size} but trainer.batch_size is "
            f"{batch_size}; set trainer.batch_size: {loader.batch_size}, or change the DataLoader"
        )
    per_epoch = None
    if train:
        try:
            per_epoch = len(stream) // batch_size // world_size
        except TypeError:
            if not limit:
                raise ConfigError(
                    f"{what}: the IterableDataset {type(stream).__name__} has no __len__, so no rank knows "
                    "where an epoch ends; set trainer.max_steps (one epoch of that many steps), "
                    "trainer.limit_train_batches (batches per rank per epoch), or give the stream a __len__"
                ) from None
            per_epoch = limit
        if limit:
            per_epoch = min(per_epoch, limit)
        if per_epoch == 0:
            raise ConfigError(
                f"{what}: {len(stream)} elements give no full batch of {batch_size} to each of "
                f"{world_size} ranks; lower trainer.batch_size"
            )
    collate = loader.collate_fn if loader is not None else default_collate
    workers = loader.num_workers if loader is not None else num_workers
    batches = RankBatches(
        stream, batch_size=batch_size, world_size=world_size, rank=rank, collate_fn=collate, per_epoch=per_epoch
    )
    return DataLoader(
        batches,
        batch_size=None,
        num_workers=workers,
        generator=torch.Generator(),
        pin_memory=loader.pin_memory if loader is not None else pin_memory,
        worker_init_fn=loader.worker_init_fn if loader is not None else None,
    )
