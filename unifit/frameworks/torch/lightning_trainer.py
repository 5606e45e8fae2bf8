"""What `self.trainer` is for a LightningModule run by unifit, and the `trainer` a Lightning Callback receives.

Lightning's Trainer is a large object; module and callback code reads a part of it: the loop's position
(`current_epoch`, `global_step`), rank facts, `callback_metrics`, the optimizers, `should_stop`, the
strategy's collectives (`trainer.strategy.broadcast`, `reduce_boolean_decision`) and the logger.
`TrainerView` offers that part, read live from unifit's running fit; anything else is a one-line error
that lists what is offered. `self.trainer.strategy` / `precision_plugin` also route Lightning's own
manual optimization (`manual_backward`, `LightningOptimizer.step`, `clip_gradients`) into unifit's step seams.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unifit._imports import LIGHTNING, derives_from
from unifit.errors import ConfigError
from unifit.frameworks.torch.step_seams import StepOptimizer
from unifit.strategies import environment

# the Trainer attributes module and callback code may read
TRAINER_FACTS = (
    "current_epoch",
    "global_step",
    "global_rank",
    "local_rank",
    "node_rank",
    "world_size",
    "num_nodes",
    "num_devices",
    "is_global_zero",
    "max_epochs",
    "max_steps",
    "min_epochs",
    "callback_metrics",
    "logged_metrics",
    "progress_bar_metrics",
    "training",
    "validating",
    "testing",
    "predicting",
    "sanity_checking",
    "fast_dev_run",
    "should_stop",
    "estimated_stepping_batches",
    "num_training_batches",
    "accumulate_grad_batches",
    "check_val_every_n_epoch",
    "val_check_interval",
    "precision",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "optimizers",
    "lr_scheduler_configs",
    "lightning_module",
    "model",
    "datamodule",
    "callbacks",
    "checkpoint_callback",
    "checkpoint_callbacks",
    "early_stopping_callback",
    "logger",
    "loggers",
    "default_root_dir",
    "log_dir",
    "strategy",
    "precision_plugin",
    "predict_loop",
    "fit_loop",
)


class PredictLoopView:
    """`trainer.predict_loop` as Lightning's prediction writers (BasePredictionWriter) read it: this rank's
    predictions and each batch's dataset indices, by loader."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.current_batch_indices: list[int] = []
        self.epoch_batch_indices: list[list[list[int]]] = []  # loaders x batches x samples
        self._predictions: list[list[Any]] = []  # loaders x batches

    def record(self, loader: int, indices: list[int], outputs: Any) -> None:
        while len(self._predictions) <= loader:
            self._predictions.append([])
            self.epoch_batch_indices.append([])
        self.current_batch_indices = list(indices)
        self.epoch_batch_indices[loader].append(list(indices))
        self._predictions[loader].append(_on_cpu(outputs))

    @property
    def predictions(self) -> list[Any]:
        """One loader's list of batch outputs, or a list of them per loader (Lightning's)."""
        return self._predictions[0] if len(self._predictions) == 1 else self._predictions


class FitLoopView:
    """`trainer.fit_loop` for what Lightning's own callbacks set there, as StochasticWeightAveraging does for a model
    with BatchNorm: one more epoch (`max_epochs += 1`) of forward passes only (`_skip_backward`), in which the
    averaged weights' BatchNorm statistics are recomputed. Its `max_batches += 1` (Lightning's way to keep that
    epoch's accumulation from completing) changes nothing here: a forward-only epoch steps nothing anyway."""

    def __init__(self, view: Any) -> None:
        self._view = view
        self._skip = False
        self._extra_batches = 0

    @property
    def max_epochs(self) -> int | None:
        return self._view.max_epochs

    @max_epochs.setter
    def max_epochs(self, value: int) -> None:
        ctx = self._view.ctx
        if ctx is None:
            raise ConfigError(f"trainer.fit_loop.max_epochs = {value}: set it while fit runs (from a callback)")
        self._view.max_epochs = value
        ctx.config = ctx.config.model_copy(update={"max_epochs": value})  # the loop reads it each epoch

    @property
    def max_batches(self) -> int:
        return self._view.num_training_batches + self._extra_batches

    @max_batches.setter
    def max_batches(self, value: int) -> None:
        extra = value - self._view.num_training_batches
        if extra not in (0, 1):
            raise ConfigError(
                f"trainer.fit_loop.max_batches = {value}: an epoch here takes its {self._view.num_training_batches} "
                "batches; set trainer.limit_train_batches for fewer"
            )
        self._extra_batches = extra

    @property
    def _skip_backward(self) -> bool:
        return self._skip

    @_skip_backward.setter
    def _skip_backward(self, value: bool) -> None:
        module = self._view.lightning_module
        if value and module is not None and not module.automatic_optimization:
            raise ConfigError(
                "trainer.fit_loop._skip_backward = True: a forward-only epoch of a module with manual optimization "
                "would still step its optimizers in training_step; train it without that callback"
            )
        self._skip = bool(value)


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value


