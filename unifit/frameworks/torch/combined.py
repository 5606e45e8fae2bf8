"""Several loaders at once, as Lightning's CombinedLoader runs them. Training: each step gets one batch of
every loader (a list, or a dict by the names the module gave), for a LightningModule whose train_dataloader()
returns a list or dict of loaders (Lightning's default mode, "max_size_cycle") or a CombinedLoader in mode
"max_size_cycle", "min_size" or "max_size".

Each loader is sharded over the ranks on its own, exactly as a single one is (user_loaders.py; a stream of
known length is cut into batches dealt to the ranks, iterable.py), and the
combination is resumable mid-epoch: a shorter loader cycled by "max_size_cycle" restarts the same epoch's
order (as Lightning's, which re-iterates it without a new set_epoch), so the position of every loader after
`skip` steps is known without loading anything. Validation and test: a CombinedLoader in one of those modes
gives its steps combined batches the same way (CombinedEvalLoader), without a dataloader_idx, as Lightning's
evaluation loop does; the default for several evaluation loaders stays one after another (user_loaders.Several).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from unifit.errors import ConfigError
from unifit.frameworks.torch import iterable, user_loaders

MODES = ("max_size_cycle", "min_size", "max_size")


class Combined:
    """Several training loaders and how to combine them, as the module gave them (not yet sharded)."""

    def __init__(self, loaders: list[Any], keys: list[Any] | None, mode: str, what: str) -> None:
        if mode not in MODES:
            raise ConfigError(
                f"{what}: CombinedLoader(mode={mode!r}) for training; Lightning trains with "
                f"{', '.join(MODES)} (its fit loop refuses 'sequential' too): pick one of them"
            )
        self.loaders, self.keys, self.mode, self.what = loaders, keys, mode, what


class CombinedTrainLoader:
    """This rank's combination of its sharded loaders; `set_epoch(epoch, skip)` before each epoch."""

    batch_size = None  # the samples of a step are read from each combined batch (its first loader's)

    def __init__(self, combined: Combined, loaders: list[Any]) -> None:
        self.keys, self.mode = combined.keys, combined.mode
        self.loaders = loaders
        self.lengths = [len(loader) for loader in loaders]
        self.generator = _Generators([loader.generator for loader in loaders])
        self.dataset = loaders[0].dataset  # for messages: the first loader's
        self._epoch, self._skip = 0, 0

    def __len__(self) -> int:
        return min(self.lengths) if self.mode == "min_size" else max(self.lengths)

    def set_epoch(self, epoch: int, skip: int) -> None:
        """Every loader at the position it reaches after `skip` combined batches of epoch `epoch`."""
        self._epoch, self._skip = epoch, skip
        for loader, length in zip(self.loaders, self.lengths):
            offset = skip % length if self.mode == "max_size_cycle" else min(skip, length)
            user_loaders.set_epoch(loader, epoch, offset)

    def __iter__(self) -> Iterator[Any]:
        """len(self) - skip combined batches: a shorter loader cycles ("max_size_cycle") or gives None once
        it is done ("max_size"); "min_size" ends with the shortest."""
        iterators: list[Iterator[Any] | None] = [iter(loader) for loader in self.loaders]
        for _ in range(len(self) - self._skip):
            batches = []
            for i, loader in enumerate(self.loaders):
                batch = next(iterators[i], _END) if iterators[i] is not None else None
                if batch is _END:
                    if self.mode == "max_size_cycle":  # the same epoch's order again, from its start
                        user_loaders.set_epoch(loader, self._epoch, 0)
                        iterators[i] = iter(loader)
                        batch = next(iterators[i])
                    else:
                        iterators[i], batch = None, None
                batches.append(batch)
            yield dict(zip(self.keys, batches)) if self.keys is not None else batches


