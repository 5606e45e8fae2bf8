"""A LightningModule that brings its own Lightning callbacks (configure_callbacks()), written as Lightning's
docs teach them (no Lightning example's code is copied here):

- `GradNormLogger` logs the gradients' norms before every optimizer step (the docs' recipe for spotting
  exploding gradients), through `pl_module.log_dict`; the total is a vector norm over each parameter's norm, which
  also holds where the gradients are sharded DTensors (fsdp: Lightning's `utilities.grad_norm` builds a plain
  tensor from them and fails there, under Lightning's own ModelParallelStrategy too);
- `LossSpread` keeps the training losses of an epoch from `on_train_batch_end`'s outputs, logs their spread in
  `on_train_epoch_end`, and keeps a count in its `state_dict` (restored with a checkpoint);
- `StopAtGlobalStep` reads `trainer.global_step` / `trainer.callback_metrics`, agrees with the other ranks through
  `trainer.strategy.reduce_boolean_decision` (a collective every batch) and would set `trainer.should_stop` (not
  reached in the zoo's two epochs).

The module itself is a plain classifier on ClassData (own_step_models.py), so runs compare step for step with
Lightning's own Trainer and across strategies.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from tests.zoo.own_step_models import ClassData, Classifier


class GradNormLogger(L.Callback):
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        norms = {name: p.grad.norm(2) for name, p in pl_module.net.named_parameters() if p.grad is not None}
        total = torch.linalg.vector_norm(torch.stack(list(norms.values())), 2)
        pl_module.log_dict({"grad_norm_total": total, "grad_norm_first": norms["0.weight"]})
        pl_module.grad_norms.append(float(total.full_tensor() if hasattr(total, "full_tensor") else total))


class LossSpread(L.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.epochs_seen = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].detach())

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        pl_module.log("loss_spread", torch.stack(self.losses).std())
        self.losses.clear()
        self.epochs_seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epochs_seen": self.epochs_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epochs_seen = state_dict["epochs_seen"]


class StopAtGlobalStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        reached = trainer.global_step >= self.step and "train_ce" in trainer.callback_metrics
        if trainer.strategy.reduce_boolean_decision(reached, all=False):  # any rank: all stop together
            trainer.should_stop = True


class CallbackClassifier(Classifier):
    """The classifier with its callbacks; grad_norms holds what GradNormLogger saw."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def configure_callbacks(self) -> Any:
        return [GradNormLogger(), LossSpread(), StopAtGlobalStep(10_000)]


MODELS = {"callbacks": (lambda b: (CallbackClassifier(), ClassData(b)), False)}
