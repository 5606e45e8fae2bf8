"""Callbacks of other trainers given to unifit: Lightning's (trainer.callbacks, a LightningModule's
configure_callbacks()) and Keras' (trainer.callbacks, as model.fit takes them).

Each is taken one of three ways, decided before any step, every problem reported in one line:
run as it is (its hooks called where its own trainer calls them: callbacks/lightning_hooks.py through the
LightningModule's adapter, callbacks/keras_callbacks.py for Keras), mapped onto what unifit does itself
with the same behaviour (callbacks/lightning_mapping.py, callbacks/keras_mapping.py: checkpoints, early
stopping, TensorBoard...), or refused with the reason and what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from unifit.callbacks import keras_mapping, lightning_mapping
from unifit.config.loading import with_updates
from unifit.config.schema import TrainerConfig
from unifit.errors import ConfigError


@dataclass
class CallbackPlan:
    """What a run does with the callbacks of other trainers it was given."""

    config: TrainerConfig  # with the mapped callbacks' settings
    running: list[Any] = field(default_factory=list)  # Lightning callbacks run as they are (a LightningModule's run)
    lightning: list[Any] = field(default_factory=list)  # every Lightning callback (what trainer.callbacks shows)
    keras: list[Any] = field(default_factory=list)  # Keras callbacks run as they are (a Keras module's run)
    unifit: list[Any] = field(default_factory=list)  # unifit callbacks a mapped one brings (unifit.Callback)
    reports: dict[str, Callable[..., None]] = field(default_factory=dict)  # "checkpoint"/"early_stopping" -> mirror


def is_foreign_callback(obj: Any) -> bool:
    return lightning_mapping.is_lightning_callback(obj) or keras_mapping.is_keras_callback(obj)


def plan_callbacks(config: TrainerConfig, trainer_callbacks: list[Any], module_callbacks: list[Any]) -> CallbackPlan:
    """The plan for `trainer_callbacks` (the Trainer's, in order) and `module_callbacks` (a LightningModule's
    configure_callbacks(): each replaces the Trainer's of its type, as in Lightning)."""
    own_types = {type(cb) for cb in module_callbacks}
    callbacks = [cb for cb in trainer_callbacks if type(cb) not in own_types] + list(module_callbacks)
    plan = CallbackPlan(config=config)
    updates: dict[str, Any] = {}
    problems: list[str] = []
    for callback in callbacks:
        try:
            if lightning_mapping.is_lightning_callback(callback):
                plan.lightning.append(callback)
                mapped = _lightning(callback, plan)
            else:
                mapped = _keras(callback, plan)
            for key, value in (mapped or {}).items():
                _claim(updates, config, key, value)
        except ConfigError as exc:
            problems.append(f"{type(callback).__name__}: {exc}")
    if problems:
        raise ConfigError("trainer.callbacks: " + "; ".join(problems))
    if updates:
        plan.config = with_updates(config, updates)
    return plan


def _lightning(callback: Any, plan: CallbackPlan) -> dict[str, Any] | None:
    kind = lightning_mapping.lightning_kind(callback)
    if kind in lightning_mapping.REFUSED:
        raise ConfigError(f"Lightning's {kind} is not run by unifit: it {lightning_mapping.REFUSED[kind]}")
    mapper = lightning_mapping.MAPPED.get(kind) if kind is not None else None
    if mapper is None:
        plan.running.append(callback)
        return None
    lightning_mapping.check_not_customised(callback, kind)
    return mapper(callback, plan)


def _keras(callback: Any, plan: CallbackPlan) -> dict[str, Any] | None:
    kind = keras_mapping.keras_kind(callback)
    mapper = keras_mapping.MAPPED.get(kind) if kind is not None else None
    if mapper is None:
        plan.keras.append(callback)
        return None
    return mapper(callback, plan)


def _claim(updates: dict[str, Any], config: TrainerConfig, key: str, value: Any) -> None:
    """One callback sets `key` (an option, or a section's options); a second callback setting it, or the config
    setting one of them to another value, is a conflict (the same value twice is not: a saved config runs again)."""
    earlier = updates.get(key)
    if key in updates and not (isinstance(earlier, dict) and isinstance(value, dict) and not earlier.keys() & value):
        raise ConfigError(
            f"sets trainer.{key} like another callback before it; unifit keeps one {key} policy: merge them into one"
        )
    if isinstance(earlier, dict):  # another callback's options of the same section (OnExceptionCheckpoint's)
        value = {**earlier, **value}
    if key in config.model_fields_set:
        current = getattr(config, key)
        given = current.model_dump(exclude_unset=True) if hasattr(current, "model_dump") else current
        clashes = (
            [name for name, v in value.items() if name in given and given[name] != v]
            if isinstance(value, dict) and isinstance(given, dict)
            else ([] if given == value else [key])
        )
        if clashes:
            names = ", ".join(
                f"trainer.{key}.{name}" if isinstance(value, dict) else f"trainer.{name}" for name in clashes
            )
            raise ConfigError(f"sets {names}, which the config sets to another value: keep one of the two")
        if isinstance(value, dict) and isinstance(given, dict):
            value = {**given, **value}
    updates[key] = value
