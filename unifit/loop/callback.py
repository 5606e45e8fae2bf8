"""Callbacks: one method per Event, each receiving the narrow FitContext, not the Trainer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from unifit.loop.context import FitContext


class Callback:
    """Override the hooks you need; the dispatcher calls only overridden ones.

    `rank_zero_only = True` callbacks run on rank 0 alone (files, terminal output); the others
    run on every rank and must make the same decisions everywhere (they see averaged metrics).
    `on_train_batch_start` receives what the engine feeds its step: the batch for PyTorch, the
    distributed iterator its compiled step dequeues from for Keras. `loss` is the step's loss tensor.
    """

    rank_zero_only: ClassVar[bool] = False
    # callbacks that persist training (checkpoints, the final model) run after every other callback
    # of an event, so a user callback that stops training is seen by the save that follows it
    runs_last: ClassVar[bool] = False
    # the module's own hooks (a LightningModule's) run before every other callback of an event: what
    # they log at an epoch's end is in the metrics the others read
    runs_first: ClassVar[bool] = False

    @property
    def state_key(self) -> str:
        """Where this callback's state_dict lives in a checkpoint (the Trainer numbers repeats)."""
        return type(self).__qualname__

    def on_setup(self, ctx: FitContext) -> None: ...
    def on_fit_start(self, ctx: FitContext) -> None: ...
    def on_train_epoch_start(self, ctx: FitContext) -> None: ...
    def on_train_batch_start(self, ctx: FitContext, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, ctx: FitContext, loss: Any, batch_idx: int) -> None: ...
    def on_train_epoch_end(self, ctx: FitContext) -> None: ...
    def on_validation_start(self, ctx: FitContext) -> None: ...
    def on_validation_end(self, ctx: FitContext) -> None: ...
    def on_epoch_end(self, ctx: FitContext) -> None: ...
    def on_fit_end(self, ctx: FitContext) -> None: ...
    def on_exception(self, ctx: FitContext, error: BaseException) -> None: ...
    def on_teardown(self, ctx: FitContext) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """Saved in checkpoints (e.g. early-stopping counters)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
