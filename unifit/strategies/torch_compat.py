"""torch's private API, in one place: each use named for what it does, gated by version where torch changed it.

unifit calls a private name of torch only where torch has no public one for what it needs (checked with torch 2.11
and 2.13; pyproject allows >= 2.4). A torch release that moves one breaks a function here, and
tests/test_torch_compat.py, which checks every name below on the installed torch, rather than a strategy.
Import it where it is used (inside functions), as the strategies import torch: a Keras run never loads torch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only, tree_unflatten

__all__ = [
    "TORCH",
    "RECEIVED_ACTIVATIONS_NEED_GRAD",
    "tree_flatten",
    "tree_map",
    "tree_map_only",
    "tree_unflatten",
    "flatten_dense",
    "unflatten_dense",
    "is_view",
    "version_counter",
    "refresh_rnn_weights",
    "set_last_lr",
    "fsspec_writer",
    "fsspec_reader",
    "load_whole",
    "fsdp_param_groups",
    "fsdp_group_trainable",
    "refresh_fsdp_mixed_precision",
    "kept_gathered",
    "set_schedule_backward",
    "wrap_stage_initialisation",
    "free_inference_metadata",
    "replace_inference_cleanup",
    "checkpoint_wrapped",
    "is_checkpoint_wrapped",
    "unwrapped_name",
    "inner_module",
    "compiled_graphs",
]

TORCH = torch.__version__  # a TorchVersion: compares as a version, TORCH < "2.13" (not as a string)

# torch before 2.13 asks every received activation to require gradients in a stage's shape inference (seen in 2.11)
RECEIVED_ACTIVATIONS_NEED_GRAD = TORCH < "2.13"


# ---- tensors and modules ----------------------------------------------------------------------------------------
def flatten_dense(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat buffer of same-dtype tensors: one collective for all (DDP's buckets use the same helper)."""
    return torch._utils._flatten_dense_tensors(tensors)


def unflatten_dense(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch._utils._unflatten_dense_tensors(flat, like))


def is_view(tensor: torch.Tensor) -> bool:
    return tensor._base is not None


def version_counter(tensor: torch.Tensor) -> int:
    """Bumped by every in-place change: how a view modified before backward is told."""
    return tensor._version


def refresh_rnn_weights(rnn: torch.nn.RNNBase) -> None:
    """nn.LSTM/GRU/RNN call their kernel with a list of their weights cached when built: refilled from the
    parameters the module holds now (FSDP2 swaps them in and out)."""
    rnn._flat_weights = [getattr(rnn, name, None) for name in rnn._flat_weights_names]


def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    """What `scheduler.get_last_lr()` answers, after unifit changed the optimizer's learning rates itself."""
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = list(lrs)


# ---- distributed checkpoint on fsspec (local paths and s3://) -----------------------------------------------------
def fsspec_writer(url: str, **storage_options: Any) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, overwrite=True, **storage_options)


def fsspec_reader(url: str, **storage_options: Any) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **storage_options)


def load_whole(url: str, **storage_options: Any) -> dict[str, Any]:
    """The full, unsharded state saved under `url`, read in this process only (no collective): what torch's
    `dcp_to_torch_save` does, without writing a file."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    whole: dict[str, Any] = {}
    reader = fsspec_reader(url, **storage_options)
    _load_state_dict(whole, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return whole


# ---- FSDP2 ------------------------------------------------------------------------------------------------------
def fsdp_param_groups(module: Any) -> list[Any]:
    """The parameter groups of one FSDP module (`fully_shard` made it): what it gathers and reshards together.
    torch 2.13 keeps a list (`_fsdp_param_groups`); earlier releases one group or None (`_fsdp_param_group`)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        return [] if group is None else [group]
    return list(groups)


def fsdp_group_trainable(group: Any) -> bool:
    return any(p.sharded_param.requires_grad for p in group.fsdp_params)


def refresh_fsdp_mixed_precision(group: Any) -> None:
    """A group whose parameters were all frozen when FSDP2 set its dtypes (it skips them) and are trainable now:
    its gather and reduce dtypes set again, as FSDP2's lazy init does."""
    group._init_mp_dtypes()


@contextlib.contextmanager
def kept_gathered(groups: list[Any]) -> Iterator[None]:
    """The groups stay gathered after their forwards (FSDP2's set_reshard_after_forward(False)), then resharding
    after forward is back as it was on each group."""
    after_forward = [(group, group.post_forward_mesh_info) for group in groups]
    try:
        for group in groups:
            group.post_forward_mesh_info = None
        yield
    finally:
        for group, info in after_forward:
            group.post_forward_mesh_info = info


# ---- pipelining ---------------------------------------------------------------------------------------------------
def set_schedule_backward(schedule: Any, backward: bool) -> None:
    """A schedule built with a loss that runs forwards only (validation): torch has it as an internal flag."""
    schedule._has_backward = backward


def wrap_stage_initialisation(schedule: Any, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """`wrapper(initialise)` runs in place of the schedule's stage initialisation (shape inference, the first step;
    torch 2.11 and 2.13 run it there for the single-stage schedules)."""
    schedule._initialize_stage = wrapper(schedule._initialize_stage)


def free_inference_metadata(stage: Any) -> None:
    """torch's `_post_metadata_inference_cleanup` less its FSDP part (`.grad = None`, reshard): the tensors a stage's
    shape inference kept, dropped."""
    stage._fwd_outputs_for_bwd_meta = None
    stage._fwd_inputs_for_bwd_meta = None
    stage._fwd_kwargs_tensors_for_bwd_meta = None


def replace_inference_cleanup(stage: Any, cleanup: Callable[[], None]) -> None:
    stage._post_metadata_inference_cleanup = cleanup


def checkpoint_wrapped(module: torch.nn.Module, context_fn: Callable[[], Any] | None) -> torch.nn.Module:
    """`module` whose forward runs under torch.utils.checkpoint (non-reentrant), with `context_fn` (a selective
    policy). torch's wrapper, as torchtitan and Lightning use it: its state_dict hooks keep the module's own keys
    (no `_checkpoint_wrapped_module.` in a checkpoint), and FSDP2's and DCP's state dicts read through it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs: dict[str, Any] = {"preserve_rng_state": True}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    return checkpoint_wrapper(module, **kwargs)


def is_checkpoint_wrapped(module: torch.nn.Module) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(module, CheckpointWrapper)


def unwrapped_name(name: str) -> str:
    """A parameter's or module's name as without checkpoint wrappers (their `_checkpoint_wrapped_module.`)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return name.replace(_CHECKPOINT_PREFIX, "")


def inner_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module a checkpoint wrapper holds (the module itself when not wrapped)."""
    return getattr(module, "_checkpoint_wrapped_module", module) if is_checkpoint_wrapped(module) else module


def compiled_graphs() -> int:
    """The graphs torch.compile has made in this process so far (dynamo's own count; recompiles add to it)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