class NotOffered(ConfigError, AttributeError):
    """What the stand-in does not offer: one line naming what it does; an AttributeError too, so that
    `hasattr(trainer, name)` and `getattr(trainer, name, default)` answer as for any object."""


class TrainerView:
    """`self.trainer` of a LightningModule run by unifit, and the `trainer` its Lightning callbacks receive."""

    def __init__(self, lightning_module: Any = None, datamodule: Any = None) -> None:
        self.ctx: Any = None  # unifit's FitContext, once the fit has set up
        self.seams: Any = None  # the running engine's StepSeams, while fit trains
        self.dist: Any = None  # unifit's Strategy of this run (fit, validate, test, predict), for the collectives
        self.lightning_module = lightning_module
        self.datamodule = datamodule
        self.callbacks: list[Any] = []  # the Lightning callbacks of this run (run as they are, or mapped)
        self.strategy = _StrategyView(self)
        self.precision_plugin = _PrecisionView(self)
        self.predict_loop = PredictLoopView()
        self.fit_loop = FitLoopView(self)
        self.loggers: list[Any] = []  # the run's (unifit.loggers), set by the adapter as a fit starts
        self.gradient_clip_algorithm = None
        self.epoch = 0  # Lightning's current_epoch: the running epoch, counted up when the next one starts
        self.max_epochs: int | None = None
        self.min_epochs: int | None = None
        self.stage = "fit"
        self.training = True
        self.sanity_checking = False
        self.fast_dev_run = False
        self.num_devices = 1
        self.estimated_stepping_batches: int | None = None  # set as fit's configure_optimizers runs
        self.config: Any = None  # the run's TrainerConfig, from before setup() and configure_optimizers() run

    def _facts(self) -> tuple[int, int, int]:
        if self.ctx is not None:
            return self.ctx.rank, self.ctx.world_size, self.ctx.progress.optimizer_step
        env = environment.detect()  # before set-up (configure_optimizers): the process's rank facts
        return env.rank, env.world_size, 0

    @property
    def global_rank(self) -> int:
        return self._facts()[0]

    @property
    def local_rank(self) -> int:
        return environment.detect().local_rank

    @property
    def world_size(self) -> int:
        return self._facts()[1]

    @property
    def num_nodes(self) -> int:
        env = environment.detect()
        return max(1, env.world_size // max(1, env.local_world_size))

    @property
    def node_rank(self) -> int:
        env = environment.detect()
        return env.rank // max(1, env.local_world_size)

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def current_epoch(self) -> int:
        return self.epoch

    @property
    def max_steps(self) -> int:
        """Lightning's: -1 when the fit is not limited by steps."""
        limit = self._config("max_steps")
        return -1 if limit is None else limit

    @property
    def global_step(self) -> int:
        return self._facts()[2]

    @property
    def validating(self) -> bool:
        return self.stage == "validate" or (self.stage == "fit" and not self.training)

    @property
    def testing(self) -> bool:
        return self.stage == "test"

    @property
    def predicting(self) -> bool:
        return self.stage == "predict"

    @property
    def should_stop(self) -> bool:
        return bool(self.ctx and self.ctx.state.should_stop)

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        if value and self.ctx is not None:
            reason = "trainer.should_stop was set (by the LightningModule or a callback)"
            self.ctx.state.ask_to_stop(reason, self.ctx.world_size)  # with several ranks, at their next agreement

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        metrics = self.ctx.state.metrics if self.ctx is not None else {}
        return {name: torch.tensor(value) for name, value in metrics.items()}

    logged_metrics = callback_metrics
    progress_bar_metrics = callback_metrics

    @property
    def num_training_batches(self) -> int | float:
        return self.ctx.batches_per_epoch if self.ctx is not None else float("inf")

    @property
    def accumulate_grad_batches(self) -> int:
        """The current epoch's (trainer.accumulation_schedule, Lightning's GradientAccumulationScheduler, changes it)."""
        config = self._run_config()
        if config is None:
            return 1
        return config.accumulation_at(self.ctx.progress.epoch if self.ctx is not None else 0)

    @accumulate_grad_batches.setter
    def accumulate_grad_batches(self, value: int) -> None:
        """Set by StochasticWeightAveraging around its forward-only epoch (where nothing steps) and restored after;
        any other change is refused: unifit sizes steps, warmup and checkpoints by one accumulation per fit."""
        if not self.fit_loop._skip_backward and value != self.accumulate_grad_batches:
            raise ConfigError(
                f"trainer.accumulate_grad_batches = {value}: the accumulation is set before the fit "
                f"(trainer.accumulate_grad_batches: {self.accumulate_grad_batches}, or trainer.accumulation_schedule "
                "for one that changes by epoch)"
            )

    @property
    def check_val_every_n_epoch(self) -> int:
        return self._config("validate_every_n_epochs") or 1

    @property
    def val_check_interval(self) -> int | float:
        interval = self._config("val_check_interval")
        return 1.0 if interval is None else interval

    @property
    def precision(self) -> str:
        return self._config("precision") or "32-true"

    @property
    def default_root_dir(self) -> str | None:
        return self._config("root_dir")

    @property
    def logger(self) -> Any:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str | None:
        return getattr(self.logger, "log_dir", None)

    @property
    def model(self) -> Any:
        """Lightning's is the strategy's wrapped model; eval()/train() on the module itself act alike."""
        return self.lightning_module

    @property
    def checkpoint_callbacks(self) -> list[Any]:
        return [cb for cb in self.callbacks if derives_from(cb, "Checkpoint", *LIGHTNING)]

    @property
    def checkpoint_callback(self) -> Any:
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def early_stopping_callback(self) -> Any:
        return next((cb for cb in self.callbacks if derives_from(cb, "EarlyStopping", *LIGHTNING)), None)

    @property
    def optimizers(self) -> list[Any]:
        return list(self._seams().engine.optimizers)

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        """The engine's schedules (each has .scheduler, .interval, .frequency, as Lightning's LRSchedulerConfig),
        live: a callback that swaps or adds one (StochasticWeightAveraging puts its SWALR in) changes what steps."""
        return _SchedulerConfigs(self._seams().engine)

    @property
    def gradient_clip_val(self) -> float | None:
        return self._config("gradient_clip_val")

    def _run_config(self) -> Any:
        """The running loop's config, else (in setup and configure_optimizers) the one the fit set up with."""
        return self.ctx.config if self.ctx is not None else self.config

    def _config(self, name: str) -> Any:
        config = self._run_config()
        return getattr(config, name) if config is not None else None

    def _seams(self) -> Any:
        if self.seams is None:
            raise ConfigError("self.trainer.optimizers: the optimizers exist only while fit() trains")
        return self.seams

    def __getattr__(self, name: str) -> Any:
        raise NotOffered(
            f"trainer.{name}: unifit runs this LightningModule and its callbacks without a Lightning Trainer; "
            f"it offers {', '.join(TRAINER_FACTS)} (see docs/lightning.md)"
        )


class _SchedulerConfigs(list):
    def __init__(self, engine: Any) -> None:
        super().__init__(engine.schedules)
        self._engine = engine

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        self._sync()

    def append(self, value: Any) -> None:
        super().append(value)
        self._sync()

    def clear(self) -> None:
        super().clear()
        self._sync()

    def _sync(self) -> None:
        from unifit.frameworks.torch.optimizers import SchedulerSpec

        engine = self._engine
        specs = [
            c
            if isinstance(c, SchedulerSpec)
            else SchedulerSpec(c.scheduler, c.interval, c.frequency, getattr(c, "monitor", None))
            for c in self
        ]
        unifit_steps = engine.stepped == engine.schedules  # automatic optimization: unifit steps every schedule
        engine.schedules[:] = specs
        if unifit_steps:
            engine.stepped[:] = specs


class _StrategyView:
    """`trainer.strategy`: what Lightning's own module code calls on it (manual_backward, LightningOptimizer.step,
    self.optimizers()), routed to unifit's step seams, and the collectives callbacks use, on unifit's strategy."""

    def __init__(self, view: TrainerView) -> None:
        self._view = view
        self._wrapped: list[Any] = []  # LightningOptimizers, made once per fit

    @property
    def _lightning_optimizers(self) -> list[Any]:
        optimizers = self._view.optimizers
        if [w.optimizer for w in self._wrapped] != optimizers:
            from lightning.pytorch.core.optimizer import LightningOptimizer

            self._wrapped = [LightningOptimizer._to_lightning_optimizer(o, self) for o in optimizers]
        return self._wrapped

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        self._view._seams().backward(closure_loss, *args, **kwargs)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return self._view._seams().step(unwrapped(optimizer), closure)

    # ---- facts and collectives --------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._view.world_size

    @property
    def global_rank(self) -> int:
        return self._view.global_rank

    @property
    def local_rank(self) -> int:
        return self._view.local_rank

    @property
    def is_global_zero(self) -> bool:
        return self._view.is_global_zero

    @property
    def root_device(self) -> torch.device:
        return self._view._seams().engine.device

    def barrier(self, name: str | None = None) -> None:
        self._unifit().barrier(name or "lightning callback")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._unifit().broadcast_object(obj, src)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        gathered = self._unifit().all_gather_object(tensor.detach().cpu())
        return torch.stack(gathered).to(tensor.device)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """A sum or mean over the ranks (Lightning's default: mean)."""
        op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
        if op not in ("mean", "avg", "sum"):
            raise ConfigError(f"trainer.strategy.reduce: reduce_op={reduce_op!r}; unifit reduces by 'mean' or 'sum'")
        value = torch.as_tensor(tensor)
        total = self._unifit().all_reduce_sum(value.detach().double().cpu().numpy().reshape(-1))
        if op != "sum":
            total = total / self.world_size
        return torch.as_tensor(np.asarray(total).reshape(value.shape), dtype=value.dtype, device=value.device)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """True when every rank decided so (`all`), or any rank did."""
        if all:  # no rank decided otherwise
            return not bool(self._unifit().all_reduce_max(np.array([0.0 if decision else 1.0]))[0])
        return bool(self._unifit().all_reduce_max(np.array([1.0 if decision else 0.0]))[0])

    def _unifit(self) -> Any:
        if self._view.dist is None:
            raise ConfigError("trainer.strategy: its collectives exist once fit/validate/test/predict has set up")
        return self._view.dist

    def __getattr__(self, name: str) -> Any:
        raise NotOffered(
            f"trainer.strategy.{name}: unifit runs this LightningModule without a Lightning Trainer; its strategy "
            "stand-in offers backward, optimizer_step, barrier, broadcast, all_gather, reduce, "
            "reduce_boolean_decision, world_size, global_rank, local_rank, is_global_zero and root_device"
        )


class _PrecisionView:
    """`self.trainer.precision_plugin`: Lightning's clip_gradients ends here, in unifit's clipping of the
    true gradients (unscaled, averaged over ranks, by the global norm over every shard)."""

    def __init__(self, view: TrainerView) -> None:
        self._view = view

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        self._view._seams().clip(unwrapped(optimizer), clip_val, gradient_clip_algorithm)


def unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside a LightningOptimizer or a StepOptimizer; any other optimizer as it is (an
    optimizer that wraps another one, a Lookahead say, is the one configure_optimizers returned)."""
    if isinstance(optimizer, StepOptimizer) or type(optimizer).__name__ == "LightningOptimizer":
        return optimizer.optimizer
    return optimizer
