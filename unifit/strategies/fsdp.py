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
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Iterator, Literal

from pydantic import Field

from unifit.errors import CheckpointNotFoundError, ConfigError, first_line
from unifit.strategies import sharded_state
from unifit.strategies.ddp import DDPStrategy, ProcessGroupOptions
from unifit.strategies.torch_training import each_optimizer

if TYPE_CHECKING:
    from unifit.strategies.torch_precision import Precision

log = logging.getLogger("unifit")

_CONTAINERS = ("ModuleList", "ModuleDict", "Sequential")


class FSDPOptions(ProcessGroupOptions):
    """trainer.strategy_options for fsdp."""

    sharding: Literal["full", "hybrid"] = Field(
        "full", description="full: shard over every rank; hybrid: shard within a node, replicate across nodes"
    )
    reshard_after_forward: bool = Field(
        True,
        description="free gathered parameters after forward (gathered again in backward): less memory, more traffic",
    )
    wrap: list[str] | None = Field(
        None,
        description="class names of the submodules sharded as units (e.g. [TransformerBlock]); "
        "default: each child module of the model (containers are looked into)",
    )
    cpu_offload: bool = Field(
        False, description="keep sharded parameters, gradients and optimizer state in host memory (GPU only)"
    )
    param_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="with precision bf16-mixed: the dtype parameters are gathered in for forward and backward "
        "(autocast computes in bfloat16 either way; gradients are reduced in float32). bfloat16 "
        "halves the all-gather traffic and the unsharded parameters' memory; BatchNorm-like layers "
        "(running statistics) keep float32 weights and compute in float32. auto: bfloat16 on GPUs, "
        "float32 on CPU",
    )


