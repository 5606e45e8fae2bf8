"""Committed checkpoints on any fsspec file system: atomic, with 'last' and 'best' pointers.

Layout under the checkpoint dir:
    epoch=0003-step=0000120/   one checkpoint: the engine's payload + COMMITTED.json (last)
    last.json                  {"name": ...}: a small pointer, not a symlink (object stores have none)
    best.json                  {"name": ..., "monitor": ..., "value": ...} when a metric is monitored
A checkpoint counts only once its COMMITTED.json exists. On a local disk it is written in a
temporary directory and renamed into place; on object stores the marker is written last.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, Callable

from unifit.errors import CheckpointNotFoundError
from unifit.storage import filesystem

MARKER = "COMMITTED.json"
log = logging.getLogger("unifit")
_NAME = re.compile(r"^epoch=(\d+)-step=(\d+)$")


def checkpoint_name(epoch: int, step: int) -> str:
    return f"epoch={epoch:04d}-step={step:07d}"


class CheckpointStore:
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = storage_options or {}
        self.fs, self.root = filesystem(url, self.storage_options)
        self._renames = "file" in _protocols(self.fs)  # local disks rename; object stores commit by marker

    def path(self, name: str) -> str:
        """Checkpoint `name`'s directory on this store's file system (its protocol stripped, as fsspec takes it)."""
        return f"{self.root.rstrip('/')}/{name}"

    def location(self, name: str) -> str:
        """Where checkpoint `name` is, as a user names it: a local path, or a URL with its scheme (s3://...)."""
        return self.fs.unstrip_protocol(self.path(name)).removeprefix("file://")

    # ---- writing (rank 0 only, but for a sharded checkpoint's shards) ------------------------
    def write_dir(self, name: str, token: str) -> str:
        """Where checkpoint `name` is written before its commit, the same on every rank given the same
        `token`: a staging directory on a local disk (renamed into place), its own place on an object
        store (where the marker commits it)."""
        return self.path(f".tmp-{name}-{token}") if self._renames else self.path(name)

    def clear(self, name: str) -> None:
        """Before writing `name` anew on an object store: its old files go (a local disk replaces it by rename)."""
        final = self.path(name)
        if not self._renames and self.fs.exists(final):
            self.fs.rm(final, recursive=True)

    def save(
        self, name: str, write: Callable[[Any, str], None], meta: dict[str, Any], directory: str | None = None
    ) -> str:
        """Write one checkpoint with `write(fs, directory)` and commit it; returns its path. The
        trainer calls it on the committer's writer thread, with bytes already snapshotted; where a
        sharded strategy's ranks wrote their shards in `directory` (write_dir) already, they are
        committed with it."""
        final = self.path(name)
        self.fs.makedirs(self.root, exist_ok=True)
        if directory is None:
            self.clear(name)
            directory = self.write_dir(name, uuid.uuid4().hex[:8])
        try:
            if self._renames:
                self.fs.makedirs(directory, exist_ok=True)
            write(self.fs, directory)
            self._write_json(f"{directory}/{MARKER}", meta)  # on object stores, the commit: written last
            if self._renames:
                self._replace_dir(directory, final)
        except BaseException:
            self.abandon(directory)
            raise
        self._write_json(self.path("last.json"), {"name": name, **meta})
        return final

    def abandon(self, directory: str) -> None:
        """Remove a checkpoint that failed before its commit (its marker was never written)."""
        if self.fs.exists(directory):
            self.fs.rm(directory, recursive=True)

    def _replace_dir(self, staging: str, final: str) -> None:
        old = None
        if self.fs.exists(final):
            old = self.path(f".old-{uuid.uuid4().hex[:8]}")
            self.fs.mv(final, old, recursive=True)
        self.fs.mv(staging, final, recursive=True)
        if old:
            self.fs.rm(old, recursive=True)

    def _write_json(self, path: str, data: dict[str, Any]) -> None:
        text = json.dumps(data, sort_keys=True)
        if self._renames:
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            self.fs.pipe_file(tmp, text.encode())
            self.fs.mv(tmp, path)
        else:
            self.fs.pipe_file(path, text.encode())  # a single PUT is atomic on object stores

    def set_best(self, name: str, monitor: str, value: float) -> None:
        self._write_json(self.path("best.json"), {"name": name, "monitor": monitor, "value": value})

    def best(self) -> dict[str, Any] | None:
        return self._read_json(self.path("best.json"))

    def prune(self, keep_last_n: int | None, protected: set[str]) -> list[str]:
        """Delete all but the newest `keep_last_n` committed checkpoints, never `protected` ones."""
        if keep_last_n is None:
            return []
        best = self.best()
        keep = set(protected) | ({best["name"]} if best else set())
        names = self.committed()
        doomed = [n for n in names[:-keep_last_n] if n not in keep] if len(names) > keep_last_n else []
        for name in doomed:
            self.fs.rm(self.path(name), recursive=True)
        return doomed

    # ---- reading ----------------------------------------------------------------------------
    def committed(self) -> list[str]:
        """Names of committed checkpoints, oldest first."""
        self.fs.invalidate_cache()  # object-store listings are cached; another process may have written
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            match = _NAME.match(name)
            if match and self.fs.exists(f"{self.path(name)}/{MARKER}"):
                found.append((int(match[1]), int(match[2]), name))
        return [name for *_, name in sorted(found)]

    def candidates(self, spec: str) -> list[tuple[Any, str]]:
        """Where to resume from, in order of preference. 'last': the pointer's checkpoint, then the
        other committed ones newest first (a checkpoint that cannot be read falls back to the one
        before); 'auto': the same, or none at all (start fresh); else exactly the one named."""
        if spec not in ("last", "auto"):
            return [self.resolve(spec)]
        names = list(reversed(self.committed()))
        try:
            pointer = self._read_json(self.path("last.json"))
            name = pointer["name"] if pointer else None
        except (ValueError, KeyError, TypeError):  # a torn last.json: the listing still knows the checkpoints
            log.warning("%s cannot be read; using the newest committed checkpoint", self.path("last.json"))
            name = None
        if name is not None and self.fs.exists(f"{self.path(name)}/{MARKER}"):  # also a custom save name
            names = [name] + [n for n in names if n != name]
        elif name is not None:
            log.warning("checkpoint %s (last.json) was never committed; skipping it", self.path(name))
        if not names and spec == "last":
            self.resolve("last")  # raises the one-line 'no committed checkpoint' error
        return [(self.fs, self.path(name)) for name in names]

    def resolve(self, spec: str) -> tuple[Any, str]:
        """'last', 'best', a checkpoint name, or a path -> (file system, directory) of a committed one."""
        if spec in ("last", "best"):
            pointer = self._read_json(self.path(f"{spec}.json"))
            if pointer is None or not self.fs.exists(f"{self.path(pointer['name'])}/{MARKER}"):
                raise CheckpointNotFoundError(
                    f"--ckpt-path {spec}: no committed checkpoint in '{self.url}'; "
                    "train without --ckpt-path first, or point trainer.checkpoint.dir at the run to resume"
                )
            return self.fs, self.path(pointer["name"])
        self.fs.invalidate_cache()
        fs, path = (self.fs, self.path(spec)) if _NAME.match(spec) else filesystem(spec, self.storage_options)
        if not fs.exists(f"{path.rstrip('/')}/{MARKER}"):
            raise CheckpointNotFoundError(
                f"--ckpt-path {spec}: not a committed checkpoint (no {MARKER}); "
                "use 'last', 'best' or a checkpoint directory written by unifit"
            )
        return fs, path.rstrip("/")

    def _read_json(self, path: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            return None


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
