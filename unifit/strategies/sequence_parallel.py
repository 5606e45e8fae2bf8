"""Sequence parallelism inside a tensor-parallel group (Megatron's; torchtitan's plans): between a rowwise layer and
the next colwise one, the activations are cut along the sequence (dimension 1) over the group instead of held whole
by every rank, so the norms and the residual adds run on 1/T of the tokens and hold 1/T of those activations.

The plan's styles (model_parallel.py): `sequence` for a module whose work is per token (a norm, dropout, or a
whole block, so its residual adds see sequence shards); `rowwise_sequence` for a rowwise layer whose summed
output goes out in sequence shards (a reduce-scatter instead of an all-reduce). A colwise layer gathers a
sequence-sharded input whole first. Between those layers the activations stay DTensors, so every op keeps the
whole model's meaning (a shape read in the forward is the whole sequence's), and an op mixing them with a plain
tensor fails in torch rather than computing something else: a plain input to a `sequence` module is taken as the
whole tensor (torch's SequenceParallel would take it as this rank's shard)."""

from __future__ import annotations

from typing import Any

from unifit.errors import ConfigError

SEQUENCE_DIM = 1


def on_sequence_shards(module: Any, mesh: Any) -> None:
    """`module` runs on sequence shards: its first input cut along the sequence (a plain one taken whole), its own
    parameters replicated over the group (DTensors: their gradients, from every rank's tokens, summed by torch)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    for name, parameter in list(module.named_parameters(recurse=False)):
        if not isinstance(parameter, DTensor):
            replicated = distribute_tensor(parameter.data, mesh, [Replicate()], src_data_rank=None)
            module.register_parameter(name, torch.nn.Parameter(replicated, parameter.requires_grad))

    def cut(_: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        first, *rest = inputs
        if not isinstance(first, torch.Tensor):
            return inputs
        if not isinstance(first, DTensor):
            first = DTensor.from_local(first, mesh, [Replicate()], run_check=False)
        if first.placements != (Shard(SEQUENCE_DIM),):
            first = first.redistribute(mesh, [Shard(SEQUENCE_DIM)])
        return (first, *rest)

    module.register_forward_pre_hook(cut)


def gathers_sequence(module: Any) -> None:
    """A colwise layer reading sequence shards (a DTensor input) gathers them whole first (an all-gather; in
    backward the layer's own input handling all-reduces the gradient, then each rank keeps its part of the
    sequence); a plain input passes as before. Runs before the layer's own input handling."""
    from torch.distributed.tensor import DTensor, Replicate

    def whole(_: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        first, *rest = inputs
        if isinstance(first, DTensor):
            first = first.redistribute(first.device_mesh, [Replicate()] * first.device_mesh.ndim).to_local()
        return (first, *rest)

    module.register_forward_pre_hook(whole, prepend=True)


def refuses_mixed(module: Any, name: str) -> None:
    """An op in `module`'s forward (which holds or is a sequence-parallel entry) meeting a plain tensor beside
    sequence shards, which torch refuses deep inside, is refused in one line naming the module and the fix."""
    import functools

    forward = module.forward

    @functools.wraps(forward)
    def refusing_mixed(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except RuntimeError as exc:
            if "mixed torch.Tensor and DTensor" not in str(exc):
                raise
            op = str(exc).split(" got mixed")[0].split()[-1]
            raise ConfigError(
                f"trainer.strategy_options.plan: {op} in {name}'s forward met activations cut along the sequence "
                "beside a tensor that is not (a module or weight the plan leaves out); plan sequence for each module "
                "from a rowwise_sequence layer to the next colwise one: the norms, and the block holding the residual "
                "add; or use rowwise instead of rowwise_sequence and drop the sequence entries"
            ) from None

    module.forward = refusing_mixed
