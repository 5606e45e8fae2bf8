"""The strategy's training hooks under pipeline stages (model-parallel with `pipeline_parallel` above 1; the stages
themselves are pipeline.py's): the schedule runs backward, tied weights' gradients are summed over the stages and a
stage's averaged over its replicas, clipping takes the norm over every stage, and checkpoints are gathered whole on
rank 0. Without a pipeline each hook is the data-parallel base's (the next class in the strategy's MRO)."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any, Iterable

from unifit.errors import ConfigError
from unifit.strategies import sharded_state
from unifit.strategies.ddp import average
from unifit.strategies.fsdp import by_mesh, follow_shards, total_norm


class PipelineTraining:
    """Mixed into ModelParallelStrategy before FSDPStrategy; `_pipeline` is the PipelinedStep while stages run."""

    _pipeline: Any = None  # pipeline.PipelinedStep, with pipeline_parallel above 1
    # ModelParallelStrategy's
    pipeline_parallel: int
    tensor_parallel: int
    rank: int
    data_parallel_size: int
    data_parallel_rank: int
    device_mesh: Any
    precision: Any
    is_global_zero: bool
    all_gather_object: Any

    def setup_module_and_optimizer(
        self, step_module: Any, optimizer: Any, device: Any, precision: Any, accumulate: int
    ) -> tuple[Any, Any]:
        before = {id(p): name for name, p in step_module.named_parameters()}
        wrapped, optimizer = super().setup_module_and_optimizer(step_module, optimizer, device, precision, accumulate)
        if self._pipeline is not None:  # tensor parallelism replaced the split layers' parameters: the optimizer's too
            follow_shards(optimizer, before, step_module)
        return wrapped, optimizer

    def setup_manual(
        self, step_module: Any, optimizers: list[Any], device: Any, precision: Any
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
            self._pipeline.pipeline.sum_shared_gradients()
            if self.data_parallel_size > 1:  # a tensor-parallel gradient: its shard (the replicas' places match)
                from unifit.strategies.pipeline import local

                grads = [local(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
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
        if self._pipeline is None:
            return super().training_state(module, optimizer)
        return self._gathered(module, optimizer)

    def load_training_state(
        self, module: Any, optimizer: Any, state: dict[str, Any], storage_options: dict[str, Any]
    ) -> None:
        """Pipeline: the whole state on every rank (the other stages' weights at their shapes for it), then this
        rank keeps its stage's."""
        if self._pipeline is None:
            return super().load_training_state(module, optimizer, state, storage_options)
        pipeline = self._pipeline.pipeline
        pipeline.materialize()
        if self.tensor_parallel > 1:
            _load_split(module, optimizer, state, storage_options)
        else:
            super().load_training_state(module, optimizer, state, storage_options)
        pipeline.release()

    def start_sharded_write(
        self, state: dict[str, Any], url: str, storage_options: dict[str, Any]
    ) -> tuple[dict[str, Any], Future | None]:
        """Pipeline: rank 0 holds the whole state (training_state gathered it): it writes, as one process does."""
        if self._pipeline is None:
            return super().start_sharded_write(state, url, storage_options)
        return state, None

    def full_model_state(self, module: Any) -> dict[str, Any]:
        if self._pipeline is None:
            return super().full_model_state(module)
        return self._gathered(module, None)["model"]

    def _gathered(self, module: Any, optimizer: Any) -> dict[str, Any]:
        """The whole model (and optimizer) as one process holds them, on rank 0: each stage's tensors from its first
        replica; a checkpoint any strategy resumes from (the other ranks return their own)."""
        import torch
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_map_only

        owner = sharded_state.state_module(module)
        owned = self._pipeline.pipeline.owned_ids if self._pipeline is not None else set()
        model = owner.state_dict(keep_vars=True)
        optimizer_state = optimizer.state_dict() if optimizer is not None else None
        part: dict[str, Any] | None = None
        if self.data_parallel_rank == 0:  # a tensor-parallel tensor gathered whole (its group's ranks: this line)
            whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
            to_host = lambda tree: tree_map_only(torch.Tensor, lambda t: whole(t).detach().cpu(), tree)  # noqa: E731
            part = {"model": to_host({k: v for k, v in model.items() if id(v) in owned})}
            if optimizer_state is not None:
                order = [p for group in optimizer.param_groups for p in group["params"]]
                mine = {i for i, p in enumerate(order) if id(p) in owned}
                part["optimizer"] = to_host({i: s for i, s in optimizer_state["state"].items() if i in mine})
            if self.rank % self.tensor_parallel:  # the group's first rank sends it
                part = None
        parts = [p for p in self.all_gather_object(part) if p is not None]
        state: dict[str, Any] = {"model": {k: v.detach() for k, v in model.items()}}
        if optimizer_state is not None:
            state["optimizer"] = optimizer_state
        if not self.is_global_zero:
            return state
        for each in parts:
            state["model"].update(each["model"])
            if optimizer_state is not None:
                optimizer_state["state"] = {**optimizer_state["state"], **each["optimizer"]}
        return state


def _load_split(module: Any, optimizer: Any, state: dict[str, Any], storage_options: dict[str, Any]) -> None:
    """A whole checkpoint (any strategy's) into a module whose stage layers are split over tensor-parallel ranks:
    each rank keeps its shard of a split tensor (cut from the whole one here, no communication), and the optimizer's
    state of a split parameter is cut alike."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from unifit.strategies.torch_training import each_optimizer

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
