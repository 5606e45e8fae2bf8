"""trainer.compile: blocks: each of the model's blocks (blocks.py) compiled by torch.compile on its own (regional
compilation), instead of the whole step. Identical blocks share one compiled graph (torch compiles a block class's
forward once and reuses it for every block of that class), so a 48-block transformer compiles in the time of one
block; the code around the blocks, the loss and the strategy's wrappers run eagerly, which is what composes with
FSDP2 (its hooks stay outside the compiled forward) and with activation checkpointing (a checkpointed block's
forward, the recompute included, is what is compiled). torchtitan's and Lightning's way for large models.

The number of graphs torch compiled is logged after the first epoch, and again whenever it grows: a block that
recompiles (another shape, a guard that failed) shows there.
"""

from __future__ import annotations

from typing import Any

from unifit.errors import ConfigError
from unifit.strategies.blocks import model_blocks


def compile_blocks(model: Any, classes: list[str] | None) -> str:
    """Compile the forward of each of `model`'s blocks in place (its module hooks stay eager); a line saying so."""
    import torch

    blocks = model_blocks(model, classes, "trainer.compile: blocks")
    for _, block in blocks:
        try:
            block.forward = torch.compile(block.forward)
        except RuntimeError as exc:  # a Python or platform torch.compile does not support
            raise ConfigError(
                f"trainer.compile: blocks: torch.compile is not available here ({exc}); set compile: false"
            ) from None
    names = ", ".join(name for name, _ in blocks[:4]) + (", ..." if len(blocks) > 4 else "")
    return f"compile: blocks: {len(blocks)} block(s) compiled one by one ({names})"


class CompileReport:
    """The graphs torch compiled since the fit started, as a line when their number changed (rank 0 logs it)."""

    def __init__(self) -> None:
        from unifit.strategies.torch_compat import compiled_graphs

        self.before, self.seen = compiled_graphs(), 0

    def line(self) -> str | None:
        from unifit.strategies.torch_compat import compiled_graphs

        graphs = compiled_graphs() - self.before
        if graphs == self.seen:
            return None
        first, self.seen = self.seen == 0, graphs
        what = f"compile: blocks: {graphs} graph(s) compiled in this fit"
        return what if first else f"{what}: recompiled (a new input shape, or a guard that failed)"
