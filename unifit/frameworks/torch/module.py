"""TrainModule: the LightningModule-like base class for PyTorch users."""

from __future__ import annotations

from typing import Any

import torch

from unifit.errors import ConfigError
from unifit.frameworks.module import ModuleBase
from unifit.frameworks.torch.input_path import ToDevice
from unifit.frameworks.torch.stateful import TorchmetricValue, is_torchmetric
from unifit.frameworks.torch.step_seams import STEP_HOOKS


class TrainModule(ModuleBase, torch.nn.Module):
    """Subclass it: define the network in __init__, then the steps, optimizers and data.

    - training_step(batch, batch_idx) -> loss tensor, or a dict with "loss"
      (the returned loss is logged as train/loss automatically)
    - validation_step(batch, batch_idx) -> None; log metrics with self.log
    - test_step(batch, batch_idx) -> None (Trainer.test), predict_step(batch, batch_idx) -> outputs
      with one row per sample (Trainer.predict; default: self(x) for a batch (x, ...) or x)
    - configure_optimizers() -> optimizer, or (optimizer, scheduler) with the scheduler stepped
      once per epoch, or {"optimizer": o, "lr_scheduler": s, "interval": "epoch" | "step"}
    - train_dataset() / val_dataset() / test_dataset() / predict_dataset() -> torch Dataset, tuple of
      arrays or DataLoader (sharded for you)
    - optional, with Lightning's names and order: the hooks inside the optimizer step below, and manual
      optimization (`automatic_optimization = False`: training_step calls self.optimizers(),
      self.manual_backward(loss), opt.step(), opt.zero_grad(), self.clip_gradients(opt, ...))
    """

    framework = "torch"
    engine = "unifit.frameworks.torch.engine:TorchEngine"
    automatic_optimization = True
    _unifit_steps: Any = None  # the running engine's StepSeams (frameworks/torch/step_seams.py)
    # a training epoch of forward passes only (no backward, no optimizer step): Lightning's fit_loop._skip_backward,
    # which StochasticWeightAveraging sets for its BatchNorm epoch
    forward_only = False

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)

    @property
    def state_module(self) -> torch.nn.Module:
        """The module whose state_dict() a checkpoint holds, by its parameter names: this one (an
        adapter names the module it wraps)."""
        return self

    @staticmethod
    def metric_values(metrics: dict[str, float]) -> dict[str, torch.Tensor]:
        """Reduced metrics as Lightning's trainer.callback_metrics holds them: tensors."""
        return {name: torch.tensor(value) for name, value in metrics.items()}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Optional; without it validation is skipped."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        raise ConfigError(
            f"{type(self).__name__} has no test_step(batch, batch_idx); define it (log metrics with "
            "self.log, as in validation_step) to run Trainer.test"
        )

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define configure_optimizers()")

    def configure_model(self) -> None:
        """Optional (Lightning's hook, called once as a fit or evaluation sets up, before the model is placed and
        configure_optimizers): split the model over the ranks here with `self.device_mesh`
        (torch.distributed.tensor.parallel's parallelize_module, fully_shard) under the model-parallel strategy."""

    @property
    def device_mesh(self) -> Any:
        """The ranks' DeviceMesh under the model-parallel strategy (dimensions "data_parallel" and
        "tensor_parallel"), as Lightning's ModelParallelStrategy offers it; None under the others."""
        return getattr(self.__dict__.get("_unifit_strategy"), "device_mesh", None)

    def attach_strategy(self, strategy: Any) -> None:
        self.__dict__["_unifit_strategy"] = strategy
        self.__dict__["_unifit_configured"] = False

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """Placing the module for a run calls configure_model() first, once (Lightning's order)."""
        if self.__dict__.get("_unifit_configured") is False:
            self.__dict__["_unifit_configured"] = True
            self.configure_model()
        return torch.nn.Module.to(self, *args, **kwargs)

    # ---- inside the optimizer step: Lightning's hooks, called in Lightning's order ------------------
    def on_before_zero_grad(self, optimizer: Any) -> None:
        """Before gradients are zeroed (on the first micro-batch of each accumulation window)."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward of the loss (scaled under 16-mixed); override to run it your way (Lightning's hook)."""
        loss.backward(*args, **kwargs)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Before backward of the loss (as training_step returned it)."""

    def on_after_backward(self) -> None:
        """After backward: this rank's gradients (averaged over ranks only once the optimizer steps)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Gradients averaged over every rank and unscaled (16-mixed), before clipping and the step."""

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Clips by trainer.gradient_clip_val by default; override to clip your way (self.clip_gradients)."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """The step; `optimizer_closure` runs forward and backward. Override it to act around the step."""
        optimizer.step(closure=optimizer_closure)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step a scheduler; override for schedulers of other libraries (timm's step(epoch))."""
        scheduler.step() if metric is None else scheduler.step(metric)

    # ---- around the steps: moving batches, the model's modes for validation (Lightning's hooks) -------
    def batch_transfer(self, device: torch.device) -> Any:
        """How a batch reaches `device`: a function (batch, dataloader_idx) -> batch, or None where it is there."""
        return None if device.type == "cpu" else ToDevice(device)

    def on_validation_model_zero_grad(self) -> None:
        """Before a validation inside fit: the gradients are released (Lightning's default)."""
        self.zero_grad(set_to_none=True)

    def on_validation_model_eval(self) -> None:
        self.eval()

    def on_validation_model_train(self) -> None:
        """After a validation inside fit, when overridden (the engine calls it instead of giving each submodule its
        mode from before back, as Lightning does); the default does nothing."""

    def enter_evaluation(self, stage: str) -> None:
        self.__dict__["_modes_before"] = training_modes(self)  # each submodule's, given back by exit_evaluation
        self.eval()

    def exit_evaluation(self, stage: str) -> None:
        restore_modes(self.__dict__.pop("_modes_before", []))

    def overrides_model_train(self) -> bool:
        return type(self).on_validation_model_train is not TrainModule.on_validation_model_train

    # ---- what the engine offers a step (manual optimization, clipping) -----------------------------
    def optimizers(self) -> Any:
        """The optimizers configure_optimizers returned (one, or a list), to step in manual optimization."""
        return self._steps().optimizers()

    def lr_schedulers(self) -> Any:
        return self._steps().lr_schedulers()

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward through the strategy and precision (loss scaling under 16-mixed)."""
        self._steps().backward(loss, *args, **kwargs)

    def clip_gradients(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Clip the optimizer's true (unscaled) gradients: by their global norm over every shard, or by value."""
        self._steps().clip(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def step_hooks(self) -> set[str]:
        """The hooks inside the step (and lr_scheduler_step) this module overrides."""
        return {h for h in (*STEP_HOOKS, "lr_scheduler_step") if getattr(type(self), h) is not getattr(TrainModule, h)}

    def bind_steps(self, seams: Any) -> None:
        """The running engine's StepSeams (None after the fit)."""
        self._unifit_steps = seams

    def _steps(self) -> Any:
        if self._unifit_steps is None:
            raise ConfigError(f"{type(self).__name__}: optimizers and backward are offered only while fit() trains")
        return self._unifit_steps

    def _detach(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if hasattr(value, "full_tensor"):  # a DTensor (computed from fsdp's sharded parameters): its whole value
                value = value.full_tensor()
            return value.detach()
        return TorchmetricValue(value) if is_torchmetric(value) else value


def training_modes(module: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """Each submodule's mode, so that a part kept in eval mode (a frozen backbone) stays so after evaluation."""
    return [(part, part.training) for part in module.modules()]


def restore_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    for part, training in modes:
        part.training = training
