"""trainer.activation_checkpointing: a block keeps its input and recomputes its activations in backward, instead of
keeping them from forward (torchtitan's full and selective activation checkpointing, as functions on the model).

- full: everything inside the block is recomputed;
- selective: the outputs of the costly ops (matrix products, attention; a tensor-parallel reduce-scatter) are kept
  and only the cheap ones (norms, activations, dropout masks, casts) recomputed: most of the memory saving at a
  fraction of the extra compute (torchtitan's per-op policy);
- every_n_blocks: only every n-th block (torchtitan's layer-selective mode).

The blocks are blocks.py's: the classes named in `blocks`, or else the model's repeated blocks. Each is wrapped by
torch's checkpoint wrapper (torch_compat), which keeps the module's own state_dict keys, so a checkpoint resumes with or without activation checkpointing. It runs after tensor parallel has split the blocks and
before data parallel wraps or shards them, torchtitan's order (block_functions.py); dropout draws the same in the
recompute (the RNG state is kept), so the gradients equal those without it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from unifit.strategies.blocks import model_blocks

if TYPE_CHECKING:
    from unifit.config.schema import ActivationCheckpointingConfig


def checkpoint_blocks(model: Any, config: ActivationCheckpointingConfig) -> str | None:
    """Wrap `model`'s blocks as `config` says; a line saying which (None: nothing to do, or done already)."""
    if config.mode == "none":
        return None
    from unifit.strategies.torch_compat import checkpoint_wrapped, is_checkpoint_wrapped

    if any(is_checkpoint_wrapped(m) for m in model.modules()):
        return None
    field = "trainer.activation_checkpointing" + (".blocks" if config.blocks else "")
    blocks = model_blocks(model, config.blocks, field)
    context = _selective_context if config.mode == "selective" else None
    chosen = blocks[config.every_n_blocks - 1 :: config.every_n_blocks]
    for name, _ in chosen:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent.register_module(attribute, checkpoint_wrapped(getattr(parent, attribute), context))
    shown = ", ".join(name for name, _ in chosen[:4]) + (f", ... ({len(chosen)} in all)" if len(chosen) > 4 else "")
    return f"activation checkpointing: {config.mode}, on {shown}"


@functools.cache
def _kept_ops() -> frozenset[Any]:
    """The ops whose outputs a selectively checkpointed block keeps (torchtitan's list)."""
    import torch

    aten = torch.ops.aten
    names = [
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ]
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return frozenset(ops)


def _selective_context() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = _kept_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
