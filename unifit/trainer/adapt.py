"""What users hand Trainer.fit, as a module unifit can train.

A unifit TrainModule / KerasModule is used as it is; an unchanged `lightning.LightningModule`
(with a `LightningDataModule` as its data, if given) is wrapped by frameworks/torch/lightning.py,
and callbacks/lightning_hooks.py calls its own hooks. A compiled Keras 3 `keras.Model` is wrapped by
frameworks/keras/compiled.py (loss, metrics and optimizer from model.compile); the callback below
copies the trained weights back into the user's model object after fit.
Anything else is refused in one line that says what to pass instead.
"""

from __future__ import annotations

from typing import Any

from unifit.callbacks.lightning_hooks import LightningHooks
from unifit.errors import ConfigError
from unifit.frameworks.module import ModuleBase
from unifit.loop.callback import Callback

_ACCEPTED = (
    "a unifit.TrainModule (PyTorch) or unifit.KerasModule (Keras) subclass, a lightning "
    "LightningModule, or a compiled keras.Model"
)


def set_up(config: Any, module: Any, data: Any = None) -> tuple[ModuleBase, Any, Any]:
    """(module, strategy, engine) for what the user passed: the module made trainable, checked against
    the strategy's frameworks, the strategy created (not yet set up) with its training part for the
    module's framework, and the module's engine on both."""
    from unifit._imports import load_object
    from unifit.strategies import environment, registry

    given, (module, data) = module, trainable(module, data)
    registry.check_framework(config.strategy, module.framework, type(given).__name__)
    strategy = registry.create(
        config.strategy,
        environment.detect(),
        framework=module.framework,
        accelerator=config.accelerator,
        collective_timeout_s=config.collective_timeout_s,
        options=config.strategy_options,
    )
    training = registry.training(config.strategy, module.framework, strategy)  # the (strategy, framework) table
    data = data if data is not None else module
    engine = load_object(module.engine, field="module")(module, data, strategy, training, config)
    return module, strategy, engine


def trainable(module: Any, data: Any = None) -> tuple[ModuleBase, Any]:
    """(module, data) as the engines take them."""
    if isinstance(module, ModuleBase):
        return module, data
    if is_keras_model(module):
        from unifit.frameworks.keras.compiled import CompiledModel  # TensorFlow is imported only now

        provider = data is not None and callable(getattr(data, "train_dataset", None))
        adapter = CompiledModel(module, data=None if provider else data)
        adapter.attach_callbacks([KerasWeightsBack(adapter)])
        return adapter, (data if provider else None)
    from unifit.frameworks.torch import lightning  # only torch is needed to ask (names, not imports)

    if lightning.is_lightning_module(module):
        datamodule = data if data is not None and lightning.is_lightning_datamodule(data) else None
        adapter = lightning.LightningAdapter(module, datamodule=datamodule)
        adapter.attach_callbacks([LightningHooks(adapter)])
        return adapter, (None if datamodule is not None else data)
    if isinstance(module, type):
        raise ConfigError(f"module: received the class {module.__name__}, not an instance; pass {module.__name__}(...)")
    raise ConfigError(f"module: received a {type(module).__module__}.{type(module).__qualname__}; pass {_ACCEPTED}")


def is_keras_model(obj: Any) -> bool:
    """A Keras 3 keras.Model instance, checked by class name so that TensorFlow is not imported to ask."""
    return not isinstance(obj, type) and any(
        c.__name__ == "Model" and c.__module__.split(".")[0] == "keras" for c in type(obj).__mro__
    )


class KerasWeightsBack(Callback):
    """After fit, the trained weights go back into the user's keras.Model (as model.fit leaves it trained)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    def on_fit_end(self, ctx: Any) -> None:
        self.adapter.copy_weights_back()
