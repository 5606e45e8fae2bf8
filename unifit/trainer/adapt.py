"""What users hand Trainer.fit, as a module unifit can train.

A unifit TrainModule / KerasModule is used as it is; an unchanged `lightning.LightningModule`
(with a `LightningDataModule` as its data, if given) is wrapped by frameworks/torch/lightning.py,
and callbacks/lightning_hooks.py calls its own hooks. A compiled Keras 3 `keras.Model` is wrapped by
frameworks/keras/compiled.py (loss, metrics and optimizer from model.compile); the callback below
copies the trained weights back into the user's model object after fit.
Anything else is refused in one line that says what to pass instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from unifit._imports import derives_from
from unifit.callbacks.foreign import CallbackPlan, plan_callbacks
from unifit.callbacks.keras_callbacks import KerasCallbacks
from unifit.callbacks.lightning_hooks import LightningEpochEnds, LightningHooks
from unifit.errors import ConfigError
from unifit.frameworks.module import ModuleBase
from unifit.loop.callback import Callback

_ACCEPTED = (
    "a unifit.TrainModule (PyTorch) or unifit.KerasModule (Keras) subclass, a lightning "
    "LightningModule, or a compiled keras.Model"
)


# a stage's data slot in GivenData, and Lightning's keyword for it
STAGE_SLOT = {"fit": "train", "validate": "val", "test": "test", "predict": "predict"}


@dataclass
class GivenData:
    """Data passed as Lightning passes it (`fit(model, train_loader, val_loader)`, `train_dataloaders=`,
    `val_dataloaders=`, `dataloaders=`): a data provider holding those loaders or datasets; what was not
    given comes from the module (`fallback`), as in Lightning."""

    train: Any = None
    val: Any = None
    test: Any = None
    predict: Any = None
    fallback: Any = None  # the module, set by set_up

    def train_dataset(self) -> Any:
        return self._pick("train")

    def val_dataset(self) -> Any:
        return self._pick("val")

    def test_dataset(self) -> Any:
        return self._pick("test")

    def predict_dataset(self) -> Any:
        return self._pick("predict")

    def _pick(self, slot: str) -> Any:
        given = getattr(self, slot)
        return given if given is not None else getattr(self.fallback, f"{slot}_dataset")()


def passed_data(stage: str, data: Any, ckpt_path: Any, datamodule: Any = None, **loaders: Any) -> tuple[Any, Any]:
    """(data, ckpt_path) from every way Lightning's Trainer takes data: `data` may be a data provider, a
    LightningDataModule or a torch DataLoader / Dataset (the stage's: train for fit); `loaders` are
    Lightning's keywords by slot (train=, val=, test=, predict=). Lightning's positional order
    fit(model, train, val) puts the val loader where unifit's ckpt_path is: taken as the val loader."""
    if ckpt_path is not None and not isinstance(ckpt_path, (str, os.PathLike)):
        if stage != "fit" or loaders.get("val") is not None:
            raise ConfigError(
                f"ckpt_path: received a {type(ckpt_path).__name__}; pass a checkpoint ('last', 'best', a name or a "
                "directory), and data as data= / dataloaders="
            )
        loaders["val"], ckpt_path = ckpt_path, None
    if datamodule is not None:
        if data is not None and data is not datamodule:
            raise ConfigError(f"{stage}(): received both data and datamodule; pass the data module once")
        data = datamodule
    given = {slot: value for slot, value in loaders.items() if value is not None}
    if data is not None and _is_torch_data(data):
        slot = STAGE_SLOT[stage]
        if slot in given:
            raise ConfigError(
                f"{stage}(): the {slot} data was passed twice (positionally and by keyword); pass it once"
            )
        given[slot] = data
    elif given and data is not None:
        raise ConfigError(
            f"{stage}(): received a {type(data).__name__} and loaders ({', '.join(sorted(given))}); pass either a "
            "data module (or provider) or loaders"
        )
    return (GivenData(**given) if given else data), ckpt_path


def _is_torch_data(obj: Any) -> bool:
    """A torch DataLoader or Dataset, or a list of them (by class name: torch is not imported to ask)."""
    if isinstance(obj, (list, tuple)) and obj:
        return all(_is_torch_data(each) for each in obj)
    return any(
        c.__name__ in ("DataLoader", "Dataset", "IterableDataset") and c.__module__.startswith("torch.utils.data")
        for c in type(obj).__mro__
    )


@dataclass
class Prepared:
    """What the user passed, made trainable, with the run's Lightning callbacks planned."""

    module: ModuleBase
    data: Any
    plan: CallbackPlan  # plan.config: this run's config, with the mapped callbacks' settings
    callbacks: list[Callback]  # unifit callbacks the run's Keras callbacks need (their runner, a mapped one's own)


def prepare(config: Any, module: Any, data: Any = None, callbacks: list[Any] | None = None) -> Prepared:
    """The module made trainable; the Trainer's Lightning `callbacks` and the module's own (configure_callbacks)
    mapped onto the config, run by the module, or refused, all problems at once (callbacks/lightning_mapping.py)."""
    module, data = trainable(module, data)
    plan = plan_callbacks(config, list(callbacks or []), module.own_callbacks)
    module.use_callbacks(plan.running, plan.lightning)
    if plan.keras and module.framework != "tensorflow":
        raise ConfigError(
            f"trainer.callbacks: {', '.join(type(cb).__name__ for cb in plan.keras)} (Keras callbacks) run with Keras "
            f"modules and compiled Keras models, and {type(module).__name__} is a PyTorch module: write them as "
            "unifit.Callback subclasses, or use Lightning's callbacks with a LightningModule"
        )
    runners = [KerasCallbacks.made_for(plan.keras)] if plan.keras else []
    return Prepared(module, data, plan, [*runners, *plan.unifit])


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
    module.attach_strategy(strategy)
    training = registry.training(config.strategy, module.framework, strategy)  # the (strategy, framework) table
    if isinstance(data, GivenData):
        data.fallback = module
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
        given = data if isinstance(data, GivenData) else None  # loaders: the adapter asks them first
        adapter = lightning.LightningAdapter(module, datamodule=datamodule, given=given)
        adapter.attach_callbacks([LightningEpochEnds(adapter), LightningHooks(adapter)])
        return adapter, (None if datamodule is not None or given is not None else data)
    if isinstance(module, type):
        raise ConfigError(f"module: received the class {module.__name__}, not an instance; pass {module.__name__}(...)")
    raise ConfigError(f"module: received a {type(module).__module__}.{type(module).__qualname__}; pass {_ACCEPTED}")


def is_keras_model(obj: Any) -> bool:
    """A Keras 3 keras.Model instance, checked by class name so that TensorFlow is not imported to ask."""
    return not isinstance(obj, type) and derives_from(obj, "Model", "keras")


class KerasWeightsBack(Callback):
    """After fit, the trained weights go back into the user's keras.Model (as model.fit leaves it trained)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    def on_fit_end(self, ctx: Any) -> None:
        self.adapter.copy_weights_back()
