"""Data that lives in files on any fsspec URL (local, s3://, ...), sharded by file across ranks.

Like SageMaker's ShardedByS3Key: rank r of W reads files r, r+W, ... of the sorted list, so no
rank downloads another's data. A data provider returns such an object from train_dataset() /
val_dataset(); the engine calls `for_rank(rank, world_size)` and does not shard again. Ranks
then train on the same number of batches (the smallest shard's), so no rank waits forever.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np

from unifit.errors import ConfigError
from unifit.storage import filesystem


class FileShards:
    """Files given as a glob or a list of URLs, split across ranks; subclasses load them."""

    def __init__(self, files: str | Sequence[str], storage_options: dict[str, Any] | None = None) -> None:
        self.spec = files
        self.storage_options = storage_options or {}

    def files(self) -> tuple[Any, list[str]]:
        specs = [self.spec] if isinstance(self.spec, str) else list(self.spec)
        fs, _ = filesystem(specs[0], self.storage_options)
        found: list[str] = []
        for spec in specs:
            _, path = filesystem(spec, self.storage_options)
            found += sorted(fs.glob(path)) if any(c in path for c in "*?[") else [path]
        if not found:
            raise ConfigError(f"data: no files match {self.spec!r}; check the URL or glob")
        return fs, found

    def for_rank(self, rank: int, world_size: int) -> Any:
        fs, found = self.files()
        if len(found) < world_size:
            raise ConfigError(
                f"data: {len(found)} files ({self.spec!r}) cannot be split over {world_size} ranks; "
                "provide at least one file per rank"
            )
        return self.load(fs, found[rank::world_size])

    def load(self, fs: Any, paths: list[str]) -> Any:
        raise NotImplementedError


class NpzShards(FileShards):
    """.npz files holding the same arrays (default x and y); one rank's files concatenated."""

    def __init__(
        self,
        files: str | Sequence[str],
        keys: Sequence[str] = ("x", "y"),
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(files, storage_options)
        self.keys = tuple(keys)

    def load(self, fs: Any, paths: list[str]) -> tuple[np.ndarray, ...]:
        parts = [np.load(io.BytesIO(fs.cat_file(p))) for p in paths]
        try:
            return tuple(np.concatenate([part[k] for part in parts]) for k in self.keys)
        except KeyError as exc:
            raise ConfigError(
                f"data: a file in {self.spec!r} has no array {exc}; expected keys {list(self.keys)}"
            ) from None


class NpzFilesData:
    """A data provider for the YAML `data:` section: train/val .npz files sharded by file."""

    def __init__(
        self,
        train: str | Sequence[str],
        val: str | Sequence[str] | None = None,
        keys: Sequence[str] = ("x", "y"),
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.train = NpzShards(train, keys, storage_options)
        self.val = NpzShards(val, keys, storage_options) if val is not None else None

    def train_dataset(self) -> NpzShards:
        return self.train

    def val_dataset(self) -> NpzShards | None:
        return self.val
