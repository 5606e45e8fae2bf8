"""unifit: one Trainer for PyTorch and Keras modules, any distribution strategy.

    from unifit import Trainer, TrainModule
    Trainer(strategy="ddp", max_epochs=10, batch_size=32).fit(MyModule())

Names are imported lazily, so `import unifit` needs neither torch nor TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Trainer": "unifit.trainer.trainer",
    "TrainModule": "unifit.frameworks.torch.module",
    "KerasModule": "unifit.frameworks.keras.module",
    "Callback": "unifit.loop.callback",
    "TrainerConfig": "unifit.config.schema",
    "ExperimentConfig": "unifit.config.schema",
    "TrainState": "unifit.loop.state",
    "UnifitError": "unifit.errors",
    "ConfigError": "unifit.errors",
    "rank_zero_only": "unifit.strategies.environment",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        if name == "TrainModule":
            from unifit._imports import require

            require("torch", purpose="unifit.TrainModule")
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'unifit' has no attribute '{name}'")
