"""A model's blocks: what activation checkpointing and compiling per block apply to, the same everywhere.

The blocks are the submodules of the classes a user names, or else the model's repeated blocks: the items of its
outermost ModuleLists and Sequentials that hold parameters (a transformer's layers, not the Linears inside them).
"""

from __future__ import annotations

from typing import Any, Iterator

from unifit.errors import ConfigError

_CONTAINERS = ("ModuleList", "Sequential")


def model_blocks(model: Any, classes: list[str] | None, field: str) -> list[tuple[str, Any]]:
    """(name, block) of `model`'s blocks, in order; `field` names the option in a refusal."""
    from unifit.strategies.torch_compat import inner_module

    if classes:
        return _named_blocks(model, classes, field)
    blocks = list(_repeated_blocks(model))
    if not blocks:
        known = sorted({type(inner_module(m)).__name__ for m in model.modules() if m is not model})
        raise ConfigError(
            f"{field}: {type(model).__name__} has no ModuleList or Sequential of layers to take as its blocks; "
            f"name the block class (trainer.activation_checkpointing.blocks) (its submodule classes: "
            f"{', '.join(known[:12])})"
        )
    return blocks


def _named_blocks(model: Any, classes: list[str], field: str) -> list[tuple[str, Any]]:
    """The outermost submodules of the named classes, in order (a checkpointed one: its wrapper)."""
    from unifit.strategies.torch_compat import inner_module, is_checkpoint_wrapped

    inside = {id(inner_module(m)) for m in model.modules() if is_checkpoint_wrapped(m)}
    found = [
        (name, m)
        for name, m in model.named_modules()
        if type(inner_module(m)).__name__ in classes and m is not model and id(m) not in inside
    ]
    missing = sorted(set(classes) - {type(inner_module(m)).__name__ for _, m in found})
    if missing:
        known = sorted({type(inner_module(m)).__name__ for m in model.modules() if m is not model})
        raise ConfigError(
            f"{field}: {', '.join(missing)} names no submodule of {type(model).__name__}; its submodule classes "
            f"are: {', '.join(known)}"
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
