"""What `configure_optimizers()` may return, checked at set-up (before the first step).

Accepted, as Lightning documents them:
    optimizer | [optimizer] | (optimizer, scheduler) | ([optimizer], [scheduler])
    {"optimizer": o, "lr_scheduler": scheduler | {"scheduler": s, "interval", "frequency", "monitor"},
     "monitor": ..., "interval": ...}
Automatic optimization steps exactly one optimizer (as in Lightning 2.x), with any number of schedulers
(each stepped at its own interval, in order, as Lightning does); several optimizers (GANs, actor-critic)
are for manual optimization, where the module steps them and its schedulers itself.
A scheduler that is not torch's (timm's) is accepted when the module steps it in lr_scheduler_step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from unifit.errors import ConfigError
from unifit.strategies.torch_compat import set_last_lr

_FORMS = (
    "return one torch optimizer, (optimizer, scheduler), ([optimizer], [scheduler]) or "
    "{'optimizer': ..., 'lr_scheduler': scheduler or {'scheduler': ..., 'interval': 'epoch'|'step', "
    "'frequency': N, 'monitor': 'val/loss'}}"
)
_SCHEDULER_KEYS = {"scheduler", "interval", "frequency", "monitor", "strict", "name"}


@dataclass
class SchedulerSpec:
    """A scheduler and when it steps: every `frequency` epochs or optimizer steps; a monitored
    one (ReduceLROnPlateau) with the value of the metric `monitor` after validation."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None


def parse_optimizers(
    result: Any, module_name: str, manual: bool = False, own_scheduler_step: bool = False
) -> tuple[list[torch.optim.Optimizer], list[SchedulerSpec]]:
    """(optimizers, schedules): one optimizer and at most one schedule unless `manual`."""
    where = f"{module_name}.configure_optimizers()"
    top_monitor, top_interval = None, None
    if isinstance(result, (tuple, list)) and len(result) == 1 and isinstance(result[0], dict):
        result = result[0]  # [{"optimizer": ..., ...}]
    if isinstance(result, dict):
        unknown = set(result) - {"optimizer", "lr_scheduler", "interval", "monitor"}
        if unknown:
            raise ConfigError(f"{where} returned a dict with unknown keys {sorted(unknown)}; {_FORMS}")
        optimizers = [result.get("optimizer")]
        schedulers = [result["lr_scheduler"]] if result.get("lr_scheduler") is not None else []
        top_monitor, top_interval = result.get("monitor"), result.get("interval")
    elif isinstance(result, (tuple, list)):
        optimizers, schedulers = _split_sequence(list(result), where, own_scheduler_step)
    else:
        optimizers, schedulers = [result], []
    if manual and any(isinstance(o, dict) for o in optimizers):  # several {"optimizer": ..., "lr_scheduler": ...}
        pairs = [parse_optimizers(o, module_name, manual, own_scheduler_step) for o in optimizers]
        return [o for os, _ in pairs for o in os], [s for _, ss in pairs for s in ss]
    if len(optimizers) != 1 and not (manual and optimizers):
        kinds = ", ".join(type(o).__name__ for o in optimizers) or "none"
        raise ConfigError(
            f"{where} returned {len(optimizers)} optimizers ({kinds}); automatic optimization steps one "
            "optimizer (as in Lightning): put all parameters in one optimizer with param groups, or set "
            "self.automatic_optimization = False and step each in training_step (manual optimization)"
        )
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"{where} returned {type(result).__name__} whose optimizer is a {type(optimizer).__name__}; {_FORMS}"
            )
        for i, group in enumerate(optimizer.param_groups):
            if group["lr"] < 0:
                raise ConfigError(f"{where}: param group {i} has lr={group['lr']}; the learning rate must be >= 0")
    specs = [_scheduler_spec(s, where, top_monitor, top_interval, manual, own_scheduler_step) for s in schedulers]
    for spec in specs:
        if getattr(spec.scheduler, "optimizer", optimizers[0]) not in optimizers:
            raise ConfigError(
                f"{where}: the scheduler {type(spec.scheduler).__name__} was built for another "
                "optimizer than the one returned; build it with the returned optimizer"
            )
    return optimizers, specs


