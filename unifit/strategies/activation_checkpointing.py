"""trainer.activation_checkpointing: a block keeps its input and recomputes its activations in backward, instead of
keeping them from forward (torchtitan's full and selective activation checkpointing, as functions on the model).

- full: everything inside the block is recomputed;
- selective: the outputs of the costly ops (matrix products, attention; a tensor-parallel reduce-scatter) are kept
  and only the cheap ones (norms, activations, dropout masks, casts) recomputed: most of the memory saving at a
  fraction of the extra compute (torchtitan's per-op policy);
- every_n_blocks: only every n-th block (torchtitan's layer-selective mode).

The blocks are the classes named in `blocks`, or else the model's repeated blocks: the items of its ModuleLists and
Sequentials that hold parameters (the outermost such lists: a transformer's layers, not the Linears inside them).
Each is wrapped by torch's checkpoint wrapper (torch_compat), which keeps the module's own state_dict keys, so a
checkpoint resumes with or without activation checkpointing. It runs after tensor parallel has split the blocks and
before data parallel wraps or shards them, torchtitan's order; dropout draws the same in the recompute (the RNG
state is kept), so the gradients equal those without it.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Iterator

from unifit.errors import ConfigError

if TYPE_CHECKING:
    from unifit.config.schema import ActivationCheckpointingConfig

log = logging.getLogger("unifit")
_CONTAINERS = ("ModuleList", "Sequential")


def log_checkpointed(config: ActivationCheckpointingConfig, wrapped: list[str]) -> None:
    """One line (rank 0's caller): which blocks are checkpointed, how."""
    if wrapped:
        shown = ", ".join(wrapped[:4]) + (f", ... ({len(wrapped)} in all)" if len(wrapped) > 4 else "")
        log.info("activation checkpointing: %s, on %s", config.mode, shown)


def checkpoint_blocks(model: Any, config: ActivationCheckpointingConfig) -> list[str]:
    """Wrap `model`'s blocks as `config` says (once: blocks already wrapped are left); the names wrapped."""
    if config.mode == "none":
        return []
    from unifit.strategies.torch_compat import checkpoint_wrapped, is_checkpoint_wrapped

    if any(is_checkpoint_wrapped(m) for m in model.modules()):
        return []
    blocks = _named_blocks(model, config.blocks) if config.blocks else list(_repeated_blocks(model))
    if not blocks:
        classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ConfigError(
            f"trainer.activation_checkpointing: {type(model).__name__} has no ModuleList or Sequential of layers "
            f"to take as its blocks; name the block class: activation_checkpointing: {{mode: {config.mode}, "
            f"blocks: [...]}} (its submodule classes: {', '.join(classes[:12])})"
        )
    _without_kv_cache(model)
    context = _selective_context if config.mode == "selective" else None
    chosen = blocks[config.every_n_blocks - 1 :: config.every_n_blocks]
    for name, _ in chosen:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent.register_module(attribute, checkpoint_wrapped(getattr(parent, attribute), context))
    return [name for name, _ in chosen]


def _without_kv_cache(model: Any) -> None:
    """A Hugging Face model fills a key/value cache in its training forward (config.use_cache), which a block's
    recompute would fill again: its cache is turned off for the forward's calls, as transformers' own gradient
    checkpointing does (generate() asks for the cache itself)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            log.info("activation checkpointing: %s.config.use_cache set to False", type(module).__name__)


def _named_blocks(model: Any, classes: list[str]) -> list[tuple[str, Any]]:
    """The outermost submodules of the named classes, in order."""
    found = [(name, m) for name, m in model.named_modules() if type(m).__name__ in classes and m is not model]
    missing = sorted(set(classes) - {type(m).__name__ for _, m in found})
    if missing:
        known = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ConfigError(
            f"trainer.activation_checkpointing.blocks: {', '.join(missing)} names no submodule of "
            f"{type(model).__name__}; its submodule classes are: {', '.join(known)}"
        )
    return [(name, m) for name, m in found if not any(name.startswith(f"{other}.") for other, _ in found)]


def _repeated_blocks(module: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The items with parameters of the outermost ModuleLists and Sequentials, by name."""
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if type(child).__name__ in _CONTAINERS and any(True for _ in child.parameters()):
            for item, block in child.named_children():
                if any(True for _ in block.parameters()):
                    yield f"{full}.{item}", block
        else:
            yield from _repeated_blocks(child, f"{full}.")


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
