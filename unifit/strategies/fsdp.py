"""PyTorch FSDP2 (`fully_shard` over a DeviceMesh): parameters, gradients and optimizer state sharded.

Each rank keeps 1/N of the model's state; a unit's parameters are gathered for its forward and
backward and dropped after. Built on ddp's process group, launcher and collectives; what differs:
- `wrap_module` shards the units (the `wrap` option's classes, or each child of the model) and the
  step wrapper as root, then points the optimizer at the sharded parameters (it was built before);
- accumulation skips the gradient reduce-scatter; clipping uses the norm over every rank's shards;
- bf16-mixed keeps float32 master weights and reduces gradients in float32 (MixedPrecisionPolicy);
- checkpoints: every rank writes its shards with torch.distributed.checkpoint in the background
  (sharded_state.py), resumable on any world size; whole (ddp, single) checkpoints load here too.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
from concurrent.futures import Future
from typing import Any, ContextManager, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from unifit.errors import CheckpointNotFoundError, ConfigError, first_line
from unifit.strategies import sharded_state
from unifit.strategies.ddp import DDPStrategy

log = logging.getLogger("unifit")

_CONTAINERS = ("ModuleList", "ModuleDict", "Sequential")


class FSDPOptions(BaseModel):
    """trainer.strategy_options for fsdp."""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    sharding: Literal["full", "hybrid"] = Field(
        "full", description="full: shard over every rank; hybrid: shard within a node, replicate across nodes")
    reshard_after_forward: bool = Field(
        True, description="free gathered parameters after forward (gathered again in backward): less memory, more traffic")
    wrap: list[str] | None = Field(
        None, description="class names of the submodules sharded as units (e.g. [TransformerBlock]); "
                          "default: each child module of the model (containers are looked into)")
    cpu_offload: bool = Field(False, description="keep sharded parameters, gradients and optimizer state in host memory (GPU only)")


class FSDPStrategy(DDPStrategy):
    """PyTorch FSDP2: parameters, gradients and optimizer state sharded over the ranks."""

    name = "fsdp"
    Options = FSDPOptions
    routes_all_steps = True
    _checkpoint_group: Any = None

    def setup(self) -> None:
        super().setup()
        if self.options.sharding == "hybrid" and self.env.num_nodes < 2:
            raise ConfigError(
                f"trainer.strategy_options.sharding: 'hybrid' shards within a node and replicates across nodes, but "
                f"this job has one node ({self.world_size} ranks); use 'full', or launch on several nodes (--nnodes)")
        if self.options.sharding == "hybrid" and self.world_size != self.env.num_nodes * self.env.local_world_size:
            raise ConfigError(
                f"trainer.strategy_options.sharding: 'hybrid' needs the same number of ranks on every node; this job "
                f"has {self.world_size} ranks, {self.env.local_world_size} on this node; use 'full'")
        if self._group_ready():
            import torch.distributed as dist

            if self.is_global_zero:
                layout = (f"hybrid sharding, {self.env.num_nodes} node(s) x {self.env.local_world_size} rank(s)"
                          if self.options.sharding == "hybrid" else f"full sharding, {self.world_size} rank(s)")
                log.info("fsdp: %s", layout)
            # checkpoint writes run their collectives on DCP's background thread: a group of their own, on the host
            self._checkpoint_group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=2 * self.collective_timeout_s))

    def teardown(self) -> None:
        import torch.distributed as dist

        if self._checkpoint_group is not None and not self._owns_group and dist.is_initialized():
            dist.destroy_process_group(self._checkpoint_group)
        self._checkpoint_group = None
        super().teardown()

    # ---- training -------------------------------------------------------------------------
    def setup_module_and_optimizer(self, step_module: Any, optimizer: Any, device: Any, precision: Any,
                                   accumulate: int) -> tuple[Any, Any]:
        if precision.name == "16-mixed":
            raise ConfigError("trainer.precision: received '16-mixed', which fsdp does not support (float16 loss "
                              "scaling over sharded gradients); use 'bf16-mixed' or '32-true'")
        before = {id(p): name for name, p in step_module.named_parameters()}
        wrapped, optimizer = super().setup_module_and_optimizer(step_module, optimizer, device, precision, accumulate)
        if wrapped is not step_module or not self._group_ready():
            return wrapped, optimizer
        sharded = dict(step_module.named_parameters())
        for group in optimizer.param_groups:  # the optimizer was built on the unsharded parameters
            try:
                group["params"][:] = [sharded[before[id(p)]] for p in group["params"]]
            except KeyError:
                raise ConfigError("configure_optimizers(): the optimizer holds a tensor that is not a parameter of "
                                  "the module; fsdp shards only the module's parameters") from None
        return wrapped, optimizer

    def wrap_module(self, step_module: Any, device: Any) -> Any:
        opts = self.options
        if opts.cpu_offload and device.type == "cpu":
            raise ConfigError("trainer.strategy_options.cpu_offload: true needs a GPU (on CPU the state is in host "
                              "memory already); set it false or train on GPUs")
        units = self._units(step_module.module)  # checked at any world size: a wrong class name is refused
        if not self._group_ready():
            return step_module
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = self._mesh(device)
        settings: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": opts.reshard_after_forward,
                                    "shard_placement_fn": functools.partial(_placement, ranks=mesh.size(-1))}
        if self.precision.name == "bf16-mixed":
            settings["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if opts.cpu_offload:
            settings["offload_policy"] = CPUOffloadPolicy()
        for unit in units:
            fully_shard(unit, **settings)
        fully_shard(step_module, **settings)  # the root: what no unit holds, and the step's entry
        return step_module

    def _mesh(self, device: Any) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        if self.options.sharding == "hybrid":
            shape = (self.env.num_nodes, self.world_size // self.env.num_nodes)
            return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device.type, (self.world_size,), mesh_dim_names=("shard",))

    def _units(self, model: Any) -> list[Any]:
        """The submodules sharded as units, innermost first (fully_shard wants children before parents);
        units that share a parameter (tied embedding and output weights) are sharded as one group."""
        return _tied_together(self._unit_modules(model))

    def _unit_modules(self, model: Any) -> list[Any]:
        wanted = self.options.wrap
        if wanted is None:
            return list(_children_with_parameters(model))
        found = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
        missing = sorted(set(wanted) - {type(m).__name__ for m in found})
        if missing:
            classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
            raise ConfigError(f"trainer.strategy_options.wrap: {', '.join(missing)} names no submodule of "
                              f"{type(model).__name__}; its submodule classes are: {', '.join(classes)}")
        return list(reversed(found))

    def accumulating(self, wrapped: Any) -> ContextManager[Any]:
        if not self._group_ready():
            return contextlib.nullcontext()
        return _without_gradient_sync(wrapped)

    def clip_gradients(self, parameters: Iterable[Any], max_norm: float) -> None:
        """Clip by the norm of the whole gradient: each rank's shard norms combined over every rank."""
        import torch
        from torch.distributed.tensor import DTensor

        parameters = list(parameters)
        total = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)

    # ---- state IO -------------------------------------------------------------------------
    def training_state(self, module: Any, optimizer: Any) -> dict[str, Any]:
        if not _is_sharded(module):
            return super().training_state(module, optimizer)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        owner = sharded_state.state_module(module)
        return {"model": get_model_state_dict(owner), "optimizer": get_optimizer_state_dict(owner, optimizer)}

    def start_sharded_write(self, state: dict[str, Any], url: str,
                            storage_options: dict[str, Any]) -> tuple[dict[str, Any], Future | None]:
        if self._checkpoint_group is None:
            return super().start_sharded_write(state, url, storage_options)
        shards = {key: state[key] for key in ("model", "optimizer")}
        rest = {key: value for key, value in state.items() if key not in shards}
        rest[sharded_state.SHARDS] = sharded_state.SHARDS  # read_checkpoint makes it the shards' URL
        return rest, sharded_state.start_save(shards, url, storage_options, self._checkpoint_group)

    def load_training_state(self, module: Any, optimizer: Any, state: dict[str, Any],
                            storage_options: dict[str, Any]) -> None:
        if not _is_sharded(module):  # e.g. validate/test/predict, which run the whole model
            return super().load_training_state(module, optimizer, state, storage_options)
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict)

        owner = sharded_state.state_module(module)
        if sharded_state.SHARDS not in state:  # a whole checkpoint (single, ddp, horovod): each rank keeps its part
            whole = StateDictOptions(full_state_dict=True)
            set_model_state_dict(owner, state["model"], options=whole)
            set_optimizer_state_dict(owner, optimizer, sharded_state.by_name(state["optimizer"], optimizer, module),
                                     options=whole)
            return
        url = state[sharded_state.SHARDS]
        mine = {"model": get_model_state_dict(owner), "optimizer": get_optimizer_state_dict(owner, optimizer)}
        try:  # any world size: DCP reads the parts of every saved shard this rank's shards cover
            sharded_state.load_into(mine, url, storage_options, self._checkpoint_group)
        except Exception as exc:
            raise CheckpointNotFoundError(
                f"--ckpt-path: rank {self.rank} cannot read the fsdp shards at {url} ({type(exc).__name__}: "
                f"{first_line(exc)}); every rank reads them: put trainer.checkpoint.dir on storage every host can "
                "read (a shared disk or s3://)") from None
        set_model_state_dict(owner, mine["model"])
        set_optimizer_state_dict(owner, optimizer, mine["optimizer"])

    def full_model_state(self, module: Any) -> dict[str, Any]:
        if not _is_sharded(module):
            return super().full_model_state(module)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(sharded_state.state_module(module),
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _placement(parameter: Any, ranks: int) -> Any:
    """Shard along dim 0 (FSDP's default), unless it has fewer rows than ranks (a Linear(256, 1)'s
    weight would sit on one rank): then along the largest dimension, so every rank holds ~1/N."""
    from torch.distributed.tensor import Shard

    if parameter.dim() > 1 and parameter.shape[0] < ranks:
        return Shard(max(range(parameter.dim()), key=lambda d: parameter.shape[d]))
    return None


def _is_sharded(module: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _tied_together(units: list[Any]) -> list[Any]:
    """Each unit, or a list of the units that share parameters (fully_shard([a, b]): one group)."""
    groups: list[tuple[list[Any], set[int]]] = []
    for unit in units:
        modules, ids = [unit], {id(p) for p in unit.parameters()}
        for group in [g for g in groups if g[1] & ids]:
            groups.remove(group)
            modules, ids = group[0] + modules, group[1] | ids
        groups.append((modules, ids))
    return [modules[0] if len(modules) == 1 else modules for modules, _ in groups]


def _children_with_parameters(module: Any) -> Iterator[Any]:
    """Each child holding parameters; a container (ModuleList, Sequential, a wrapper with one child
    and no parameters of its own) is looked into instead of sharded whole."""
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        own = any(True for _ in child.parameters(recurse=False))
        if type(child).__name__ in _CONTAINERS or (not own and len(list(child.children())) == 1):
            yield from _children_with_parameters(child)
        else:
            yield child


@contextlib.contextmanager
def _without_gradient_sync(wrapped: Any) -> Iterator[None]:
    """An accumulation micro-batch: gradients stay unsharded locally, reduced with the last one."""
    wrapped.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        wrapped.set_requires_gradient_sync(True)