class FSDPStrategy(DDPStrategy):
    """PyTorch FSDP2: parameters, gradients and optimizer state sharded over the ranks."""

    name = "fsdp"
    Options = FSDPOptions
    routes_all_steps = True
    # accumulating, FSDP2 keeps unsharded gradients that a validation's gather and reshard would disturb
    validates_mid_accumulation = False
    shards_parameters = True
    _checkpoint_group: Any = None
    _views: _ViewOutputs | None = None
    _unfreezing: _UnfreezingGroups | None = None
    _sharded: tuple[Any, list[Any]] | None = None  # the step module and its FSDP modules (accumulation)
    _said_uneven = False  # the first uneven validation was logged

    def setup(self) -> None:
        super().setup()
        if self.options.sharding == "hybrid" and self.env.num_nodes < 2:
            raise ConfigError(
                f"trainer.strategy_options.sharding: 'hybrid' shards within a node and replicates across nodes, but "
                f"this job has one node ({self.world_size} ranks); use 'full', or launch on several nodes (--nnodes)"
            )
        if self.options.sharding == "hybrid" and self.world_size != self.env.num_nodes * self.env.local_world_size:
            raise ConfigError(
                f"trainer.strategy_options.sharding: 'hybrid' needs the same number of ranks on every node; this job "
                f"has {self.world_size} ranks, {self.env.local_world_size} on this node; use 'full'"
            )
        if self._group_ready():
            import torch.distributed as dist

            if self.is_global_zero:
                self._log_layout()
            # checkpoint writes run their collectives on DCP's background thread: a group of their own, on the host
            self._checkpoint_group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=2 * self.collective_timeout_s)
            )

    def _log_layout(self) -> None:
        layout = (
            f"hybrid sharding, {self.env.num_nodes} node(s) x {self.env.local_world_size} rank(s)"
            if self.options.sharding == "hybrid"
            else f"full sharding, {self.world_size} rank(s)"
        )
        log.info("fsdp: %s", layout)

    def teardown(self) -> None:
        import torch.distributed as dist

        if self._checkpoint_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._checkpoint_group)
        self._checkpoint_group = None
        self._sharded = None
        super().teardown()

    # ---- training -------------------------------------------------------------------------
    def setup_module_and_optimizer(
        self, step_module: Any, optimizer: Any, device: Any, precision: Precision, accumulate: int
    ) -> tuple[Any, Any]:
        _refuse_float16(precision)
        before = {id(p): name for name, p in step_module.named_parameters()}
        wrapped, optimizer = super().setup_module_and_optimizer(step_module, optimizer, device, precision, accumulate)
        if wrapped is step_module and self._group_ready():
            follow_shards(optimizer, before, step_module)
        return wrapped, optimizer

    def setup_manual(
        self, step_module: Any, optimizers: list[Any], device: Any, precision: Precision
    ) -> tuple[Any, list[Any]]:
        """Sharded as for automatic optimization: backward reduce-scatters every gradient, so an
        optimizer's step has its averaged shard already (average_gradients has nothing to do)."""
        _refuse_float16(precision)
        self.precision = precision
        before = {id(p): name for name, p in step_module.named_parameters()}
        wrapped = self.wrap_module(step_module, device)
        if self._group_ready():
            for optimizer in optimizers:
                follow_shards(optimizer, before, step_module)
        return wrapped, optimizers

    def late_gradients(self, optimizer: Any) -> list[Any]:
        """None: FSDP2 reduce-scatters the gradient of every parameter that has one, unfrozen later or not."""
        return []

    def average_gradients(self, optimizer: Any, parameters: list[Any] | None = None) -> None:
        """Nothing to do: backward reduce-scattered each gradient into its averaged shard (a parameter unfrozen
        after set-up too: FSDP2 reduces whichever parameters have a gradient)."""

    def wrap_module(self, step_module: Any, device: Any) -> Any:
        opts = self.options
        if opts.cpu_offload and device.type == "cpu":
            raise ConfigError(
                "trainer.strategy_options.cpu_offload: true needs a GPU (on CPU the state is in host "
                "memory already); set it false or train on GPUs"
            )
        units = self._units(step_module.module)  # checked at any world size: a wrong class name is refused
        if not self._group_ready():
            return step_module
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = self._mesh(device)
        settings: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": opts.reshard_after_forward,
            "shard_placement_fn": functools.partial(shard_placement, ranks=mesh.size(-1)),
        }
        norms: list[Any] = []
        if opts.cpu_offload:
            settings["offload_policy"] = CPUOffloadPolicy()
        gathered = self._gather_dtype(device)
        if gathered is not None:
            settings["mp_policy"] = MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32)
            # a norm layer with running statistics keeps float32 weights beside them, and computes in float32
            # (its inputs cast): batch norm refuses bfloat16 weights with float32 statistics (CUDA) or bfloat16
            # inputs with float32 weights (CPU)
            norms = _norms_with_statistics(step_module.module)
            units = [unit for unit in units if unit not in norms]
            as_float32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
            for norm in norms:
                fully_shard(norm, **{**settings, "mp_policy": as_float32})
            self._unfreezing = _UnfreezingGroups(step_module)
        for unit in units:
            fully_shard(unit, **settings)
        fully_shard(step_module, **settings)  # the root: what no unit holds, and the step's entry
        for rnn in (m for m in step_module.modules() if isinstance(m, torch.nn.RNNBase)):
            rnn.register_forward_pre_hook(_gathered_rnn_weights)
        self._views = _ViewOutputs(
            [
                (f"{type(step_module.module).__name__}'s step", step_module),
                *((_unit_name(unit), unit) for unit in units),
            ]
        )
        if self.is_global_zero:
            log.info(
                "fsdp: %d unit(s) sharded (%s), parameters gathered in %s%s",
                len(units),
                ", ".join(sorted({_unit_name(u) for u in units})) or "the root only",
                str(gathered or torch.float32).removeprefix("torch."),
                f" ({len(norms)} norm layer(s) in float32, beside their running statistics)" if norms else "",
            )
        return step_module

    def _gather_dtype(self, device: Any) -> Any:
        """The low dtype parameters are gathered in under a mixed precision (param_dtype auto: on GPUs), or None:
        they stay float32."""
        low = self.precision.dtype if self.precision is not None else None
        wanted = self.options.param_dtype
        if wanted == "auto":
            wanted = "bfloat16" if device.type == "cuda" else "float32"
        return low if low is not None and wanted != "float32" else None

    def backward(self, loss: Any, *args: Any, run: Any = None, **kwargs: Any) -> None:
        if self._views is not None:
            self._views.check_unmodified()  # an in-place op on a unit's view output would skip its all-gather
        if self._unfreezing is not None:
            self._unfreezing.refresh()
        super().backward(loss, *args, run=run, **kwargs)

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
        from unifit.strategies.torch_compat import inner_module, is_checkpoint_wrapped

        # a checkpointed block is sharded as its wrapper (torchtitan's order: the wrapper's forward recomputes it)
        inside = {id(inner_module(m)) for m in model.modules() if is_checkpoint_wrapped(m)}
        found = [
            m
            for m in model.modules()
            if type(inner_module(m)).__name__ in wanted and m is not model and id(m) not in inside
        ]
        missing = sorted(set(wanted) - {type(inner_module(m)).__name__ for m in found})
        if missing:
            classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
            raise ConfigError(
                f"trainer.strategy_options.wrap: {', '.join(missing)} names no submodule of "
                f"{type(model).__name__}; its submodule classes are: {', '.join(classes)}"
            )
        return list(reversed(found))

    def accumulating(self, wrapped: Any) -> ContextManager[Any]:
        if not self._group_ready():
            return contextlib.nullcontext()
        return _without_gradient_sync(self._fsdp_modules(wrapped))

    def evaluating(self, wrapped: Any, uneven: bool) -> ContextManager[Any]:
        """FSDP gathers a unit's parameters in its forward, a collective: a rank with a validation batch more than
        the others would gather alone (gloo: 'collective mismatch', an abort; NCCL: a hang). Every rank gathers the
        whole model once, together, and the forwards run on it without gathering: the model's full size on each
        rank for the length of this validation."""
        sharded = self._fsdp_modules(wrapped) if uneven and self._group_ready() else []
        if not sharded:
            return contextlib.nullcontext()
        if self.is_global_zero and not self._said_uneven:
            self._said_uneven = True
            log.info(
                "%s: the ranks' validation shards take different numbers of batches: the parameters are gathered "
                "whole for each such validation (the model's full size on every rank), so that no rank gathers alone",
                self.name,
            )
        return gathered_through(sharded)

    def _fsdp_modules(self, wrapped: Any) -> list[Any]:
        """The step's FSDP modules (the root where unifit sharded, or those a module's configure_model sharded)."""
        if self._sharded is None or self._sharded[0] is not wrapped:  # found once, not at every micro-batch
            from torch.distributed.fsdp import FSDPModule

            self._sharded = (wrapped, [m for m in wrapped.modules() if isinstance(m, FSDPModule)])
        return self._sharded[1]

    def clip_gradients(self, parameters: Iterable[Any], max_norm: float) -> None:
        """Clip by the norm of the whole gradient: each rank's shard norms combined over every rank, per mesh
        (torch's clip_grad_norm_ refuses gradients on several meshes: tensor-parallel layers beside others)."""
        import torch

        with_grads = [p for p in parameters if p.grad is not None]
        if with_grads:
            total = total_norm([p.grad for p in with_grads])
            for group in by_mesh(with_grads, lambda parameter: parameter.grad):
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)

    # ---- state IO -------------------------------------------------------------------------
    def training_state(self, module: Any, optimizer: Any) -> dict[str, Any]:
        if not _is_sharded(module):
            return super().training_state(module, optimizer)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        owner = sharded_state.state_module(module)
        model = get_model_state_dict(owner)
        self._rank_zero_replicas(model)
        return {"model": model, "optimizer": each_optimizer(optimizer, lambda o: get_optimizer_state_dict(owner, o))}

    def _rank_zero_replicas(self, model: dict[str, Any]) -> None:
        """What FSDP does not shard (buffers: BatchNorm's running statistics) each rank kept from its own
        batches, and DCP writes one rank's copy, not always rank 0's: rank 0's are made every rank's first,
        so a resume restores on every rank what rank 0 had (DDP copies rank 0's buffers every step)."""
        import torch
        from torch.distributed.tensor import DTensor

        self.copy_from_rank_zero(
            {k: v for k, v in model.items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)}
        )

    def start_sharded_write(
        self, state: dict[str, Any], url: str, storage_options: dict[str, Any]
    ) -> tuple[dict[str, Any], Future | None]:
        if self._checkpoint_group is None:
            return super().start_sharded_write(state, url, storage_options)
        shards = {key: state[key] for key in ("model", "optimizer")}
        rest = {key: value for key, value in state.items() if key not in shards}
        rest[sharded_state.SHARDS] = sharded_state.SHARDS  # sharded_state.locate makes it the shards' URL
        url = f"{url}/{sharded_state.SHARDS}"
        return rest, sharded_state.start_save(shards, url, storage_options, self._checkpoint_group)

    def load_training_state(
        self, module: Any, optimizer: Any, state: dict[str, Any], storage_options: dict[str, Any]
    ) -> None:
        if not _is_sharded(module):  # e.g. validate/test/predict, which run the whole model
            return super().load_training_state(module, optimizer, state, storage_options)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        owner = sharded_state.state_module(module)
        if sharded_state.SHARDS not in state:  # a whole checkpoint (single, ddp, horovod): each rank keeps its part
            whole = StateDictOptions(full_state_dict=True)
            set_model_state_dict(owner, state["model"], options=whole)
            if optimizer is not None:
                each_optimizer(
                    optimizer,
                    lambda o, s: set_optimizer_state_dict(owner, o, sharded_state.by_name(s, o, module), options=whole),
                    state["optimizer"],
                )
            return
        url = state[sharded_state.SHARDS]
        mine = {"model": get_model_state_dict(owner)}  # evaluation (optimizer None): the model's shards only
        if optimizer is not None:
            mine["optimizer"] = each_optimizer(optimizer, lambda o: get_optimizer_state_dict(owner, o))
        try:  # any world size: DCP reads the parts of every saved shard this rank's shards cover
            sharded_state.load_into(mine, url, storage_options, self._checkpoint_group)
        except Exception as exc:
            raise CheckpointNotFoundError(
                f"--ckpt-path: rank {self.rank} cannot read the fsdp shards at {url} ({type(exc).__name__}: "
                f"{first_line(exc)}); every rank reads them: put trainer.checkpoint.dir on storage every host can "
                "read (a shared disk or s3://)"
            ) from None
        set_model_state_dict(owner, mine["model"])
        if optimizer is not None:
            each_optimizer(optimizer, lambda o, s: set_optimizer_state_dict(owner, o, s), mine["optimizer"])

    def full_model_state(self, module: Any) -> dict[str, Any]:
        if not _is_sharded(module):
            return super().full_model_state(module)
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        owner = sharded_state.state_module(module)
        if dist.get_backend() == "gloo":  # gloo's all-gather of CUDA tensors crashes (pytorch#152645): via host
            return _gathered_through_host(get_model_state_dict(owner), self.is_global_zero)
        return get_model_state_dict(owner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def by_mesh(items: list[Any], tensor_of: Any = lambda item: item) -> list[list[Any]]:
    """`items` grouped by the mesh of `tensor_of(item)` (a DTensor's), plain tensors' together."""
    groups: list[tuple[Any, list[Any]]] = []  # (mesh or None for plain tensors, its items)
    for tensor in items:
        mesh = getattr(tensor_of(tensor), "device_mesh", None)
        group = next((g for m, g in groups if m == mesh), None)
        if group is None:
            groups.append((mesh, group := []))
        group.append(tensor)
    return [group for _, group in groups]


def total_norm(grads: list[Any]) -> Any:
    """The 2-norm of all of `grads` together, a plain tensor: DTensor shards' norms combined over their meshes
    (torch's get_total_norm refuses gradients on several meshes: tensor-parallel layers beside others)."""
    import torch

    norms = [torch.nn.utils.get_total_norm(group) for group in by_mesh(grads)]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def _gathered_through_host(state: dict[str, Any], keep: bool) -> dict[str, Any]:
    """`state`'s sharded tensors gathered whole from host copies of the shards (what get_model_state_dict's
    full_state_dict does on the devices); on the rank that `keep`s them, the rest get {}."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    hosts: dict[int, Any] = {}
    whole = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            if id(mesh) not in hosts:  # the same ranks and groups, for host tensors
                groups = mesh.get_all_groups()
                hosts[id(mesh)] = DeviceMesh.from_group(
                    groups if len(groups) > 1 else groups[0],
                    "cpu",
                    mesh=mesh.mesh,
                    mesh_dim_names=mesh.mesh_dim_names,
                )
            shard = value.to_local().detach().cpu()
            value = DTensor.from_local(
                shard, hosts[id(mesh)], value.placements, run_check=False, shape=value.shape, stride=value.stride()
            ).full_tensor()
        whole[key] = value.detach().cpu() if hasattr(value, "detach") else value
    return whole if keep else {}


def _refuse_float16(precision: Precision) -> None:
    if precision.scales_loss:
        raise ConfigError(
            f"trainer.precision: received '{precision.name}', which fsdp does not support (float16 loss "
            "scaling over sharded gradients); use 'bf16-mixed' or '32-true'"
        )


def follow_shards(optimizer: Any, before: dict[int, str], step_module: Any) -> None:
    """The optimizer was built on the unsharded parameters (`before`: id -> name): it takes the shards (named
    as before: a block checkpointed since holds them under the checkpoint wrapper)."""
    from unifit.strategies.torch_compat import unwrapped_name

    sharded = {unwrapped_name(name): p for name, p in step_module.named_parameters()}
    for group in optimizer.param_groups:
        try:
            group["params"][:] = [sharded[unwrapped_name(before[id(p)])] for p in group["params"]]
        except KeyError:
            raise ConfigError(
                "configure_optimizers(): the optimizer holds a tensor that is not a parameter of "
                "the module; fsdp shards only the module's parameters"
            ) from None


class _ViewOutputs:
    """FSDP2 registers each unit's pre-backward hook (which gathers its parameters for backward) on the
    unit's outputs; an in-place op on an output that is a view drops that hook, so the unit's backward
    would run on sharded parameters: an error at best, wrong gradients at worst. torch only warns, on
    every view returned, whether or not it is ever modified. This records the views each unit returns
    and their version counters, and before backward refuses, in one line, a step that modified one in
    place (torch's warning is silenced: this check replaces it)."""

    def __init__(self, units: list[tuple[str, Any]]) -> None:
        import warnings

        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        self.seen: list[tuple[str, Any, int]] = []
        for name, unit in units:
            for module in unit if isinstance(unit, list) else [unit]:
                module.register_forward_hook(functools.partial(self._record, name))

    def _record(self, name: str, module: Any, args: Any, output: Any) -> None:
        import torch

        from unifit.strategies.torch_compat import is_view, version_counter

        if not torch.is_grad_enabled():
            return
        for tensor in _tensors(output):
            if tensor.requires_grad and is_view(tensor):
                self.seen.append((name, tensor, version_counter(tensor)))

    def check_unmodified(self) -> None:
        from unifit.strategies.torch_compat import version_counter

        seen, self.seen = self.seen, []
        for name, tensor, version in seen:
            if version_counter(tensor) != version:
                raise ConfigError(
                    f"fsdp: the output of {name} (an FSDP unit; the output is a view) was modified in place before "
                    "backward; FSDP2 then skips gathering that unit's parameters for backward (wrong gradients): use "
                    "out-of-place ops on it (out = out + y, not out += y) or .clone() it first"
                )


def _tensors(output: Any) -> Iterator[Any]:
    import torch

    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


def _unit_name(unit: Any) -> str:
    from unifit.strategies.torch_compat import inner_module

    modules = unit if isinstance(unit, list) else [unit]
    return "+".join(type(inner_module(m)).__name__.removeprefix("FSDP") for m in modules)


class _UnfreezingGroups:
    """Units whose parameters were all frozen at FSDP's lazy init (a backbone, before BackboneFinetuning unfreezes
    it). FSDP2 fixes a unit's gradient dtypes then, from its trainable parameters: with none, a unit unfrozen
    later would hand its bfloat16 gradients to the float32 parameters, which torch refuses. Before each backward
    the units unfrozen since are given their dtypes again (the check costs nothing once none is left frozen)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.frozen: list[Any] | None = None  # known after the first forward (FSDP's lazy init)

    def refresh(self) -> None:
        from unifit.strategies.torch_compat import fsdp_group_trainable, fsdp_param_groups, refresh_fsdp_mixed_precision

        if self.frozen is None:
            from torch.distributed.fsdp import FSDPModule

            groups = [g for m in self.root.modules() if isinstance(m, FSDPModule) for g in fsdp_param_groups(m)]
            self.frozen = [g for g in groups if not fsdp_group_trainable(g)]
        if not self.frozen:
            return
        for group in [g for g in self.frozen if fsdp_group_trainable(g)]:
            refresh_fsdp_mixed_precision(group)
            self.frozen.remove(group)


def _norms_with_statistics(model: Any) -> list[Any]:
    """BatchNorm-like layers (running mean and variance) that have weights."""
    import torch

    return [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.modules.batchnorm._NormBase) and any(True for _ in m.parameters(recurse=False))
    ]


def shard_placement(parameter: Any, ranks: int) -> Any:
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


def _children_with_parameters(module: Any, in_container: bool = False) -> Iterator[Any]:
    """The default units, as torchtitan shards a transformer (each block, the embedding, the head): each
    element of a container (ModuleList, Sequential, ModuleDict: the repeated blocks) and each module with
    parameters of its own; a module without parameters of its own outside a container (a LightningModule's
    `self.model`, a Hugging Face model's body) is looked into, so a wrapped model is never one unit, and so is
    one whose own parameters sit beside a container of blocks (a ViT's or GPT's position embedding and class
    token): its own parameters go with the unit above it (the root), its blocks are units."""
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if type(child).__name__ in _CONTAINERS:
            yield from _children_with_parameters(child, in_container=True)
        elif in_container or (any(True for _ in child.parameters(recurse=False)) and not _holds_blocks(child)):
            yield child
        else:
            yield from _children_with_parameters(child)


def _holds_blocks(module: Any) -> bool:
    """Whether a child of `module` is a container with parameters (its repeated blocks). A module with parameters
    of its own and no such container (nn.MultiheadAttention, whose forward reads its out_proj's weights directly)
    stays whole."""
    return any(type(c).__name__ in _CONTAINERS and any(True for _ in c.parameters()) for c in module.children())


@contextlib.contextmanager
def _without_gradient_sync(sharded: list[Any]) -> Iterator[None]:
    """An accumulation micro-batch: gradients stay unsharded locally, reduced with the last one. Every FSDP module
    of the step is told (the root where unifit sharded, or those a module's configure_model sharded itself)."""
    for module in sharded:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in sharded:
            module.set_requires_gradient_sync(True, recurse=False)


@contextlib.contextmanager
def gathered_through(sharded: list[Any]) -> Iterator[None]:
    """Every FSDP module's parameters gathered (a collective every rank joins here) and kept so through the forwards
    inside (FSDP2 does not gather a gathered unit again); then each module's own resharding back, and its shards."""
    from unifit.strategies.torch_compat import fsdp_param_groups, kept_gathered

    groups = [group for module in sharded for group in fsdp_param_groups(module)]
    try:
        for module in sharded:
            module.unshard()
        with kept_gathered(groups):
            yield
    finally:
        for module in sharded:
            module.reshard()


def _gathered_rnn_weights(rnn: Any, args: Any) -> Any:
    """nn.LSTM/GRU/RNN call their kernel with a cached list of their weights (_flat_weights), filled when
    the module was built; FSDP2 swaps the parameters in and out without refreshing it, so the kernel got
    the sharded DTensors ('mixed torch.Tensor and DTensor'). Runs after FSDP's own pre-forward gathered them.
    The initial hidden state too: PyTorch's idiom `next(self.parameters()).new_zeros(...)`, called outside
    forward, makes a DTensor of a sharded parameter; it is gathered (every rank runs this forward)."""
    from torch.distributed.tensor import DTensor

    from unifit.strategies.torch_compat import refresh_rnn_weights, tree_map

    refresh_rnn_weights(rnn)
    return tree_map(lambda a: a.full_tensor() if isinstance(a, DTensor) else a, args)
