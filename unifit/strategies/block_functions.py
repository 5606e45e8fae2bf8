"""What applies to a model's blocks before it is wrapped or sharded, in torchtitan's order: tensor parallel splits
them first (model-parallel), then activation checkpointing, then compiling per block, then data parallel wraps or
shards them (the strategy's wrap_module)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unifit.strategies.activation_checkpointing import checkpoint_blocks
from unifit.strategies.block_compile import compile_blocks

if TYPE_CHECKING:
    from unifit.config.schema import TrainerConfig


def prepare_blocks(model: Any, config: TrainerConfig) -> list[str]:
    """trainer.activation_checkpointing, then trainer.compile: blocks, on `model`; the lines saying what was done."""
    if not applies_to_blocks(config):
        return []
    lines = without_kv_cache(model)
    checkpointed = checkpoint_blocks(model, config.activation_checkpointing)
    if checkpointed is not None:
        lines.append(checkpointed)
    if config.compile == "blocks":
        lines.append(compile_blocks(model, config.activation_checkpointing.blocks))
    return lines


def applies_to_blocks(config: TrainerConfig) -> bool:
    return config.activation_checkpointing.mode != "none" or config.compile == "blocks"


def without_kv_cache(model: Any) -> list[str]:
    """A Hugging Face model fills a key/value cache in its training forward (config.use_cache): a block's recompute
    would fill it twice, and each block's compiled forward would be specialised to its own layer of it. The cache
    is turned off for training, as transformers' own gradient checkpointing does (generate() asks for it itself)."""
    lines = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            lines.append(f"{type(module).__name__}.config.use_cache set to False for training (no key/value cache)")
    return lines
