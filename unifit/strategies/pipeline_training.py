"""The strategy's training hooks under pipeline stages (model-parallel with `pipeline_parallel` above 1; the stages
themselves are pipeline.py's): the schedule runs backward, tied weights' gradients are summed over the stages and a
stage's averaged over its replicas, clipping takes the norm over every stage, checkpoints are written sharded (each
rank its stage's part, through DCP) and the export gathered whole on rank 0. Without a pipeline each hook is the data-parallel base's (the next class in the strategy's MRO)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterable

from unifit.errors import ConfigError
from unifit.strategies import sharded_state
from unifit.strategies.ddp import average
from unifit.strategies.fsdp import by_mesh, follow_shards, total_norm
from unifit.strategies.torch_training import each_optimizer

if TYPE_CHECKING:
    from unifit.strategies.torch_precision import Precision


class PipelineTraining:
    """Mixed into ModelParallelStrategy before FSDPStrategy; `_pipeline` is the PipelinedStep while stages run."""

    _pipeline: Any = None  # pipeline.PipelinedStep, with pipeline_parallel above 1
    _unowned: set[str] | None = None  # the state's names no stage holds (rank 0 writes them)
    _trim_pending = False  # a resumed optimizer state holds the other stages' too (dropped at the first step)
    # ModelParallelStrategy's
    pipeline_parallel: int
    tensor_parallel: int
    rank: int
    data_parallel_size: int
    data_parallel_rank: int
    device_mesh: Any
    precision: Precision | None
    is_global_zero: bool
    all_gather_object: Any

    def setup_module_and_optimizer(
        self, step_module: Any, optimizer: Any, device: Any, precision: Precision, accumulate: int
    ) -> tuple[Any, Any]:
        before = {id(p): name for name, p in step_module.named_parameters()}
        wrapped, optimizer = super().setup_module_and_optimizer(step_module, optimizer, device, precision, accumulate)
        if self._pipeline is not None:  # tensor parallelism replaced the split layers' parameters: the optimizer's too
            follow_shards(optimizer, before, step_module)
        return wrapped, optimizer

    def setup_manual(
        self, step_module: Any, optimizers: list[Any], device: Any, precision: Precision
    ) -> tuple[Any, list[Any]]:
        if self.pipeline_parallel > 1:
            raise ConfigError(
                f"{type(step_module.module.state_module).__name__}: manual optimization (automatic_optimization = "
                "False) under pipeline_parallel: the schedule runs backward itself; use automatic optimization, or "
                "fsdp / tensor_parallel"
            )
        return super().setup_manual(step_module, optimizers, device, precision)

    def accumulating(self, wrapped: Any) -> Any:
        """Pipelining reduces each batch's gradients itself (a stage's replicas: at the step)."""
        if self._pipeline is not None:
            return contextlib.nullcontext()
        return super().accumulating(wrapped)

    def backward(self, loss: Any, *args: Any, run: Any = None, **kwargs: Any) -> None:
        if self._pipeline is not None:
            self._pipeline.backward(loss, self.precision)
            return
        super().backward(loss, *args, run=run, **kwargs)

    def synchronized_gradients(self, optimizer: Any) -> Any:
        """Pipeline: tied weights' gradients summed over the stages, then a stage's averaged over its replicas (ddp's
        average, over the data-parallel ranks)."""
        if self._pipeline is not None:
            if self._trim_pending:  # a resumed state: the other stages' optimizer state is not this rank's to keep
                each_optimizer(optimizer, lambda o: _keep_owned(o, self._pipeline.pipeline.owned_ids))
                self._trim_pending = False
            self._pipeline.pipeline.sum_shared_gradients()
            if self.data_parallel_size > 1:  # a tensor-parallel gradient: its shard (the replicas' places match)
                from unifit.strategies.pipeline import local

                params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                grads = [local(p.grad) for p in params if not _sharded_over_replicas(p)]  # FSDP2 reduced those
                average(grads, self.data_parallel_size, self.device_mesh["data_parallel"].get_group())
        return super().synchronized_gradients(optimizer)

    def clip_gradients(self, parameters: Iterable[Any], max_norm: float) -> None:
        """Pipeline: the norm over every stage's gradients (each rank holds one stage's), then each clipped by it."""
        if self._pipeline is None:
            return super().clip_gradients(parameters, max_norm)
        import torch
        import torch.distributed as dist

        with_grads = [p for p in parameters if p.grad is not None]
        below = self._pipeline.pipeline.counted_below  # a tied weight's gradient counts once, on its lowest stage
        counted = [p.grad for p in with_grads if id(p) not in below]
        stage = total_norm(counted) if counted else None  # over the stage's tensor-parallel shards too
        squared = (stage.float() ** 2) if stage is not None else torch.zeros((), device=self._pipeline.pipeline.device)
        dist.all_reduce(squared, group=self.device_mesh["pipeline_parallel"].get_group())
        for group in by_mesh(with_grads, lambda parameter: parameter.grad):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, squared.sqrt())

    def copy_from_rank_zero(self, tensors: dict[str, Any]) -> None:
        """Pipeline: from the first replica of this rank's stage (rank 0 holds another stage's values)."""
        if self._pipeline is None:
            return super().copy_from_rank_zero(tensors)
        import torch.distributed as dist

        if self.data_parallel_size == 1:
            return
        group = self.device_mesh["data_parallel"].get_group()
        for tensor in tensors.values():
            dist.broadcast(tensor.data, group=group, group_src=0)

    def training_state(self, module: Any, optimizer: Any) -> dict[str, Any]:
        """Pipeline: what this rank's stage holds, by name (a split tensor's shard), for DCP's sharded write (fsdp's
        start_sharded_write): every rank writes its part, none gathers the whole; the tensors no stage holds (a
        buffer no stage reads), rank 0 writes. Before the first batch has built the stages every rank holds the whole
        state (as resumed or begun): each writes it, DCP keeps one copy."""
        if self._pipeline is None:
            return super().training_state(module, optimizer)
        owner = sharded_state.state_module(module)
        owned = self._pipeline.pipeline.owned_ids
        model = owner.state_dict(keep_vars=True)
        if not owned:
            split = self._split_anywhere(model)  # with tensor parallelism: this stage's layers split already
            named = each_optimizer(optimizer, lambda o: _without_whole_copies(o, module, split))
            return {"model": {k: v.detach() for k, v in model.items() if _kept(k, v, split)}, "optimizer": named}
        if self._unowned is None:  # once: the names no stage holds
            mine = [k for k, v in model.items() if id(v) in owned]
            held = set().union(*self.all_gather_object(mine))
            self._unowned = {k for k in model if k not in held}
        keep = {
            k: v.detach() for k, v in model.items() if id(v) in owned or (self.is_global_zero and k in self._unowned)
        }
        return {"model": keep, "optimizer": each_optimizer(optimizer, lambda o: _named_owned(o, module, owned))}

    def _split_anywhere(self, model: dict[str, Any]) -> set[str]:
        """The names some rank holds split or sharded (a DTensor) while the stages are not built yet: a stage's
        layers are split (and its blocks sharded) at wrap time, the other stages' are whole there (ranks of another
        stage hold them whole too)."""
        from torch.distributed.tensor import DTensor

        mine = [k for k, v in model.items() if isinstance(v, DTensor)]
        return set().union(*self.all_gather_object(mine))

    def load_training_state(
        self, module: Any, optimizer: Any, state: dict[str, Any], storage_options: dict[str, Any]
    ) -> None:
        """Pipeline: the whole state on every rank (the other stages' weights at their shapes for it), then this
        rank keeps its stage's."""
        if self._pipeline is None:
            return super().load_training_state(module, optimizer, state, storage_options)
        pipeline = self._pipeline.pipeline
        pipeline.materialize()
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in sharded_state.state_module(module).parameters()):
            _load_split(module, optimizer, state, storage_options)
        else:
            super().load_training_state(module, optimizer, state, storage_options)
        if pipeline.built:  # before the first build the whole network stays: that build runs it whole, checking
            pipeline.release()
        self._trim_pending = optimizer is not None  # at the first step, when the stages are built

    def full_model_state(self, module: Any) -> dict[str, Any]:
        """Pipeline: the whole model as one process holds it, on rank 0 (the export): each stage's tensors from its
        first replica, a split one gathered from its group first (the other ranks return their own)."""
        if self._pipeline is None:
            return super().full_model_state(module)
        from torch.distributed.tensor import DTensor

        owned = self._pipeline.pipeline.owned_ids
        model = sharded_state.state_module(module).state_dict(keep_vars=True)
        # full_tensor(): a collective of the stage's ranks over its meshes (every rank of the stage, on this line)
        whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
        part: dict[str, Any] | None = {k: whole(v).detach().cpu() for k, v in model.items() if id(v) in owned}
        if self.data_parallel_rank or self.rank % self.tensor_parallel:  # the stage's first rank sends it
            part = None
        parts = [p for p in self.all_gather_object(part) if p is not None]
        state = {k: v.detach() for k, v in model.items()}
        if self.is_global_zero:
            for each in parts:
                state.update(each)
        return state


