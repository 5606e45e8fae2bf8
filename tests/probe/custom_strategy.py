"""A user's own strategy, named by class path from YAML: it counts what the Strategy seam is asked
to do (optimizer steps, backward passes, clips, checkpoint writes) and writes it at teardown."""

from __future__ import annotations

import json
import os
from typing import Any

from unifit.strategies.ddp import DDPStrategy
from unifit.strategies.launchers.torchrun import TorchrunLauncher  # noqa: F401  (named below by path)


class CountingDDP(DDPStrategy):
    """DDP that counts the calls unifit makes into its training seam."""

    name = "counting-ddp"
    launcher = "unifit.strategies.launchers.torchrun:TorchrunLauncher"

    def setup(self) -> None:
        super().setup()
        self.counts = {"backward": 0, "optimizer_step": 0, "clip": 0, "save": 0, "load": 0, "accumulating": 0}

    def backward(self, loss: Any) -> None:
        self.counts["backward"] += 1
        super().backward(loss)

    def accumulating(self, wrapped: Any) -> Any:
        self.counts["accumulating"] += 1
        return super().accumulating(wrapped)

    def optimizer_step(self, optimizer: Any, module: Any, clip_val: float | None) -> None:
        self.counts["optimizer_step"] += 1
        super().optimizer_step(optimizer, module, clip_val)

    def clip_gradients(self, parameters: Any, max_norm: float) -> None:
        self.counts["clip"] += 1
        super().clip_gradients(parameters, max_norm)

    def save_checkpoint(self, snapshot: Any, commit: Any) -> None:
        self.counts["save"] += 1
        super().save_checkpoint(snapshot, commit)

    def load_checkpoint(self, find: Any, read_at: Any) -> Any:
        self.counts["load"] += 1
        return super().load_checkpoint(find, read_at)

    def teardown(self) -> None:
        out = os.environ.get("COUNTING_STRATEGY_OUT")
        if out and hasattr(self, "counts"):
            with open(f"{out}/rank{self.rank}.json", "w") as f:
                json.dump(self.counts, f)
        super().teardown()


class NotAStrategy:
    pass
