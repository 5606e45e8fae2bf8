"""What a module's own step code calls into: backward, an optimizer's step, clipping.

Lightning lets a module take part in its optimizer step: hooks around backward and the step
(`on_before_backward`, `on_before_optimizer_step`, `configure_gradient_clipping`, an `optimizer_step`
override around the closure...), and manual optimization, where training_step itself calls
`self.manual_backward(loss)`, `opt.step()` and `self.clip_gradients(opt, ...)` for one optimizer or
several (a GAN). Lightning routes those calls through its strategy and precision plugin; unifit
routes them through the same seams its own step uses: the precision (autocast, loss scaling), the
strategy's training part (averaging, clipping by the global norm over shards) and the engine's
warmup and step count. `StepSeams` is that routing, made by the engine when a module needs it, so
the engine's plain step stays as fast as it was for modules that need none of it.

Order (Lightning 2.x's, checked against its Trainer by tests/test_lightning.py):
    automatic: training_step, [first micro-batch of a window: on_before_zero_grad, optimizer_zero_grad],
        on_before_backward, backward, on_after_backward, then on the window's last micro-batch
        optimizer_step(closure) -> gradients averaged and unscaled, on_before_optimizer_step,
        configure_gradient_clipping, the step, lr_scheduler_step (interval "step")
    manual: training_step calls manual_backward (on_before_backward, backward, on_after_backward) and
        opt.step() (gradients averaged and unscaled, on_before_optimizer_step, the step)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from unifit.errors import ConfigError

# the hooks a module may override to take part in the step (TrainModule's names, which are Lightning's)
STEP_HOOKS = (
    "backward",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
    "optimizer_step",
)


class StepOptimizer:
    """An optimizer as a module's step code holds it: step() goes through unifit (gradients averaged and
    unscaled, the module's hooks, warmup, the step count); everything else is the optimizer's own."""

    def __init__(self, optimizer: Any, seams: StepSeams) -> None:
        self.optimizer = optimizer
        self._seams = seams

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        return self._seams.step(self.optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class StepSeams:
    """The engine's step, opened to the module (`manual`: automatic_optimization = False)."""

    def __init__(self, engine: Any, manual: bool, hooked: bool) -> None:
        self.engine = engine
        self.manual = manual
        self.hooked = hooked  # the module overrides hooks inside the automatic step
        self.handles = [StepOptimizer(o, self) for o in engine.optimizers]
        self.steps_taken = [0] * len(engine.optimizers)  # per optimizer: each warms up over its own steps
        self._averaged: set[int] = set()  # optimizers whose gradients were averaged for a clip before the step
        self._losses: list[torch.Tensor] = []  # what manual_backward received during this batch
        self._loss: torch.Tensor | None = None  # automatic: the loss the closure computed
        engine.training.gradient_hooks = self._before_automatic_step if hooked and not manual else None

    # ---- what the module calls -------------------------------------------------------------
    def optimizers(self) -> Any:
        return self.handles[0] if len(self.handles) == 1 else list(self.handles)

    def lr_schedulers(self) -> Any:
        schedulers = [spec.scheduler for spec in self.engine.schedules]
        return None if not schedulers else schedulers[0] if len(schedulers) == 1 else schedulers

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's strategy.backward: the hooks around the precision's (scaled) backward, which runs the
        module's own `backward` hook (`args`: Tensor.backward's, e.g. retain_graph=True)."""
        module = self.engine.module
        module.on_before_backward(loss)
        self.engine.training.backward(loss, *args, run=module.backward, **kwargs)
        module.on_after_backward()
        if self.manual:
            self._losses.append(loss.detach())

    def step(self, optimizer: Any, closure: Callable[[], Any] | None) -> Any:
        if not self.manual:  # optimizer_step's default: the closure (forward, backward), then the step
            result = closure() if closure is not None else None
            self.engine._optimizer_step(taken=result is not None or _has_gradients(optimizer))
            return result
        result = closure() if closure is not None else None
        engine, i = self.engine, self._index(optimizer)
        self._average(optimizer)
        engine.precision.unscale(optimizer)
        engine.module.on_before_optimizer_step(optimizer)
        ramp = engine.policy.ramp(self.steps_taken[i])
        scheduled = [group["lr"] for group in optimizer.param_groups]
        if ramp != 1.0:
            for group in optimizer.param_groups:
                group["lr"] *= ramp
        engine.precision.step(optimizer)
        if ramp != 1.0:
            for group, lr in zip(optimizer.param_groups, scheduled):
                group["lr"] = lr
        self._averaged.discard(id(optimizer))
        self.steps_taken[i] += 1
        engine._steps += 1  # global_step counts every optimizer's steps, as Lightning's does
        return result

    def clip(self, optimizer: Any, clip_val: float | None, algorithm: Any = None) -> None:
        """Clip the true gradients: averaged over ranks first (manual optimization, where they are not
        yet), unscaled, then by their global norm over every shard, or by value."""
        engine = self.engine
        clip_val = engine.config.gradient_clip_val if clip_val is None else clip_val
        if not clip_val or clip_val <= 0:
            return
        algorithm = str(getattr(algorithm, "value", algorithm) or "norm").lower()
        if algorithm not in ("norm", "value"):
            raise ConfigError(f"clip_gradients: gradient_clip_algorithm received {algorithm!r}; use 'norm' or 'value'")
        self._average(optimizer)
        engine.precision.unscale(optimizer)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        if algorithm == "norm":
            engine.training.clip_gradients(parameters, clip_val)
        else:
            torch.nn.utils.clip_grad_value_(parameters, clip_val)

    # ---- what the engine calls -------------------------------------------------------------
    def train_step(self, batch: Any, batch_idx: int, epoch: int) -> torch.Tensor | None:
        return self._manual_step(batch, batch_idx) if self.manual else self._automatic_step(batch, batch_idx, epoch)

    def _manual_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        engine = self.engine
        self._losses = []
        with engine.precision.autocast():
            out = engine._forward(batch, batch_idx)
        if isinstance(out, torch.Tensor) or (isinstance(out, dict) and "loss" in out):
            loss = out if isinstance(out, torch.Tensor) else out["loss"]
            return loss.detach()
        if self._losses:  # the step's loss: the sum of what it backpropagated (each optimizer's loss)
            return torch.stack([loss.float() for loss in self._losses]).sum()
        return torch.zeros((), device=engine.device)

    def _automatic_step(self, batch: Any, batch_idx: int, epoch: int) -> torch.Tensor | None:
        engine, module = self.engine, self.engine.module
        accumulate, optimizer = engine.accumulate, engine.optimizer
        first = accumulate == 1 or batch_idx % accumulate == 0
        stepping = accumulate == 1 or (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == engine.batches_per_epoch
        self._loss = None
        ran = False

        def closure() -> torch.Tensor | None:
            nonlocal ran
            ran = True
            with engine.precision.autocast():
                out = engine._forward(batch, batch_idx)
            if first:
                module.on_before_zero_grad(optimizer)
                module.optimizer_zero_grad(epoch, batch_idx, optimizer)
            if out is None:  # a skipped batch (one process only): no backward, as Lightning's closure
                return None
            loss = _loss_of(out)
            self.backward(loss / accumulate if accumulate != 1 else loss)
            self._loss = loss
            return loss

        if stepping:
            module.optimizer_step(epoch, batch_idx, self.handles[0], closure)
        else:
            with engine.training.accumulating(engine.wrapped):
                closure()
        if not ran:
            raise ConfigError(
                f"{type(module).__name__}.optimizer_step did not call optimizer.step(closure=optimizer_closure); "
                "the closure runs training_step and backward: pass it on"
            )
        return self._loss

    def _before_automatic_step(self, optimizer: Any) -> None:
        """Gradients averaged and unscaled (TorchTraining.optimizer_step): the module's hooks, clipping."""
        module = self.engine.module
        module.on_before_optimizer_step(optimizer)
        module.configure_gradient_clipping(optimizer, self.engine.config.gradient_clip_val, "norm")

    def _average(self, optimizer: Any) -> None:
        if self.manual and id(optimizer) not in self._averaged:
            self.engine.training.average_gradients(optimizer)
            self._averaged.add(id(optimizer))

    def _index(self, optimizer: Any) -> int:
        for i, known in enumerate(self.engine.optimizers):
            if known is optimizer:
                return i
        raise ConfigError(
            f"{type(self.engine.module).__name__}: stepped an optimizer configure_optimizers() did not return; "
            "step the ones self.optimizers() gives"
        )


def _has_gradients(optimizer: Any) -> bool:
    """Whether an earlier micro-batch of the window left gradients (asked only after a skipped batch)."""
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    raise ConfigError(
        f"training_step returned {type(output).__name__}; return the loss tensor or a dict with key 'loss'"
    )
