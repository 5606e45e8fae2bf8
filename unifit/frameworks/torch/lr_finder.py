"""Lightning's learning-rate range test (Tuner.lr_find / the LearningRateFinder callback), before the first epoch.

The engine trains `num_training_steps` optimizer steps with the lr swept from `min_lr` to `max_lr` (exponentially or
linearly, every param group at the same lr, schedules and warmup held), records each step's loss averaged over every
rank, smoothed as Lightning smooths it, and stops early where the smoothed loss passes `early_stop_threshold` times
the best. The suggestion is Lightning's: the lr of the steepest descent of the loss, the first 10 and the last step
left out. Then the model, optimizers, schedules, step counter and random states go back to what they were, so the
fit starts as it would have; with `update_attr` the suggestion becomes the lr (param groups keep their ratios, the
schedules follow) and the module's `lr` / `learning_rate` attribute (or `attr_name`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unifit.errors import ConfigError
from unifit.frameworks.torch.optimizers import scale_lrs

log = logging.getLogger("unifit")

SMOOTHING = 0.98  # Lightning's _LRCallback beta
SKIP_BEGIN, SKIP_END = 10, 1  # Lightning's suggestion() defaults


@dataclass
class LRFinderResult:
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # smoothed, as Lightning records them
    suggestion: float | None = None


def lr_at(settings: Any, step: int) -> float:
    """The lr of sweep step `step`, as Lightning's _ExponentialLR / _LinearLR give it: min_lr at the first step, then
    (step + 1) / num_training_steps of the way (its scheduler is a step ahead after the first), max_lr at the last."""
    fraction = 0.0 if step == 0 else (step + 1) / settings.num_training_steps
    if settings.mode == "linear":
        return settings.min_lr + fraction * (settings.max_lr - settings.min_lr)
    return settings.min_lr * (settings.max_lr / settings.min_lr) ** fraction


def suggestion(lrs: list[float], losses: list[float]) -> float | None:
    """The lr where the loss falls fastest (np.gradient over the lr, as Lightning's torch.gradient with spacing)."""
    if len(losses) <= SKIP_BEGIN + SKIP_END:
        return None
    kept = np.arange(len(losses))[SKIP_BEGIN:-SKIP_END]
    loss, lr = np.asarray(losses)[kept], np.asarray(lrs)[kept]
    finite = np.isfinite(loss)
    if finite.sum() < 2:
        return None
    gradients = np.gradient(loss[finite], lr[finite])
    return float(lrs[kept[finite][int(np.argmin(gradients))]])


def find_lr(engine: Any, settings: Any) -> LRFinderResult:
    """Run the range test on `engine` (a set-up TorchEngine, before its first step) and put everything back."""
    owner, attribute = _lr_attribute(engine, settings)
    saved = engine.snapshot()
    stepped, policy = engine.stepped, engine.policy
    engine.stepped, engine.policy = [], type(policy)(factor=policy.factor, warmup_steps=0)
    result, average, best = LRFinderResult(), 0.0, math.inf
    try:
        _set_lr(engine, lr_at(settings, 0))
        epoch, taken = 0, 0
        while taken < settings.num_training_steps:
            for batch_idx, batch in enumerate(engine.train_batches(epoch)):
                before = engine.optimizer_steps
                loss = engine.train_step(batch, batch_idx)
                if engine.optimizer_steps == before:  # inside an accumulation window
                    continue
                mean = _mean_over_ranks(engine, loss)
                average = SMOOTHING * average + (1 - SMOOTHING) * mean
                smoothed = average / (1 - SMOOTHING ** (taken + 2))  # Lightning's bias correction, by its step count
                result.lrs.append(lr_at(settings, taken))
                result.losses.append(smoothed)
                best = min(best, smoothed)
                taken += 1
                diverged = settings.early_stop_threshold is not None and (
                    not math.isfinite(smoothed) or smoothed > settings.early_stop_threshold * best
                )
                if diverged or taken >= settings.num_training_steps:
                    taken = settings.num_training_steps if diverged else taken
                    break
                _set_lr(engine, lr_at(settings, taken))
            epoch += 1
    finally:
        engine.stepped, engine.policy = stepped, policy
        engine.rewind(saved)
    result.suggestion = suggestion(result.lrs, result.losses)
    was = engine.optimizer.param_groups[0]["lr"]
    if result.suggestion is not None and settings.update_attr:
        _adopt(engine, result.suggestion / was)
        if attribute is not None:
            _set_attribute(owner, attribute, result.suggestion)
    if engine.strategy.is_global_zero:
        _report(result, settings, was)
    return result


def _report(result: LRFinderResult, settings: Any, was: float) -> None:
    if result.suggestion is None:
        log.warning("lr_find: too few steps for a suggestion (%d recorded); the lr stays %g", len(result.lrs), was)
        return
    log.info(
        "lr_find: %d steps from %g to %g; suggested lr %g (was %g)%s",
        len(result.lrs),
        settings.min_lr,
        result.lrs[-1],
        result.suggestion,
        was,
        ", now the lr" if settings.update_attr else "",
    )


def _mean_over_ranks(engine: Any, loss: Any) -> float:
    """This step's loss averaged over every rank, so every rank records the same curve and stops at the same step
    (a skipped batch counts as no value)."""
    value = math.nan if loss is None else float(loss)
    sums = engine.strategy.all_reduce_sum(np.array([0.0 if math.isnan(value) else value, float(not math.isnan(value))]))
    return float(sums[0] / sums[1]) if sums[1] else math.nan


def _set_lr(engine: Any, lr: float) -> None:
    for optimizer in engine.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


def _adopt(engine: Any, factor: float) -> None:
    """The suggestion becomes the run's lr: every lr of the optimizers and schedules scaled alike."""
    for optimizer in engine.optimizers:
        scale_lrs(optimizer, [s.scheduler for s in engine.schedules if s.scheduler.optimizer is optimizer], factor)


def _lr_attribute(engine: Any, settings: Any) -> tuple[Any, str | None]:
    """The module's object and its attribute that holds the lr (`attr_name`, else `lr` or `learning_rate`, on the
    module or in its hparams, as Lightning looks): set to the suggestion too, for code that reads it again.
    Checked before the sweep: an `attr_name` the module does not have is an error then."""
    owner = getattr(engine.module, "lightning", engine.module)  # a LightningModule's own object
    if not settings.update_attr:
        return owner, None
    for name in [settings.attr_name] if settings.attr_name else ["lr", "learning_rate"]:
        if _has_value(owner, name) or name in (getattr(owner, "hparams", None) or {}):
            return owner, name
    if settings.attr_name:
        raise ConfigError(
            f"trainer.lr_find.attr_name: {type(owner).__name__} has no attribute {settings.attr_name!r} (nor in its "
            "hparams) to set the found lr on; name one it has, or leave attr_name empty"
        )
    return owner, None


def _has_value(owner: Any, name: str) -> bool:
    return isinstance(getattr(owner, name, None), (int, float))


def _set_attribute(owner: Any, name: str, lr: float) -> None:
    if _has_value(owner, name):
        setattr(owner, name, lr)
    hparams = getattr(owner, "hparams", None)
    if hparams is not None and name in hparams:
        hparams[name] = lr
