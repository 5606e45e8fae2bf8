"""Every hook of a LightningModule and of a Lightning Callback, recorded in one list in the order they run, so a
fit under unifit can be compared call by call with the same fit under Lightning's own Trainer (the golden hook
test in tests/test_lightning_callbacks.py; the idea is Lightning's own tests/tests_pytorch/models/test_hooks.py).

The module is Lightning's BoringModel; each hook is wrapped on the instance, so it counts as overridden (as in a
module that defines every hook) and still does what Lightning's default does."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

# every hook Lightning's Trainer calls on a LightningModule (core/hooks.py's ModelHooks, DataHooks and
# CheckpointHooks, and the module's own step methods)
MODULE_HOOKS = (
    "prepare_data", "setup", "configure_model", "configure_optimizers", "configure_callbacks",
    "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
    "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end",
    "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end",
    "on_validation_model_eval", "on_validation_model_train", "on_validation_model_zero_grad",
    "on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_start",
    "on_test_batch_end", "on_test_model_eval", "on_test_model_train",
    "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end", "on_predict_batch_start",
    "on_predict_batch_end", "on_predict_model_eval",
    "training_step", "validation_step", "test_step", "predict_step",
    "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
    "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
    "on_before_zero_grad", "optimizer_zero_grad", "on_before_backward", "backward", "on_after_backward",
    "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step", "lr_scheduler_step",
    "on_save_checkpoint", "on_load_checkpoint", "teardown",
)  # fmt: skip
CALLBACK_HOOKS = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
    "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end",
    "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end",
    "on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end", "on_predict_batch_start",
    "on_predict_batch_end",
    "on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_save_checkpoint", "on_load_checkpoint", "state_dict", "load_state_dict", "on_exception",
)  # fmt: skip


def _record(calls: list[str], name: str, fn: Any) -> Any:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)

    return recorded


class HookedCallback(L.Callback):
    """Records each of its hooks as '<name>.<hook>'; logs the gradient norm before each optimizer step."""

    def __init__(self, calls: list[str], name: str = "Callback") -> None:
        self.name = name
        for hook in CALLBACK_HOOKS:
            setattr(self, hook, _record(calls, f"{name}.{hook}", getattr(self, hook)))

    @property
    def state_key(self) -> str:
        return self.name

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        norms = [p.grad.norm() for p in pl_module.parameters() if p.grad is not None]
        pl_module.log(f"{self.name}_grad_norm", torch.linalg.vector_norm(torch.stack(norms)))


class TrainerHookedCallback(HookedCallback):
    """Another type, so that a module's HookedCallback does not replace the Trainer's (Lightning replaces by type)."""


class HookedModel(BoringModel):
    """Lightning's BoringModel with every hook recorded (a StepLR stepped per epoch, as BoringModel's own)."""

    def __init__(self, calls: list[str], callbacks: tuple[Any, ...] = ()) -> None:
        super().__init__()
        self.calls = calls
        self._own_callbacks = list(callbacks)
        for hook in MODULE_HOOKS:
            setattr(self, hook, _record(calls, hook, getattr(self, hook)))

    def configure_callbacks(self) -> Any:
        return self._own_callbacks


class HookedData(L.LightningDataModule):
    """BoringModel's data as a data module whose hooks are recorded too ('DataModule.<hook>')."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        model = BoringModel()
        self._loaders = {
            "train": model.train_dataloader,
            "val": model.val_dataloader,
            "test": model.test_dataloader,
            "predict": model.predict_dataloader,
        }
        for hook in ("prepare_data", "setup", "teardown", "state_dict", "load_state_dict"):
            setattr(self, hook, _record(calls, f"DataModule.{hook}", getattr(self, hook)))

    def train_dataloader(self) -> Any:
        return self._loaders["train"]()

    def val_dataloader(self) -> Any:
        return self._loaders["val"]()

    def test_dataloader(self) -> Any:
        return self._loaders["test"]()

    def predict_dataloader(self) -> Any:
        return self._loaders["predict"]()
