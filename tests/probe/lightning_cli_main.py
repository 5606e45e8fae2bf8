"""A LightningCLI entry point as Lightning's docs write one (subclass mode: the model, data and callbacks come from
the config file), and a Lightning callback that saves the final weights, so that a fit by Lightning and by unifit
of the same file can be compared.

    python tests/probe/lightning_cli_main.py fit --model tests.probe.lightning_probe.Regressor --print_config
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.probe


class SaveWeights(L.Callback):
    """At the end of fit, rank 0 saves the module's weights to `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            torch.save({k: v.detach().cpu() for k, v in pl_module.state_dict().items()}, self.path)


if __name__ == "__main__":
    LightningCLI(save_config_kwargs={"overwrite": True})
