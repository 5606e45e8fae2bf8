"""How a strategy trains a PyTorch module: set-up, backward, optimizer step, clipping.

Lightning Fabric's Strategy split, for unifit's torch strategies: the engine keeps the data and
the shape of the step (forward, accumulation, warmup), the strategy owns what differs between
distribution methods (wrapping the model and optimizer, skipping gradient sync on accumulation
micro-batches, having averaged gradients before clipping), and the precision object it is given
owns autocast and loss scaling. The defaults are one process's; DDP and Horovod override the
parts that differ, and a sharded strategy (fsdp.py) also overrides `clip_gradients` and the state
IO at the end: what a checkpoint holds of the model and optimizer, and who writes it.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable

from unifit.strategies import sharded_state
from unifit.strategies.block_functions import prepare_blocks

if TYPE_CHECKING:
    from unifit.config.schema import TrainerConfig
    from unifit.strategies.torch_precision import Precision

_PLAIN = contextlib.nullcontext()


def each_optimizer(optimizer: Any, fn: Callable[..., Any], *states: Any) -> Any:
    """`fn(optimizer, *states)`, or one call per optimizer where a module steps several (manual
    optimization: `optimizer` and each state are lists, in configure_optimizers' order)."""
    if isinstance(optimizer, (list, tuple)):
        return [fn(o, *(s[i] for s in states)) for i, o in enumerate(optimizer)]
    return fn(optimizer, *states)


class TorchTraining:
    """How a strategy trains PyTorch modules: made for a strategy from the registry's table (the plain
    one for single), or the strategy itself where it is built on torch.distributed (ddp, fsdp)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    precision: Precision | None = None  # set by setup_module_and_optimizer
    # a sharded model gathers its parameters in its root wrapper's forward: every step (validation
    # too) must go through it, not straight to the module's method
    routes_all_steps = False
    # the gradients of an accumulation window are plain tensors in .grad that an evaluation forward leaves alone,
    # so a validation may run inside the window (Lightning's val_check_interval in batches); not under fsdp
    validates_mid_accumulation = True
    # each rank holds a shard of every parameter (fsdp): code that copies the whole model (Lightning's
    # WeightAveraging) cannot follow it
    shards_parameters = False
    # set by the engine when the module has hooks between backward and the step (Lightning's
    # on_before_optimizer_step, configure_gradient_clipping): called with the optimizer once its
    # gradients are averaged and unscaled, in place of clipping by clip_val
    gradient_hooks: Callable[[Any], None] | None = None
    _synced: frozenset[int] | set[int] = frozenset()  # see setup_module_and_optimizer and late_gradients
    _late_key: tuple[int, ...] = ()
    _late: list[Any] = []

    def setup_module_and_optimizer(
        self, step_module: Any, optimizer: Any, device: Any, precision: Precision, accumulate: int
    ) -> tuple[Any, Any]:
        """(module to call for a step, optimizer to step): both wrapped for this strategy.
        `step_module.module` is the user's module, already on `device` with rank 0's initial state
        wherever the strategy broadcasts it."""
        self.precision = precision
        # what the wrappers below average: the optimizer's trainable parameters now (DDP's reducer and Horovod's
        # hooks are made once); see late_gradients for the others
        self._synced = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        self._late_key, self._late = (), []
        wrapped = self.wrap_module(step_module, device)
        return wrapped, self.wrap_optimizer(optimizer, step_module.module, accumulate)

    def prepare_blocks(self, model: Any, config: TrainerConfig) -> list[str]:
        """Activation checkpointing and compiling per block on `model`, before the model is wrapped or sharded (a
        strategy that splits the blocks first does it itself, after the split); the lines saying what was done."""
        return prepare_blocks(model, config)

    def wrap_module(self, step_module: Any, device: Any) -> Any:
        """Wrap the model for gradient synchronisation (identity by default)."""
        return step_module

    def wrap_optimizer(self, optimizer: Any, module: Any, accumulate: int) -> Any:
        """Wrap the optimizer for strategies that average gradients in step() (identity by default)."""
        return optimizer

    def accumulating(self, wrapped: Any) -> ContextManager[Any]:
        """Around forward and backward of a micro-batch that does not step: no gradient sync."""
        return _PLAIN

    def evaluating(self, wrapped: Any, uneven: bool) -> ContextManager[Any]:
        """Around a validation inside fit; `uneven`: the ranks take different numbers of batches (shards of a dataset
        that does not divide evenly) where `routes_all_steps`, so a forward that is a collective must not be left to
        some ranks only. Nothing to do for a forward without collectives."""
        return _PLAIN

    def backward(self, loss: Any, *args: Any, run: Any = None, **kwargs: Any) -> None:
        """Backward through the precision; `run`: the module's own backward hook (Lightning's), given the scaled loss."""
        self.precision.backward(loss, *args, run=run, **kwargs)

    def synchronized_gradients(self, optimizer: Any) -> ContextManager[Any]:
        """Context around clipping and the step: gradients are averaged over ranks on entry."""
        return _PLAIN

    def clip_gradients(self, parameters: Iterable[Any], max_norm: float) -> None:
        """Clip the global gradient norm (of the full gradients: sharded strategies override)."""
        import torch

        torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def late_gradients(self, optimizer: Any) -> list[Any]:
        """The optimizer's parameters with a gradient that the wrapper made at set-up does not average: added to it
        later or unfrozen after (Lightning's BaseFinetuning unfreezes a backbone and adds its param group
        mid-training). They are averaged by hand before the step (average_gradients)."""
        key = tuple(len(group["params"]) for group in optimizer.param_groups)
        if key != self._late_key:  # a param group was added: look again (a few integers per step otherwise)
            self._late_key = key
            self._late = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in self._synced]
        return [p for p in self._late if p.grad is not None]

    def optimizer_step(self, optimizer: Any, module: Any, clip_val: float | None) -> None:
        """Average gradients, clip the true (unscaled) ones, step through the precision, zero grads."""
        precision = self.precision
        late = self.late_gradients(optimizer)
        if late:
            self.average_gradients(optimizer, late)
        with self.synchronized_gradients(optimizer):
            if self.gradient_hooks is not None:
                precision.unscale(optimizer)
                self.gradient_hooks(optimizer)
            elif clip_val is not None:
                precision.unscale(optimizer)
                self.clip_gradients(module.parameters(), clip_val)
            precision.step(optimizer)
        optimizer.zero_grad()  # set_to_none (torch >= 2 default); wrappers like Horovod take no argument

    # ---- manual optimization ---------------------------------------------------------------
    # The module's training_step calls backward and steps its optimizers itself (Lightning's
    # automatic_optimization = False: GANs, several optimizers, accumulation by hand), in any order
    # and any number of times per batch; so gradients are averaged when an optimizer steps, over that
    # optimizer's parameters only (as Horovod's DistributedOptimizer does), not during backward.
    def setup_manual(
        self, step_module: Any, optimizers: list[Any], device: Any, precision: Any
    ) -> tuple[Any, list[Any]]:
        """(module to call for a step, optimizers to step) for manual optimization: every rank starts
        from rank 0's state; nothing averages gradients in backward."""
        self.precision = precision
        return step_module, optimizers

    def average_gradients(self, optimizer: Any, parameters: list[Any] | None = None) -> None:
        """Average the gradients of `optimizer`'s parameters (or of `parameters`) over the ranks (manual
        optimization, late_gradients; one process: nothing to do)."""

    def manual_step(self, optimizer: Any, before_step: Callable[[Any], None]) -> None:
        """One optimizer's step in manual optimization: gradients averaged, unscaled, then
        `before_step(optimizer)` (the module's hooks), then the step through the precision."""
        self.average_gradients(optimizer)
        self.precision.unscale(optimizer)
        before_step(optimizer)
        self.precision.step(optimizer)

    # ---- state IO ------------------------------------------------------------------------
    def training_state(self, module: Any, optimizer: Any) -> dict[str, Any]:
        """The model's and optimizer's state for a checkpoint (this rank's shards, where sharded)."""
        return {"model": module.state_dict(), "optimizer": each_optimizer(optimizer, lambda o: o.state_dict())}

    def start_sharded_write(
        self, state: dict[str, Any], url: str, storage_options: dict[str, Any]
    ) -> tuple[dict[str, Any], Future | None]:
        """(what rank 0 writes in state.pt, this rank's write of its shards into the checkpoint directory
        `url`, already started).
        Unsharded state is all rank 0's to write: nothing to start."""
        return state, None

    def load_training_state(
        self, module: Any, optimizer: Any, state: dict[str, Any], storage_options: dict[str, Any]
    ) -> None:
        """Load a checkpoint's model (and optimizer, unless None) state. One written by a sharded
        strategy is read whole on this process, so its checkpoints resume here too."""
        if sharded_state.SHARDS in state:
            whole = sharded_state.read_whole(state[sharded_state.SHARDS], storage_options)
            module.load_state_dict(whole["model"])
            if optimizer is not None:
                each_optimizer(
                    optimizer, lambda o, s: o.load_state_dict(sharded_state.by_index(s, o, module)), whole["optimizer"]
                )
            return
        module.load_state_dict(state["model"])
        if optimizer is not None:
            each_optimizer(optimizer, lambda o, s: o.load_state_dict(s), state["optimizer"])

    def full_model_state(self, module: Any) -> dict[str, Any]:
        """The whole model's weights, on rank 0 (called on every rank: gathering shards is collective)."""
        return module.state_dict()