def _sharded_over_replicas(parameter: Any) -> bool:
    """A parameter FSDP2 shards over the stage's replicas (a stage's block): its gradient is reduced already."""
    from torch.distributed.tensor import DTensor

    return isinstance(parameter, DTensor) and "data_parallel" in (parameter.device_mesh.mesh_dim_names or ())


def _named_owned(optimizer: Any, module: Any, owned: set[int]) -> dict[str, Any]:
    """The optimizer's state by parameter name (DCP's form), of this rank's stage's parameters only."""
    names = {id(p): name for name, p in sharded_state.state_module(module).named_parameters()}
    named = sharded_state.by_name(optimizer.state_dict(), optimizer, module)
    mine = {names[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in owned}
    return {**named, "state": {name: s for name, s in named["state"].items() if name in mine}}


def _kept(name: str, value: Any, split: set[str]) -> bool:
    """Whether a rank writes `value` under `name` before the stages are built: a name some rank holds split is
    written by those ranks (their shards; a whole copy beside them is one DCP refuses)."""
    from torch.distributed.tensor import DTensor

    return name not in split or isinstance(value, DTensor)


def _without_whole_copies(optimizer: Any, module: Any, split: set[str]) -> dict[str, Any]:
    """The optimizer's state by name (DCP's form), less the whole copies of what other ranks hold split."""
    named = sharded_state.by_name(optimizer.state_dict(), optimizer, module)
    if not split:
        return named
    from torch.distributed.tensor import DTensor

    state = named["state"]
    kept = {n: v for n, v in state.items() if n not in split or any(isinstance(t, DTensor) for t in v.values())}
    return {**named, "state": kept}


def _keep_owned(optimizer: Any, owned: set[int]) -> None:
    for parameter in [p for p in optimizer.state if id(p) not in owned]:
        del optimizer.state[parameter]


def _load_split(module: Any, optimizer: Any, state: dict[str, Any], storage_options: dict[str, Any]) -> None:
    """A whole checkpoint (any strategy's) into a module whose stage layers are split over tensor-parallel ranks:
    each rank keeps its shard of a split tensor (cut from the whole one here, no communication), and the optimizer's
    state of a split parameter is cut alike."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    if sharded_state.SHARDS in state:
        whole = sharded_state.read_whole(state[sharded_state.SHARDS], storage_options)
        optimizer_state = each_optimizer(
            optimizer, lambda o, s: sharded_state.by_index(s, o, module), whole["optimizer"]
        )
    else:
        whole, optimizer_state = state, state.get("optimizer")

    def cut(value: Any, like: Any) -> Any:
        if not isinstance(like, DTensor) or isinstance(value, DTensor) or value.shape != like.shape:
            return value
        return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)

    owner = sharded_state.state_module(module)
    targets = owner.state_dict(keep_vars=True)
    unknown = sorted(set(whole["model"]) - set(targets))
    if unknown:
        raise ConfigError(f"--ckpt-path: the checkpoint holds {', '.join(unknown[:3])}, which the module has not")
    with torch.no_grad():
        for key, value in whole["model"].items():
            target = targets[key]
            if isinstance(target, DTensor):
                target.to_local().copy_(cut(value, target).to_local())
            else:
                target.copy_(value)
    if optimizer is None or optimizer_state is None:
        return

    def load(each: Any, saved: Any) -> None:
        each.load_state_dict(saved)
        for parameter, values in each.state.items():
            for name, value in list(values.items()):
                if isinstance(value, torch.Tensor):
                    values[name] = cut(value, parameter)

    each_optimizer(optimizer, load, optimizer_state)
