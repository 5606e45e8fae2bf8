"""PyTorch DistributedDataParallel: one process per device, started by torchrun.

GPU path (NCCL, one GPU per process pinned by LOCAL_RANK) follows torch's DDP documentation;
it was written for GPUs but verified on CPU (gloo) only on the machines unifit is built on.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import itertools
import logging
import re
from typing import TYPE_CHECKING, Any, ContextManager, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationInfo, field_validator

from unifit.errors import ConfigError, DistributedError, first_line
from unifit.strategies.base import TorchDistributedStrategy
from unifit.strategies.torch_device import torch_device
from unifit.strategies.torch_training import TorchTraining

if TYPE_CHECKING:
    from unifit.strategies.torch_precision import Precision

log = logging.getLogger("unifit")


class ProcessGroupOptions(BaseModel):
    """The process-group choices of the torch.distributed strategies (ddp, smddp-like, fsdp)."""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: nccl on GPUs (gloo where share_gpus), gloo on CPU"
    )
    share_gpus: bool = Field(
        False,
        description="let several ranks use one GPU (rank r takes GPU local_rank mod the GPUs visible), over "
        "gloo, which takes CUDA tensors (NCCL refuses two ranks on one device): to run the multi-rank CUDA "
        "paths on a one-GPU machine, not for speed",
    )

    @field_validator("share_gpus")
    @classmethod
    def _over_gloo(cls, share: bool, info: ValidationInfo) -> bool:
        if share and info.data.get("backend") == "nccl":
            raise ValueError("needs backend gloo or auto (NCCL refuses two ranks on one device)")
        return share


class DDPOptions(ProcessGroupOptions):
    """trainer.strategy_options for ddp (passed to torch's DistributedDataParallel)."""

    find_unused_parameters: bool = Field(
        False, description="a forward that leaves some parameters out (branches): DDP finds them each step (slower)"
    )
    bucket_cap_mb: PositiveFloat = Field(
        25.0, description="gradients are all-reduced in buckets of this size, overlapping the backward"
    )
    gradient_as_bucket_view: bool = Field(
        True, description="gradients live in the buckets' memory (no copy, less memory)"
    )
    static_graph: bool = Field(
        False, description="the same parameters are used every step: DDP can skip its per-step search"
    )


def average(grads: list[Any], size: int, group: Any = None) -> None:
    """Gradients averaged over `group` (the world by default), in place: one all-reduce per dtype, flattened
    (DDP's buckets, in one)."""
    import torch.distributed as dist

    from unifit.strategies.torch_compat import flatten_dense, unflatten_dense

    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = flatten_dense(same)
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        for grad, averaged in zip(same, unflatten_dense(flat, same)):
            grad.copy_(averaged)


def _destroy_default_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


_GROUPS_MADE = itertools.count()  # process groups this process has made from torchrun's store


class DDPStrategy(TorchDistributedStrategy, TorchTraining):
    name = "ddp"
    Options = DDPOptions

    _owns_group = False
    _barrier_group: Any = None

    def _group_ready(self) -> bool:
        import torch.distributed as dist

        return dist.is_initialized() and self.env.source != "none"

    def setup(self) -> None:
        import torch.distributed as dist

        if self.env.source == "none":
            log.warning(
                "%s: no launcher environment found (RANK/WORLD_SIZE unset), running a world of size 1; "
                "start N processes with: unifit launch --nproc-per-node N -c <experiment.yaml>",
                self.name,
            )
            return
        backend = self._backend_name(torch_device(self.accelerator, self.device_index))
        if not dist.is_initialized():
            # twice the barrier timeout: a rank stuck in a collective because another skipped a barrier
            # must not fail before the barrier does, which names the real mistake
            dist.init_process_group(
                backend=backend,
                timeout=datetime.timedelta(seconds=2 * self.collective_timeout_s),
                **self._init_kwargs(),
            )
            self._owns_group = True
        # barriers get their own gloo group, so they never pair up with another rank's training collectives;
        # a backend that allows no second group (smddp) uses its own barrier
        side_groups = self._allows_side_groups(dist.get_backend())
        side_timeout = datetime.timedelta(seconds=2 * self.collective_timeout_s)  # a lost host fails, not 30 min
        self._barrier_group = dist.new_group(backend="gloo", timeout=side_timeout) if side_groups else None
        if side_groups and dist.get_backend() != "gloo":
            self._host_group = dist.new_group(backend="gloo", timeout=side_timeout)

    def _allows_side_groups(self, backend: str) -> bool:
        return backend != "smddp"

    def _backend_name(self, device: Any) -> str:
        if self.options.backend != "auto":
            return self.options.backend
        return "nccl" if device.type == "cuda" and not self._shares_gpus else "gloo"

    @property
    def _shares_gpus(self) -> bool:
        return bool(getattr(self.options, "share_gpus", False))  # a strategy of the user's may have other options

    @property
    def device_index(self) -> int:
        """Where share_gpus: local_rank mod the GPUs visible (several ranks on one GPU)."""
        if self._shares_gpus:
            import torch

            return self.local_rank % max(torch.cuda.device_count(), 1)
        return self.local_rank

    def _init_kwargs(self) -> dict[str, Any]:
        """Rendezvous: torchrun's store, or the rank facts another launcher (mpirun) gave."""
        if self.env.source == "torchrun":
            return self._torchrun_store()
        return {
            "init_method": f"tcp://{self.env.master_addr}:{self.env.master_port}",
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def _torchrun_store(self) -> dict[str, Any]:
        """torchrun's store, its keys prefixed by the restart attempt: after `--max-restarts` restarts
        the ranks, the agent's store still holds the last attempt's addresses, and gloo would connect to
        the dead ranks (torch 2.13: connectFullMesh 'Connection refused' in the restarted group). The same
        holds for a second fit in one process (a script that trains twice): each group made here gets its
        own prefix too, numbered alike on every rank because every rank runs the same fits in order."""
        import os

        import torch.distributed as dist

        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 serves it (env://)
        store = dist.TCPStore(
            self.env.master_addr,
            self.env.master_port,
            self.world_size,
            is_master=not agent_store and self.rank == 0,
            timeout=datetime.timedelta(seconds=2 * self.collective_timeout_s),
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"unifit/attempt_{attempt}/group_{next(_GROUPS_MADE)}"
        return {"store": dist.PrefixStore(prefix, store), "rank": self.rank, "world_size": self.world_size}

    def teardown(self) -> None:
        """The side groups made for this fit go; the default group stays to the end of the process (as in
        Lightning): the user's module may hold DTensors on it after fsdp, and a script may fit again."""
        import torch.distributed as dist

        if dist.is_initialized():
            for group in (self._barrier_group, self._host_group):
                if group is not None:
                    dist.destroy_process_group(group)
        if self._owns_group:
            atexit.register(_destroy_default_group)
        self._owns_group = False
        self._barrier_group = self._host_group = None

    def wrap_module(self, step_module: Any, device: Any) -> Any:
        """DistributedDataParallel: broadcasts rank 0's parameters, averages gradients in backward."""
        if not self._group_ready():
            return step_module
        opts = self.options
        ddp = _checked_ddp()(
            step_module,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=opts.find_unused_parameters,
            bucket_cap_mb=opts.bucket_cap_mb,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
        )
        self._register_comm_hook(ddp)
        return ddp

    def setup_manual(
        self, step_module: Any, optimizers: list[Any], device: Any, precision: Precision
    ) -> tuple[Any, list[Any]]:
        """No DistributedDataParallel wrapper (its reducer expects one backward per forward over every
        parameter; a GAN's toggled optimizers break that): rank 0's parameters and buffers are broadcast
        once, and average_gradients averages each optimizer's gradients when it steps."""
        self.precision = precision
        if self._group_ready():
            import torch.distributed as dist

            for tensor in step_module.state_dict().values():
                dist.broadcast(tensor, src=0)
        return step_module, optimizers

    def average_gradients(self, optimizer: Any, parameters: list[Any] | None = None) -> None:
        """One all-reduce per dtype over the optimizer's gradients, flattened (DDP's buckets, in one)."""
        if not self._group_ready():
            return
        params = parameters if parameters is not None else [p for g in optimizer.param_groups for p in g["params"]]
        average([p.grad for p in params if p.grad is not None], self.world_size)

    def _register_comm_hook(self, ddp: Any) -> None:
        """Strategies built on ddp (smddp-like) replace the gradient allreduce here."""

    def accumulating(self, wrapped: Any) -> ContextManager[Any]:
        if not self._group_ready():
            return super().accumulating(wrapped)
        return wrapped.no_sync()

    def barrier(self, name: str) -> None:
        if not self._group_ready():
            return
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.collective_timeout_s)
        try:
            if self._barrier_group is None:
                dist.barrier()  # ends after the group's timeout; cannot name the missing ranks
            else:  # reports which ranks are missing instead of hanging
                dist.monitored_barrier(group=self._barrier_group, timeout=timeout, wait_all_ranks=True)
        except RuntimeError as exc:
            raise DistributedError(
                f"barrier '{name}' on rank {self.rank} failed within {self.collective_timeout_s:g}s: {first_line(exc)}; "
                "every rank must call it (e.g. do not call save_checkpoint inside 'if rank == 0')"
            ) from exc


# what DDP's reducer says, on every rank, at the forward after a backward that left parameters without gradients
_UNUSED = "Expected to have finished reduction in the prior iteration"


@functools.cache
def _checked_ddp() -> type:
    """DistributedDataParallel whose forward answers DDP's unused-parameter error in one line naming the option
    and the parameters (a target network, a branch not taken); training itself is unchanged."""
    from torch.nn.parallel import DistributedDataParallel

    class CheckedDDP(DistributedDataParallel):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().forward(*args, **kwargs)
            except RuntimeError as exc:
                if _UNUSED not in str(exc):
                    raise
                raise ConfigError(unused_parameters_message(self.module, str(exc))) from None

    return CheckedDDP


def unused_parameters_message(module: Any, error: str) -> str:
    """The one line for DDP's unused-parameter error: which parameters (by the indices DDP names) and the fix."""
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", error)
    trained = [p for p in module.parameters() if p.requires_grad]  # DDP's indices count these
    indices = [int(i) for i in found.group(1).split()] if found else []
    named = {id(p): name for name, p in _user_module(module).named_parameters()}
    names = [named.get(id(trained[i]), f"#{i}") for i in indices if i < len(trained)]
    which = f"parameters {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}" if names else "some parameters"
    return (
        f"ddp: {which} took part in no loss of the last training step, so DistributedDataParallel cannot average "
        "their gradients; set trainer.strategy_options: {find_unused_parameters: true} (DDP then looks for them each "
        "step), or set requires_grad=False on parameters that are not trained (a target network)"
    )


def _user_module(module: Any) -> Any:
    """The module the user wrote, whose parameter names they know (inside unifit's step module: state_module)."""
    for inner in module.modules():
        if hasattr(inner, "state_module"):
            return inner.state_module
    return module
