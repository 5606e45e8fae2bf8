"""How a strategy trains a PyTorch module: set-up, backward, optimizer step, clipping.

Lightning Fabric's Strategy split, for unifit's torch strategies: the engine keeps the data and
the shape of the step (forward, accumulation, warmup), the strategy owns what differs between
distribution methods (wrapping the model and optimizer, skipping gradient sync on accumulation
micro-batches, having averaged gradients before clipping), and the precision object it is given
owns autocast and loss scaling. The defaults are one process's; DDP and Horovod override the
parts that differ, and a sharded strategy (FSDP) would override `clip_gradients` too.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterable

_PLAIN = contextlib.nullcontext()


class TorchTraining:
    """Mixed into a Strategy that trains PyTorch modules."""

    precision: Any = None  # unifit.frameworks.torch.precision.Precision, set by setup_module_and_optimizer

    def setup_module_and_optimizer(self, step_module: Any, optimizer: Any, device: Any, precision: Any,
                                   accumulate: int) -> tuple[Any, Any]:
        """(module to call for a step, optimizer to step): both wrapped for this strategy.
        `step_module.module` is the user's module, already on `device` with rank 0's initial state
        wherever the strategy broadcasts it."""
        self.precision = precision
        wrapped = self.wrap_module(step_module, device)
        return wrapped, self.wrap_optimizer(optimizer, step_module.module, accumulate)

    def wrap_module(self, step_module: Any, device: Any) -> Any:
        """Wrap the model for gradient synchronisation (identity by default)."""
        return step_module

    def wrap_optimizer(self, optimizer: Any, module: Any, accumulate: int) -> Any:
        """Wrap the optimizer for strategies that average gradients in step() (identity by default)."""
        return optimizer

    def accumulating(self, wrapped: Any) -> ContextManager[Any]:
        """Around forward and backward of a micro-batch that does not step: no gradient sync."""
        return _PLAIN

    def backward(self, loss: Any) -> None:
        self.precision.backward(loss)

    def synchronized_gradients(self, optimizer: Any) -> ContextManager[Any]:
        """Context around clipping and the step: gradients are averaged over ranks on entry."""
        return _PLAIN

    def clip_gradients(self, parameters: Iterable[Any], max_norm: float) -> None:
        """Clip the global gradient norm (of the full gradients: sharded strategies override)."""
        import torch

        torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def optimizer_step(self, optimizer: Any, module: Any, clip_val: float | None) -> None:
        """Average gradients, clip the true (unscaled) ones, step through the precision, zero grads."""
        precision = self.precision
        with self.synchronized_gradients(optimizer):
            if clip_val is not None:
                precision.unscale(optimizer)
                self.clip_gradients(module.parameters(), clip_val)
            precision.step(optimizer)
        optimizer.zero_grad()  # set_to_none (torch >= 2 default); wrappers like Horovod take no argument