def _split_sequence(items: list[Any], where: str, own_scheduler_step: bool) -> tuple[list[Any], list[Any]]:
    if len(items) == 2 and all(isinstance(x, (list, tuple)) for x in items):  # ([optimizers], [schedulers])
        return list(items[0]), list(items[1])
    optimizers = [x for x in items if isinstance(x, (torch.optim.Optimizer, dict))]
    schedulers = [x for x in items if _is_scheduler(x) or (own_scheduler_step and x not in optimizers)]
    others = [x for x in items if x not in optimizers and x not in schedulers]
    if others:
        raise ConfigError(f"{where} returned a {type(items).__name__} holding a {type(others[0]).__name__}; {_FORMS}")
    return optimizers, schedulers  # several dicts count as several optimizers (refused)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau))


def _scheduler_spec(
    entry: Any, where: str, monitor: str | None, interval: str | None, manual: bool, own_step: bool
) -> SchedulerSpec:
    options: dict[str, Any] = {}
    if isinstance(entry, dict):
        unknown = set(entry) - _SCHEDULER_KEYS
        if unknown or "scheduler" not in entry:
            raise ConfigError(
                f"{where}: the lr_scheduler dict needs 'scheduler' and takes only {sorted(_SCHEDULER_KEYS)}; "
                f"received keys {sorted(entry)}"
            )
        options, entry = entry, entry["scheduler"]
    if manual:  # the module steps its schedulers itself (self.lr_schedulers()); when is its choice
        return SchedulerSpec(entry)
    if not _is_scheduler(entry) and not own_step:
        raise ConfigError(
            f"{where}: lr_scheduler is a {type(entry).__name__}, not a torch LR scheduler; {_FORMS} "
            "(a scheduler of another library, e.g. timm's, is stepped by overriding lr_scheduler_step)"
        )
    spec = SchedulerSpec(
        entry,
        interval=options.get("interval", interval or "epoch"),
        frequency=options.get("frequency", 1),
        monitor=options.get("monitor", monitor),
    )
    if spec.interval not in ("epoch", "step"):
        raise ConfigError(f"{where}: interval received {spec.interval!r}; use 'epoch' or 'step'")
    if not isinstance(spec.frequency, int) or spec.frequency < 1:
        raise ConfigError(f"{where}: frequency received {spec.frequency!r}; use a positive integer")
    plateau = isinstance(entry, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if own_step and not _is_scheduler(entry):
        return spec  # the module's lr_scheduler_step knows what the scheduler takes
    if plateau and not spec.monitor:
        raise ConfigError(
            f"{where}: ReduceLROnPlateau needs the metric it watches; return "
            "{'optimizer': opt, 'lr_scheduler': {'scheduler': sched, 'monitor': 'val/loss'}}"
        )
    if spec.monitor and not plateau:
        raise ConfigError(
            f"{where}: 'monitor' is given for {type(entry).__name__}, which takes no metric; "
            "remove 'monitor' or use ReduceLROnPlateau"
        )
    if spec.monitor and spec.interval != "epoch":
        raise ConfigError(f"{where}: a monitored scheduler steps after validation; use interval 'epoch'")
    return spec


# the lrs scale_lrs multiplies: an optimizer's groups' and its schedulers' (base_values: timm's schedulers)
_LR_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
_LR_SCHEDULER_ATTRS = ("base_lrs", "max_lrs", "min_lrs", "base_values")


def scale_lrs(optimizer: torch.optim.Optimizer, schedulers: list[Any], factor: float) -> None:
    """Turn the module's base lrs into scaled ones, in the optimizer and its schedulers alike."""
    if factor == 1.0:
        return
    for group in optimizer.param_groups:
        for key in _LR_GROUP_KEYS:
            if isinstance(group.get(key), (int, float)):
                group[key] *= factor
    for scheduler in schedulers:
        for attr in _LR_SCHEDULER_ATTRS:
            values = getattr(scheduler, attr, None)
            if isinstance(values, list):
                setattr(scheduler, attr, [v * factor for v in values])
        set_last_lr(scheduler, [group["lr"] for group in optimizer.param_groups])
