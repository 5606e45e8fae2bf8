"""Horovod's training part for PyTorch modules (its row in the registry's table): hvd.DistributedOptimizer
and a broadcast of rank 0's parameters; also the horovod.torch binding its collectives go through."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from unifit.strategies.horovod.strategy import Binding, import_horovod
from unifit.strategies.torch_training import TorchTraining

if TYPE_CHECKING:
    from unifit.strategies.horovod.strategy import HorovodStrategy


class TorchHorovod(TorchTraining, Binding):
    errors = (RuntimeError,)  # HorovodInternalError is a RuntimeError
    strategy: HorovodStrategy

    def __init__(self, strategy: HorovodStrategy) -> None:
        super().__init__(strategy)
        self.hvd = import_horovod("torch", "HOROVOD_WITH_PYTORCH")

    def pin_device(self, local_rank: int, accelerator: str) -> None:
        if accelerator in ("auto", "gpu") and torch.cuda.is_available():
            torch.cuda.set_device(local_rank)  # GPU path per Horovod's docs; verified on CPU only

    def all_reduce(self, values: np.ndarray, op: str, name: str) -> np.ndarray:
        hvd = self.hvd
        return hvd.allreduce(torch.from_numpy(values), op=hvd.Sum if op == "sum" else hvd.Max, name=name).numpy()

    def wrap_optimizer(self, optimizer: Any, model: torch.nn.Module, accumulate: int) -> Any:
        """Every rank starts from rank 0's parameters and buffers; step() averages the gradients,
        every `accumulate` backward passes (Horovod's own accumulation: the longest window of an accumulation
        schedule; a shorter one is averaged at the step, where Horovod's synchronize() reduces what is left)."""
        hvd = self.strategy.hvd
        if self.strategy.world_size == 1:
            return optimizer
        with self.strategy.collective("broadcast of the initial parameters"):
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = hvd.Compression.fp16 if self.strategy.options.compression == "fp16" else hvd.Compression.none
        wrapped = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            op=hvd.Average,
            backward_passes_per_step=accumulate,
            compression=compression,
        )
        # Horovod rebuilds the optimizer from its param groups with the class's defaults (SGD: momentum 0):
        # a group added later (add_param_group, a finetuning callback) must get the user's defaults instead
        wrapped.defaults = dict(optimizer.defaults)
        return wrapped

    def setup_manual(
        self, step_module: Any, optimizers: list[Any], device: Any, precision: Any
    ) -> tuple[Any, list[Any]]:
        """Plain optimizers (hvd.DistributedOptimizer counts backward passes per step, which manual
        optimization leaves to the user): rank 0's state broadcast, gradients averaged in average_gradients."""
        self.precision = precision
        if self.strategy.world_size > 1:
            with self.strategy.collective("broadcast of the initial parameters"):
                self.strategy.hvd.broadcast_parameters(step_module.state_dict(), root_rank=0)
        return step_module, optimizers

    def average_gradients(self, optimizer: Any, parameters: list[Any] | None = None) -> None:
        if self.strategy.world_size == 1:
            return
        hvd = self.strategy.hvd
        params = parameters if parameters is not None else [p for g in optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        with self.strategy.collective("gradient allreduce"):
            averaged = hvd.grouped_allreduce(grads, op=hvd.Average)
        for grad, value in zip(grads, averaged):
            grad.copy_(value)

    @contextlib.contextmanager
    def synchronized_gradients(self, optimizer: Any) -> Iterator[None]:
        """The averaged gradients are in place on entry, so clipping sees them; step() then skips its sync."""
        if self.strategy.world_size == 1:  # not wrapped (wrap_optimizer)
            yield
            return
        with self.strategy.collective("gradient allreduce"):
            optimizer.synchronize()
        with optimizer.skip_synchronize():
            yield
