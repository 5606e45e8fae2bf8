"""What users hand Trainer.fit, as a module unifit can train.

A unifit TrainModule / KerasModule is used as it is; an unchanged `lightning.LightningModule`
(with a `LightningDataModule` as its data, if given) is wrapped by frameworks/torch/lightning.py,
and callbacks/lightning_hooks.py calls its own hooks.
Anything else is refused in one line that says what to pass instead.
"""

from __future__ import annotations

from typing import Any

from unifit.callbacks.lightning_hooks import LightningHooks
from unifit.errors import ConfigError
from unifit.frameworks.module import ModuleBase

_ACCEPTED = ("a unifit.TrainModule (PyTorch) or unifit.KerasModule (Keras) subclass, or a lightning "
             "LightningModule")


def trainable(module: Any, data: Any = None) -> tuple[ModuleBase, Any]:
    """(module, data) as the engines take them."""
    if isinstance(module, ModuleBase):
        return module, data
    from unifit.frameworks.torch import lightning  # only torch is needed to ask (names, not imports)

    if lightning.is_lightning_module(module):
        datamodule = data if data is not None and lightning.is_lightning_datamodule(data) else None
        adapter = lightning.LightningAdapter(module, datamodule=datamodule)
        adapter.hooks = [LightningHooks(adapter)]
        return adapter, (None if datamodule is not None else data)
    if isinstance(module, type):
        raise ConfigError(f"module: received the class {module.__name__}, not an instance; pass {module.__name__}(...)")
    raise ConfigError(f"module: received a {type(module).__module__}.{type(module).__qualname__}; pass {_ACCEPTED}")
