"""Keras callbacks given to unifit, as model.fit takes them (`Trainer(callbacks=[...])`, class paths in YAML).

Most run as they are (callbacks/keras_callbacks.py): EarlyStopping (restore_best_weights, baseline,
start_from_epoch included), ModelCheckpoint and CSVLogger (on rank 0: the files model.fit would write),
ReduceLROnPlateau, LearningRateScheduler, TerminateOnNaN, LambdaCallback and the user's own. What unifit does
itself is mapped onto it with the same behaviour: `TensorBoard` -> trainer.tensorboard, `BackupAndRestore`
-> checkpoints in its backup_dir resumed automatically, `ProgbarLogger` -> trainer.progress_bar.
"""

from __future__ import annotations

from typing import Any, Callable

from unifit._imports import derives_from
from unifit.errors import ConfigError
from unifit.loop.callback import Callback
from unifit.storage import filesystem

# the Keras callbacks that write files: rank 0 runs them, as the chief writes under model.fit
RANK_ZERO = ("ModelCheckpoint", "CSVLogger", "RemoteMonitor")


def is_keras_callback(obj: Any) -> bool:
    """A keras.callbacks.Callback (Keras 3), checked by name: TensorFlow is not imported to ask."""
    return derives_from(obj, "Callback", "keras")


def keras_kind(callback: Any) -> str | None:
    """The name of the first Keras class `callback` is (itself or a base), ignoring the Callback base."""
    for cls in type(callback).__mro__:
        if cls.__module__.split(".")[0] == "keras" and cls.__name__ not in ("Callback", "MonitorCallback"):
            return cls.__name__
    return None


def _tensorboard(cb: Any, plan: Any) -> dict[str, Any]:
    unsupported = {
        name: getattr(cb, name)
        for name in ("histogram_freq", "write_images", "embeddings_freq")
        if getattr(cb, name, 0)
    }
    if getattr(cb, "_start_batch", 0) or unsupported:
        raise ConfigError(
            f"{unsupported or 'profile_batch'}: unifit's TensorBoard writes scalars (epoch metrics, the step loss and "
            "lr); log histograms or images from a callback of your own"
        )
    settings: dict[str, Any] = {"enabled": True, "log_dir": str(cb.log_dir)}
    if isinstance(cb.update_freq, int):
        settings["log_every_n_steps"] = cb.update_freq
    return {"tensorboard": settings}


def _backup_and_restore(cb: Any, plan: Any) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"enabled": True, "dir": str(cb.backup_dir), "keep_last_n": 1}
    if isinstance(cb.save_freq, int):
        checkpoint["every_n_steps"] = cb.save_freq
    if cb.delete_checkpoint:
        plan.unifit.append(DeleteBackup(str(cb.backup_dir)))
    return {"checkpoint": checkpoint, "resume": "auto"}


class DeleteBackup(Callback):
    """BackupAndRestore(delete_checkpoint=True): once training ended well, the backup goes, so that the script run
    again trains afresh instead of resuming a finished run (as Keras does)."""

    rank_zero_only = True
    runs_last = True  # after the last checkpoint was committed

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_end(self, ctx: Any) -> None:
        fs, root = filesystem(self.folder, ctx.config.storage_options)
        if fs.exists(root):
            fs.rm(root, recursive=True)


def _progress(cb: Any, plan: Any) -> dict[str, Any]:
    return {"progress_bar": True}


# Keras' class name -> the updates to the trainer config it becomes
MAPPED: dict[str, Callable[[Any, Any], dict[str, Any]]] = {
    "TensorBoard": _tensorboard,
    "BackupAndRestore": _backup_and_restore,
    "ProgbarLogger": _progress,
}
