"""Calls an unchanged LightningModule's own hooks, each after the same hook of the run's Lightning callbacks,
at the matching unifit events (see frameworks/torch/lightning.py for the module itself), in Lightning 2.x's
order: on_train_epoch_end after validation (LightningEpochEnds: before the other callbacks), setup/teardown
around the fit, the callbacks' states and on_save_checkpoint into the checkpoint."""

from __future__ import annotations

from typing import Any

import numpy as np

from unifit.callbacks.agreement import agree_on_asked_stop
from unifit.loop.callback import Callback


class LightningEpochEnds(Callback):
    """The LightningModule's on_validation_epoch_end and on_train_epoch_end, before every other callback: what
    they log is reduced over the ranks right after the hook, into the metrics that early stopping, checkpoints,
    the loggers and the user's callbacks read at the epoch's end, as in Lightning."""

    runs_first = True

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    def on_validation_end(self, ctx: Any) -> None:
        self._epoch_end(ctx, "on_validation_epoch_end")

    def on_epoch_end(self, ctx: Any) -> None:
        self._epoch_end(ctx, "on_train_epoch_end")
        agree_on_asked_stop(ctx)  # trainer.should_stop set on some ranks during the epoch: stop all, here

    def _epoch_end(self, ctx: Any, hook: str) -> None:
        """Every rank calls the hook, so every rank reduces (a collective, only for a module that has the hook)."""
        self.adapter.call_epoch_hook(hook)
        self.adapter.agree_on_pruning()  # where Lightning's ModelPruning prunes
        if self.adapter.overrides(hook) or self.adapter.listens(hook):
            ctx.state.metrics.update(ctx.reduce_logged())


class LightningHooks(Callback):
    """The LightningModule's (and its data module's) other hooks, for a LightningAdapter (after the user's
    callbacks, as Lightning calls the module's hooks after theirs)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.lm = adapter.lightning
        self._batch: Any = None

    @property
    def state_key(self) -> str:
        return "LightningModule"

    def on_setup(self, ctx: Any) -> None:
        view, cfg = self.adapter.view, ctx.config
        view.ctx, view.max_epochs, view.epoch, view.stage = ctx, cfg.max_epochs, ctx.progress.epoch, "fit"

    def on_fit_start(self, ctx: Any) -> None:
        self.adapter.fan_out("on_fit_start")
        self.adapter.call_epoch_hook("on_train_start")  # its logs count in the first epoch

    def on_train_epoch_start(self, ctx: Any) -> None:
        self.adapter.view.epoch = ctx.progress.epoch
        self.adapter.call_epoch_hook("on_train_epoch_start")

    def on_train_batch_start(self, ctx: Any, batch: Any, batch_idx: int) -> None:
        """-1 from the module's hook skips the rest of the epoch; with several ranks, every rank's answer is
        agreed on each batch (one tiny all-reduce, only for a module that overrides the hook), so that one rank's
        -1 ends the epoch on all of them at the same batch, where Lightning would hang."""
        self._batch = batch
        ends = self.adapter.call_batch_hook("on_train_batch_start", batch, batch_idx, batch=batch) == -1
        if ctx.world_size > 1 and self.adapter.overrides("on_train_batch_start"):
            ends = bool(ctx.all_reduce_max(np.array([1.0 if ends else 0.0]))[0])
        ctx.state.end_epoch = ends

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        if self.adapter.overrides("on_train_batch_end") or self.adapter.listens("on_train_batch_end"):
            batch = self._batch
            outputs = self.adapter.batch_outputs()
            self.adapter.call_batch_hook("on_train_batch_end", outputs, batch, batch_idx, batch=batch)
        # trainer.should_stop set on some ranks: all stop at an agreed step
        if ctx.passed_step(ctx.config.preemption.check_every_n_steps):
            agree_on_asked_stop(ctx)

    def on_validation_start(self, ctx: Any) -> None:
        self.adapter.view.training = False
        self.adapter.call_epoch_hook("on_validation_start")
        self.adapter.call_epoch_hook("on_validation_epoch_start")

    def on_validation_end(self, ctx: Any) -> None:
        self.adapter.fan_out("on_validation_end")  # on_validation_epoch_end ran in LightningEpochEnds
        self.adapter.view.training = True

    def on_fit_end(self, ctx: Any) -> None:
        self.adapter.view.epoch = ctx.progress.epoch  # Lightning's after fit: max_epochs
        self.adapter.fan_out("on_train_end")
        self.adapter.fan_out("on_fit_end")

    def on_exception(self, ctx: Any, error: BaseException) -> None:
        self.adapter.callbacks_only("on_exception", error)
        if self.adapter.datamodule is not None and hasattr(self.adapter.datamodule, "on_exception"):
            self.adapter.datamodule.on_exception(error)

    def on_teardown(self, ctx: Any) -> None:
        self.adapter.teardown()

    def state_dict(self) -> dict[str, Any]:
        """What a Lightning checkpoint adds to the weights: the callbacks' states (by state_key), the data module's
        state, then what the callbacks' and the module's on_save_checkpoint put in."""
        extra: dict[str, Any] = {}
        callbacks = self.adapter.callback_state()
        if callbacks:
            extra["callbacks"] = callbacks
        if self.adapter.datamodule is not None:
            extra["datamodule"] = self.adapter.datamodule.state_dict()
        extra["state_dict"] = weights = self.lm.state_dict()  # as Lightning's hooks get it (references, no copy)
        self.adapter.callbacks_only("on_save_checkpoint", extra)
        self.lm.on_save_checkpoint(extra)
        if extra.get("state_dict") is weights:  # unchanged: the engine saves the weights, once
            del extra["state_dict"]
        extra.pop("current_model_state", None)  # WeightAveraging's name for them, likewise
        return extra

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Lightning loads a checkpoint's tensors back onto the device they were saved from: what the module's hooks
        # put there (an LSTM's hidden state) comes back on the device it trains on
        import torch
        from lightning_utilities.core.apply_func import apply_to_collection

        state = apply_to_collection(state, torch.Tensor, lambda t: t.to(self.lm.device))
        if self.adapter.datamodule is not None and "datamodule" in state:
            self.adapter.datamodule.load_state_dict(state["datamodule"])
        if "state_dict" in state:  # a callback replaced them (WeightAveraging: the averaged weights); the
            state = {**state, "current_model_state": self.lm.state_dict()}  # engine restored the trained ones
        self.lm.on_load_checkpoint(state)
        self.adapter.callbacks_only("on_load_checkpoint", state)
        self.adapter.load_callback_state(state.get("callbacks", {}))
