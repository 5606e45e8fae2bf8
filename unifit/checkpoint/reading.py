"""Find and read a committed checkpoint for every rank: fit's resume and validate/test/predict share it.

Rank 0 looks for it ('last' and 'auto' fall back to the previous committed checkpoint when the newest
cannot be read; 'auto' finds none without failing); every rank then reads it itself where it can
(shared disk, S3), else receives rank 0's copy (the strategy's load_checkpoint says which in the log).
"""

from __future__ import annotations

import logging
from typing import Any

from unifit.checkpoint.store import CheckpointStore
from unifit.errors import first_line
from unifit.storage import filesystem

log = logging.getLogger("unifit")


def read_committed(
    spec: str, engine: Any, strategy: Any, store: CheckpointStore, storage_options: dict[str, Any]
) -> tuple[dict[str, Any] | None, str | None]:
    """(payload, path) of the checkpoint `spec` names, the same on every rank; (None, None) when
    'auto' finds none."""

    def find() -> tuple[dict[str, Any] | None, str | None]:  # rank 0
        candidates = store.candidates(spec)
        for i, (fs, path) in enumerate(candidates):
            try:
                return engine.read_checkpoint(fs, path), fs.unstrip_protocol(path).removeprefix("file://")
            except Exception as exc:
                if i + 1 == len(candidates):
                    raise
                log.warning(
                    "checkpoint %s cannot be read (%s: %s); using the previous committed one",
                    path,
                    type(exc).__name__,
                    first_line(exc),
                )
        log.info("--ckpt-path %s: no committed checkpoint in %s; starting fresh", spec, store.url)
        return None, None

    def read_at(url: str) -> dict[str, Any]:  # the other ranks, where they can
        return engine.read_checkpoint(*filesystem(url, storage_options))

    return strategy.load_checkpoint(find, read_at)
