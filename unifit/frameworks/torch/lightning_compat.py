"""Lightning's private API, in one place: each use named for what it does.

unifit reads or sets a private name of Lightning only where Lightning has no public one (checked with lightning
2.6): the arguments its callbacks were made with, its LR finder's result object, and three attributes its Trainer
sets on objects unifit drives instead. A Lightning release that moves one breaks a function here, and
tests/test_lightning_compat.py, which checks every name on the installed Lightning, rather than a mapping.
"""

from __future__ import annotations

from typing import Any

__all__ = ["made_with", "lr_finder_result", "restored_without_restarting", "give_device_mesh", "combined_mode"]


def made_with(callback: Any, names: tuple[str, ...], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    """The arguments a Lightning callback was made with, which it keeps as `_<name>` (no public accessor);
    `optional`: names older releases lack, with their default."""
    found = {name: getattr(callback, f"_{name}") for name in names}
    found.update({name: getattr(callback, f"_{name}", default) for name, default in (optional or {}).items()})
    return found


def lr_finder_result(mode: str, min_lr: float, max_lr: float, steps: int, lrs: list[float], losses: list[float]) -> Any:
    """Lightning's own LR finder result (its suggestion() and plot() work), filled with unifit's search."""
    from lightning.pytorch.tuner.lr_finder import _LRFinder

    found = _LRFinder(mode, min_lr, max_lr, steps)
    found.results = {"lr": list(lrs), "loss": list(losses)}
    return found


def restored_without_restarting(callback: Any) -> None:
    """A BaseFinetuning callback whose state unifit restored: its on_fit_start does not set the optimizer's learning
    rates again from older ones it keeps (Lightning's Trainer clears the same flag)."""
    callback._restarting = False


def give_device_mesh(module: Any, mesh: Any) -> None:
    """`self.device_mesh` in a LightningModule's configure_model, as Lightning's ModelParallelStrategy sets it."""
    module._device_mesh = mesh


def combined_mode(loaders: Any) -> str:
    """The mode of a CombinedLoader ("max_size_cycle", "min_size", "sequential", ...)."""
    return loaders._mode
