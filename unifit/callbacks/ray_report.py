"""Report a fit's metrics and committed checkpoints to Ray Train, when the fit runs in a Ray Train worker.

Ray wants `ray.train.report` called the same number of times on every worker (it is a barrier); it keeps rank 0's
metrics and lists the checkpoints reported (`Result.checkpoint`, `best_checkpoints`); a restarted worker group
starts from the last one (`ray.train.get_checkpoint()`). unifit owns the checkpoint's files: they are already
committed in the run's checkpoint directory (local or s3://), so the report points Ray at them instead of
letting it copy them (`checkpoint_upload_fn`), and never lets it delete them.

Every rank reports at each epoch end and at the fit's end, after the checkpoints saved so far are committed;
rank 0 names the newest checkpoint when it is one not reported yet.
"""

from __future__ import annotations

import os
from typing import Any

from unifit.loop.callback import Callback
from unifit.loop.context import FitContext


def wanted(env: Any = None) -> bool:
    from unifit.strategies.environment import RAY_TRAIN_MARKER

    return RAY_TRAIN_MARKER in (os.environ if env is None else env)


class RayTrainReport(Callback):
    runs_last = True  # after the checkpoint callbacks of the same epoch end

    def __init__(self) -> None:
        self._reported: str | None = None

    def on_fit_start(self, ctx: FitContext) -> None:
        self._reported = ctx.last_checkpoint  # resumed from: Ray has it already

    def on_epoch_end(self, ctx: FitContext) -> None:
        self._report(ctx)

    def on_fit_end(self, ctx: FitContext) -> None:
        self._report(ctx)

    def _report(self, ctx: FitContext) -> None:
        import ray.train

        ctx.wait_for_checkpoints()
        newest = ctx.last_checkpoint if ctx.last_checkpoint != self._reported else None
        self._reported = ctx.last_checkpoint
        metrics = {**ctx.state.metrics, "epoch": ctx.progress.epoch, "global_step": ctx.state.global_step}
        checkpoint = _checkpoint(newest) if newest and ctx.is_global_zero else None
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_dir_name=os.path.basename(newest.rstrip("/")) if newest else None,
            checkpoint_upload_fn=_already_stored if checkpoint is not None else None,
            delete_local_checkpoint_after_upload=False,
        )


def _checkpoint(path: str) -> Any:
    """Ray's Checkpoint of a committed unifit checkpoint, on Ray's own storage filesystem (local, s3:// ...): Ray
    takes as its own only a checkpoint on the very filesystem object of its storage, inside its run directory."""
    import pyarrow.fs
    import ray.train

    filesystem = ray.train.get_context().get_storage().storage_filesystem
    inner = os.path.abspath(path) if "://" not in path else pyarrow.fs.FileSystem.from_uri(path)[1]
    return ray.train.Checkpoint(path=inner, filesystem=filesystem)


def _already_stored(checkpoint: Any, dir_name: str) -> Any:
    """Ray's upload: nothing to copy, unifit committed it where it stays."""
    return checkpoint
