"""Calls an unchanged LightningModule's own hooks at the matching unifit events (see
frameworks/torch/lightning.py for the module itself), in Lightning 2.x's order: on_train_epoch_end
after validation, setup/teardown around the fit, on_save_checkpoint into the checkpoint."""

from __future__ import annotations

from typing import Any

from unifit.errors import ConfigError
from unifit.loop.callback import Callback


class LightningHooks(Callback):
    """The LightningModule's (and its data module's) hooks, for a LightningAdapter."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.lm = adapter.lightning
        self._batch: Any = None

    @property
    def state_key(self) -> str:
        return "LightningModule"

    def on_setup(self, ctx: Any) -> None:
        view = self.adapter.view
        view.ctx, view.max_epochs, view.epoch = ctx, ctx.config.max_epochs, ctx.progress.epoch

    def on_fit_start(self, ctx: Any) -> None:
        self.lm.on_fit_start()
        self.lm.on_train_start()

    def on_train_epoch_start(self, ctx: Any) -> None:
        self.adapter.view.epoch = ctx.progress.epoch
        self.lm.on_train_epoch_start()

    def on_train_batch_start(self, ctx: Any, batch: Any, batch_idx: int) -> None:
        self._batch = batch
        if self.lm.on_train_batch_start(batch, batch_idx) == -1:
            raise ConfigError(
                f"{type(self.lm).__name__}.on_train_batch_start returned -1 (skip the rest of the "
                "epoch), which one rank cannot decide alone; set trainer.should_stop or use max_epochs"
            )

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        self.lm.on_train_batch_end({"loss": loss}, self._batch, batch_idx)

    def on_validation_start(self, ctx: Any) -> None:
        self.adapter.view.training = False
        self.lm.on_validation_start()
        self.lm.on_validation_epoch_start()

    def on_validation_end(self, ctx: Any) -> None:
        self.lm.on_validation_epoch_end()
        self.lm.on_validation_end()
        self.adapter.view.training = True

    def on_epoch_end(self, ctx: Any) -> None:
        self.lm.on_train_epoch_end()

    def on_fit_end(self, ctx: Any) -> None:
        self.adapter.view.epoch = ctx.progress.epoch  # Lightning's after fit: max_epochs
        self.lm.on_train_end()
        self.lm.on_fit_end()

    def on_teardown(self, ctx: Any) -> None:
        for part in (self.adapter.datamodule, self.lm):
            if part is not None:
                part.teardown(self.adapter.stage)

    def state_dict(self) -> dict[str, Any]:
        """What the module's on_save_checkpoint and the data module's state_dict add to a checkpoint."""
        extra: dict[str, Any] = {}
        self.lm.on_save_checkpoint(extra)
        if self.adapter.datamodule is not None:
            extra["datamodule"] = self.adapter.datamodule.state_dict()
        return extra

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.adapter.datamodule is not None and "datamodule" in state:
            self.adapter.datamodule.load_state_dict(state["datamodule"])
        self.lm.on_load_checkpoint(state)