def shard(combined: Combined, *, seed: int, limit: int | None = None, **options: Any) -> CombinedTrainLoader:
    """Each loader sharded for this rank as a single one is (a dataset or arrays with unifit's own loader). A
    stream without __len__ is read for as many batches as the combined epoch takes (`limit`: the run's
    limit_train_batches or max_steps' batches)."""
    loaders: list[Any] = [None] * len(combined.loaders)
    endless = []
    for i, each in enumerate(combined.loaders):
        what = f"{combined.what}[{combined.keys[i] if combined.keys else i}]"
        if iterable.is_stream(each) and not _sized(each):
            endless.append((i, each, what))
            continue
        if iterable.is_stream(each):  # cut into batches dealt to the ranks, as a stream trained alone
            loaders[i] = _stream_loader(each, what, limit=None, **options)
        else:
            loaders[i] = user_loaders.train_loader_for(each, what, seed=seed + i, **options)  # train_loader_for's
        if len(loaders[i]) == 0:
            raise ConfigError(f"{what}: no batch on this rank; give it more data or a smaller batch")
    sized = [len(loader) for loader in loaders if loader is not None]
    for i, each, what in endless:  # Lightning sizes such a stream as endless: min_size ends with the others
        epoch = min(sized) if combined.mode == "min_size" and sized else None
        epoch = min(epoch, limit) if epoch and limit else epoch or limit
        if not epoch:
            raise ConfigError(
                f"{what}: an IterableDataset without __len__ among several training loaders in mode "
                f"{combined.mode!r} makes the epoch endless, as in Lightning; set trainer.max_steps (one epoch of "
                "that many steps) or trainer.limit_train_batches, or give the stream a __len__"
            )
        loaders[i] = _stream_loader(each, what, limit=epoch, **options)
    return CombinedTrainLoader(combined, loaders)


def _sized(data: Any) -> bool:
    return hasattr(data.dataset if user_loaders.is_loader(data) else data, "__len__")


def _stream_loader(data: Any, what: str, *, batch_size: int, limit: int | None, **options: Any) -> Any:
    """A stream among several loaders, read as a stream alone (`limit`: its batches per epoch, where it has
    no __len__); its own DataLoader's batch size, if it has one."""
    own = user_loaders.loader_batch_size(data) if user_loaders.is_loader(data) else None
    return iterable.stream_loader(
        data,
        what,
        batch_size=own or batch_size,
        world_size=options["world_size"],
        rank=options["rank"],
        train=True,
        limit=limit,
        num_workers=options["num_workers"],
        pin_memory=options["pin_memory"],
    )


def evaluation_loader(data: Any, what: str, **options: Any) -> Any:
    """This rank's part of one validation or test source: a Combined (Lightning's non-sequential CombinedLoader) of
    loaders each sharded as alone (user_loaders.evaluation_loader), or any other data as user_loaders makes it."""
    if not isinstance(data, Combined):
        return user_loaders.evaluation_loader(data, what, **options)
    names = data.keys or range(len(data.loaders))
    loaders = [
        user_loaders.evaluation_loader(each, f"{what}[{name}]", **options) for name, each in zip(names, data.loaders)
    ]
    return CombinedEvalLoader(data, loaders)


class CombinedEvalLoader:
    """Validation or test batches of several loaders combined, as Lightning's CombinedLoader in its mode gives them
    (no dataloader_idx): "max_size_cycle" re-reads a shorter loader until the longest ends, "max_size" gives None
    for one that is done, "min_size" ends with the shortest. Each is this rank's uneven shard (nothing twice), so the
    lengths are found by reading, streams included; a loader with no batch on this rank gives None."""

    batch_size = None

    def __init__(self, combined: Combined, loaders: list[Any]) -> None:
        self.keys, self.mode, self.loaders = combined.keys, combined.mode, loaders
        self.dataset = loaders[0].dataset  # for messages: the first loader's

    def __iter__(self) -> Iterator[Any]:
        iterators: list[Iterator[Any] | None] = [iter(loader) for loader in self.loaders]
        ended = [False] * len(self.loaders)
        while True:
            batches = []
            for i, loader in enumerate(self.loaders):
                batch = next(iterators[i], _END) if iterators[i] is not None else None
                if batch is _END:
                    ended[i] = True
                    if self.mode == "min_size":
                        return
                    if self.mode == "max_size_cycle" and not all(ended):
                        iterators[i] = iter(loader)
                        batch = next(iterators[i], None)
                    else:
                        iterators[i], batch = None, None
                batches.append(batch)
            if all(ended):  # the longest has ended: its step is not one
                return
            yield dict(zip(self.keys, batches)) if self.keys is not None else batches


class _Generators:
    """The loaders' generators seeded together (the engine seeds worker seeds per rank and epoch)."""

    def __init__(self, generators: list[torch.Generator]) -> None:
        self.generators = generators

    def manual_seed(self, seed: int) -> None:
        for i, generator in enumerate(self.generators):
            generator.manual_seed(seed + 7_919 * i)


_END = object()
