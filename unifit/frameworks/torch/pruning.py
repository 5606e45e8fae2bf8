"""Checkpoints of a pruned model (torch.nn.utils.prune, Lightning's ModelPruning): a pruned weight `w` is kept as
`w_orig` and the buffer `w_mask`, while a freshly built model has `w`. Before loading such a state, the model is
made to match it: pruned the same way to resume (the masks keep holding the pruned weights at zero, as in the run
that saved it), or the state folded into `w = w_orig * w_mask` to evaluate (the weights Lightning's checkpoint of
the same run holds)."""

from __future__ import annotations

from typing import Any

import torch


def pruned_names(state: dict[str, Any]) -> list[str]:
    """The pruned weights of a state dict, by the name they have unpruned."""
    return [key[: -len("_mask")] for key in state if key.endswith("_mask") and f"{key[:-5]}_orig" in state]


def prune_like(module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Re-parametrize `module`'s weights that `state` holds pruned and the module does not yet, with the state's
    masks, so that loading `state` restores the pruning (to resume training)."""
    from torch.nn.utils import prune

    for name in pruned_names(state):
        owner, _, attribute = name.rpartition(".")
        submodule = module.get_submodule(owner)
        if attribute in dict(submodule.named_parameters(recurse=False)):  # not pruned here yet
            prune.custom_from_mask(submodule, attribute, mask=state[f"{name}_mask"])


def folded(module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` with each pruned weight folded into `w = w_orig * w_mask` where `module` has it unpruned (to
    evaluate); unchanged where the module is pruned too, or nothing was."""
    names = [name for name in pruned_names(state) if name in dict(module.named_parameters())]
    if not names:
        return state
    state = dict(state)
    for name in names:
        orig, mask = state.pop(f"{name}_orig"), state.pop(f"{name}_mask")
        state[name] = orig * mask.to(orig.dtype)
    return state
