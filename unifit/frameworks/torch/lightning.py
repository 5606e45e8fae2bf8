"""Train an unchanged `lightning.LightningModule` (and `LightningDataModule`) on every torch strategy.

`LightningAdapter` is a TrainModule that delegates to the LightningModule: its steps, optimizers,
data loaders and own hooks. The module sees a small stand-in for Lightning's Trainer
(`self.trainer.current_epoch`, `global_step`, `world_size`, ...), and `self.log` / `log_dict` write
into unifit's metrics, which are exact sample-weighted means over all ranks (so `sync_dist` is
always honoured). Manual optimization and the hooks inside the optimizer step run through unifit's
step seams (frameworks/torch/step_seams.py): `self.trainer.strategy` and `precision_plugin` are small
stand-ins that route Lightning's own `manual_backward`, `LightningOptimizer.step` and `clip_gradients`
there. What unifit cannot honour exactly is refused at set-up in one line rather than ignored
(docs/lightning.md lists what is covered and what is refused).
"""

from __future__ import annotations

from typing import Any

import torch

from unifit.errors import ConfigError
from unifit.frameworks.torch.data import batch_size_of
from unifit.frameworks.torch.module import TrainModule
from unifit.frameworks.torch.step_seams import STEP_HOOKS, StepOptimizer
from unifit.frameworks.torch.user_loaders import Several
from unifit.strategies import environment

# overrides refused: `backward` would have to receive the precision's scaled loss and skip fsdp's
# check of modified views; configure_sharded_model is Lightning 1.x's (configure_model replaced it)
_REFUSED_HOOKS = ("backward", "manual_backward", "configure_sharded_model")
# the Trainer attributes a LightningModule may read through self.trainer
_TRAINER_FACTS = (
    "current_epoch",
    "global_step",
    "global_rank",
    "local_rank",
    "world_size",
    "num_nodes",
    "is_global_zero",
    "max_epochs",
    "max_steps",
    "callback_metrics",
    "logged_metrics",
    "training",
    "sanity_checking",
    "num_devices",
    "should_stop",
    "estimated_stepping_batches",
    "optimizers",
    "lr_scheduler_configs",
    "strategy",
    "precision_plugin",
    "gradient_clip_val",
    "gradient_clip_algorithm",
)
# Trainer.validate/test/predict -> the word in Lightning's hook names
_HOOK_STAGE = {"validate": "validation", "test": "test", "predict": "predict"}


def is_lightning_module(obj: Any) -> bool:
    return _derives_from(obj, "LightningModule")


def is_lightning_datamodule(obj: Any) -> bool:
    return _derives_from(obj, "LightningDataModule")


def _derives_from(obj: Any, name: str) -> bool:
    """Checked by name, so that neither lightning nor pytorch_lightning is imported to ask."""
    return any(
        c.__name__ == name and c.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
        for c in type(obj).__mro__
    )


def _overrides(obj: Any, hook: str) -> bool:
    """True when `hook` is defined below Lightning's base classes (by the user, or a demo module), or set on
    the instance (LightningDataModule.from_datasets sets its loaders so)."""
    if hook in getattr(obj, "__dict__", {}):
        return True
    for cls in type(obj).__mro__:
        if hook in vars(cls):
            return not cls.__module__.startswith(("lightning.pytorch.core", "pytorch_lightning.core", "torch."))
    return False


class TrainerView:
    """What `self.trainer` holds for a LightningModule run by unifit: the loop's facts, read live."""

    def __init__(self, max_epochs: int | None = None) -> None:
        self.ctx: Any = None  # unifit's FitContext, once the fit has set up
        self.seams: Any = None  # the running engine's StepSeams, while fit trains
        self.strategy = _StrategyView(self)
        self.precision_plugin = _PrecisionView(self)
        self.gradient_clip_algorithm = None
        self.epoch = 0  # Lightning's current_epoch: the running epoch, counted up when the next one starts
        self.max_epochs = max_epochs
        self.training = True
        self.sanity_checking = False
        self.num_devices = 1
        self.estimated_stepping_batches: int | None = None  # set as fit's configure_optimizers runs

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
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def current_epoch(self) -> int:
        return self.epoch

    @property
    def max_steps(self) -> int:
        """Lightning's: -1 when the fit is not limited by steps."""
        limit = self.ctx.config.max_steps if self.ctx is not None else None
        return -1 if limit is None else limit

    @property
    def global_step(self) -> int:
        return self._facts()[2]

    @property
    def should_stop(self) -> bool:
        return bool(self.ctx and self.ctx.state.should_stop)

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        if value and self.ctx is not None:
            self.ctx.state.request_stop("the LightningModule set trainer.should_stop")

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        metrics = self.ctx.state.metrics if self.ctx is not None else {}
        return {name: torch.tensor(value) for name, value in metrics.items()}

    logged_metrics = callback_metrics

    @property
    def optimizers(self) -> list[Any]:
        return list(self._seams().engine.optimizers)

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        return list(self._seams().engine.schedules)  # each has .scheduler, as Lightning's LRSchedulerConfig

    @property
    def gradient_clip_val(self) -> float | None:
        return self._seams().engine.config.gradient_clip_val

    def _seams(self) -> Any:
        if self.seams is None:
            raise ConfigError("self.trainer.optimizers: the optimizers exist only while fit() trains")
        return self.seams

    def __getattr__(self, name: str) -> Any:
        raise ConfigError(
            f"self.trainer.{name}: unifit runs this LightningModule without a Lightning Trainer; "
            f"it offers {', '.join(_TRAINER_FACTS)} (see docs/lightning.md)"
        )


class _StrategyView:
    """`self.trainer.strategy`: what Lightning's own module code calls on it (manual_backward,
    LightningOptimizer.step, self.optimizers()), routed to unifit's step seams."""

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
        return self._view._seams().step(_unwrapped(optimizer), closure)

    def __getattr__(self, name: str) -> Any:
        raise ConfigError(
            f"self.trainer.strategy.{name}: unifit runs this LightningModule without a Lightning Trainer; "
            "its strategy stand-in offers backward and optimizer_step (manual optimization)"
        )


class _PrecisionView:
    """`self.trainer.precision_plugin`: Lightning's clip_gradients ends here, in unifit's clipping of the
    true gradients (unscaled, averaged over ranks, by the global norm over every shard)."""

    def __init__(self, view: TrainerView) -> None:
        self._view = view

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        self._view._seams().clip(_unwrapped(optimizer), clip_val, gradient_clip_algorithm)


class LightningAdapter(TrainModule):
    """A LightningModule (with its LightningDataModule, if any) as a unifit TrainModule."""

    def __init__(self, lightning_module: Any, datamodule: Any = None, given: Any = None) -> None:
        super().__init__()
        name = type(lightning_module).__name__
        overridden = [hook for hook in _REFUSED_HOOKS if _overrides(lightning_module, hook)]
        if overridden:
            raise ConfigError(
                f"module: {name} overrides {', '.join(overridden)}; unifit's precision and strategy own "
                "backward (loss scaling, sharded gradients): move the code to on_before_backward / "
                "on_after_backward, which unifit calls around it"
            )
        self.lightning = lightning_module
        self.datamodule = datamodule
        self.given = given  # loaders passed to fit/validate/test/predict (trainer/adapt.py's GivenData), or None
        self.view = TrainerView()
        lightning_module.trainer = self.view  # also reaches nested LightningModules
        lightning_module.log = self._log  # instance attributes: the class and other instances stay Lightning's
        lightning_module.log_dict = self._log_dict
        self._loader_idx: int | None = None  # which of several evaluation loaders the step's batch is from
        self._scope: str | None = None  # where self.log is called from: "step", "epoch" or elsewhere (None)
        self._prepared = False
        self.stage = "fit"
        self.hooks: list[Any] = []

    # the checkpoint holds the LightningModule's own keys, as Lightning's checkpoints do
    @property
    def state_module(self) -> torch.nn.Module:
        return self.lightning

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.lightning.state_dict(*args, **kwargs)

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.lightning.load_state_dict(state, strict=strict, assign=assign)

    def setup_stage(self, stage: str) -> None:
        self.stage = stage

    def to(self, *args: Any, **kwargs: Any) -> LightningAdapter:
        self._prepare()  # the engine's first call: Lightning's set-up hooks run before the model is placed
        self.lightning.to(*args, **kwargs)
        return self

    def _prepare(self) -> None:
        """Lightning's order: prepare_data, setup(stage) (data module, then module), configure_model."""
        if self._prepared:
            return
        self._prepared = True
        for part in (self.datamodule, self.lightning):
            if part is not None:
                part.prepare_data()  # every process calls it: keep downloads idempotent (docs/lightning.md)
                part.setup(self.stage)
        self.lightning.configure_model()

    # ---- inside the optimizer step: the LightningModule's own hooks -----------------------------
    @property
    def automatic_optimization(self) -> bool:  # type: ignore[override]
        return bool(self.lightning.automatic_optimization)

    def overrides(self, hook: str) -> bool:
        """Whether the LightningModule defines `hook` itself."""
        return _overrides(self.lightning, hook)

    def step_hooks(self) -> set[str]:
        return {h for h in (*STEP_HOOKS, "lr_scheduler_step") if _overrides(self.lightning, h)}

    def bind_steps(self, seams: Any) -> None:
        super().bind_steps(seams)
        self.view.seams = seams

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self._call_step(self.lightning.on_before_zero_grad, optimizer)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        self.lightning.optimizer_zero_grad(epoch, batch_idx, optimizer)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self._call_step(self.lightning.on_before_backward, loss)

    def on_after_backward(self) -> None:
        self._call_step(self.lightning.on_after_backward)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._call_step(self.lightning.on_before_optimizer_step, optimizer)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        self.lightning.configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        lightning_optimizer = self.view.strategy._lightning_optimizers[0]  # automatic optimization: one optimizer
        self.lightning.optimizer_step(epoch, batch_idx, lightning_optimizer, optimizer_closure)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        self.lightning.lr_scheduler_step(scheduler, metric)

    # ---- steps ---------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = self._call_step(self.lightning.training_step, batch, batch_idx)
        if out is None and self.lightning.automatic_optimization:
            raise ConfigError(
                f"{type(self.lightning).__name__}.training_step returned None (a skipped batch); every "
                "rank must take every step under distributed training: return the loss"
            )
        return out

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> None:
        self._evaluation_step("test", batch, batch_idx, dataloader_idx)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> None:
        self._evaluation_step("validation", batch, batch_idx, dataloader_idx)

    def _evaluation_step(self, name: str, batch: Any, batch_idx: int, dataloader_idx: int | None) -> None:
        """Lightning's batch hooks around the step; with several loaders each gets `dataloader_idx`, and what it
        logs is named `<key>/dataloader_idx_<i>`, as Lightning names it."""
        lm, more = self.lightning, () if dataloader_idx is None else (dataloader_idx,)
        self._loader_idx = dataloader_idx
        try:
            self._call_step(getattr(lm, f"on_{name}_batch_start"), batch, batch_idx, *more)
            out = self._call_step(getattr(lm, f"{name}_step"), batch, batch_idx, *more)
            self._call_step(getattr(lm, f"on_{name}_batch_end"), out, batch, batch_idx, *more)
        finally:
            self._loader_idx = None

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        lm = self.lightning
        lm.on_predict_batch_start(batch, batch_idx)
        out = lm.predict_step(batch, batch_idx)
        lm.on_predict_batch_end(out, batch, batch_idx)
        return out

    def on_evaluation_start(self, stage: str) -> None:
        """Lightning's order: on_<stage>_start, on_<stage>_epoch_start (validate: 'validation')."""
        self.view.training = False
        name = _HOOK_STAGE[stage]
        self.call_epoch_hook(getattr(self.lightning, f"on_{name}_start"))
        self.call_epoch_hook(getattr(self.lightning, f"on_{name}_epoch_start"))

    def on_evaluation_end(self, stage: str) -> None:
        name = _HOOK_STAGE[stage]
        self.call_epoch_hook(getattr(self.lightning, f"on_{name}_epoch_end"))  # reduced after this (evaluation.py)
        getattr(self.lightning, f"on_{name}_end")()
        for part in (self.datamodule, self.lightning):
            if part is not None:
                part.teardown(stage)

    def _call_step(self, step: Any, *args: Any) -> Any:
        """A step, a batch hook or a hook inside the step: self.log's values count for this batch."""
        return self._call_in("step", step, *args)

    def call_epoch_hook(self, hook: Any, *args: Any) -> Any:
        """An epoch-level hook (on_train_epoch_end, on_validation_epoch_start...): self.log's values count
        once per rank (batch_size 1 unless given), reduced over the ranks as sync_dist does."""
        return self._call_in("epoch", hook, *args)

    def call_batch_hook(self, hook: Any, batch: Any, *args: Any) -> Any:
        """on_train_batch_start/end and the like: self.log's values count for `batch`'s samples."""
        if self._unifit_collector is not None:
            self._unifit_collector.batch_count = batch_size_of(batch)
        return self._call_in("step", hook, batch, *args)

    def _call_in(self, scope: str, fn: Any, *args: Any) -> Any:
        outer = self._scope
        self._scope = outer or scope  # hooks inside a step (manual_backward's) count with the step
        try:
            return fn(*args)
        finally:
            self._scope = outer

    def configure_optimizers(self) -> Any:
        self.view.estimated_stepping_batches = self.stepping_batches  # for OneCycleLR(total_steps=...) and the like
        return self.lightning.configure_optimizers()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.lightning(*args, **kwargs)

    # ---- data ----------------------------------------------------------------------------------
    def train_dataset(self) -> Any:
        return self._loader("train_dataloader", required=True)

    def val_dataset(self) -> Any:
        if not _overrides(self.lightning, "validation_step"):
            return None
        return self._loader("val_dataloader", required=False)

    def test_dataset(self) -> Any:
        return self._loader("test_dataloader", required=True)

    def predict_dataset(self) -> Any:
        return self._loader("predict_dataloader", required=True)

    def _loader(self, hook: str, required: bool) -> Any:
        several_ok = hook in ("val_dataloader", "test_dataloader")  # evaluated one after another
        passed = getattr(self.given, hook.removesuffix("_dataloader"), None)
        if passed is not None:
            return _one_or_several(passed, f"{hook}s", several_ok)
        owner = next((p for p in (self.datamodule, self.lightning) if p is not None and _overrides(p, hook)), None)
        if owner is None:
            if required:
                raise ConfigError(
                    f"module: {type(self.lightning).__name__} has no {hook}(); define it or pass a "
                    "LightningDataModule (data: in the YAML, Trainer.fit(module, data=...))"
                )
            return None
        return _one_or_several(getattr(owner, hook)(), f"{type(owner).__name__}.{hook}()", several_ok)

    # ---- logging -------------------------------------------------------------------------------
    def _log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Lightning's self.log, always synced over the ranks (sync_dist=True): by default an epoch mean over every
        rank weighted by `batch_size`, "sum" / "max" / "min" over every step of every rank, rank 0's value with
        rank_zero_only, or a torchmetrics Metric computed over every rank's states at the epoch's end. In an
        epoch-level hook a value counts once per rank. Values logged per step (on_step, by default in training)
        are also written per step as `<name>_step` (rank 0's); prog_bar and logger change nothing."""
        if self._scope is None:
            raise ConfigError(
                f"{type(self.lightning).__name__}: self.log({name!r}, ...) outside the hooks where Lightning allows it "
                "(the steps, the batch hooks, on_train_start, on_{train,validation,test}_epoch_{start,end}, "
                "on_{validation,test}_start and the hooks around backward and the optimizer step): move it into one"
            )
        if batch_size is None and self._scope == "epoch":
            batch_size = 1
        if add_dataloader_idx and self._loader_idx is not None:
            name = f"{name}/dataloader_idx_{self._loader_idx}"
        # per step too where Lightning logs per step: asked for, or by default in training (not in epoch hooks)
        per_step = self._scope == "step" and (on_step if on_step is not None else self.view.training)
        self.log(
            name, value, batch_size=batch_size, reduce_fx=reduce_fx, rank_zero_only=rank_zero_only, on_step=per_step
        )

    def _log_dict(self, dictionary: dict[str, Any], **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self._log(name, value, **kwargs)

    def attach_callbacks(self, callbacks: list[Any]) -> None:
        """The callback that calls the LightningModule's own hooks (callbacks/lightning_hooks.py, made
        by trainer/adapt.py, which may import callbacks): it runs as the module's configure_callbacks()."""
        self.hooks = list(callbacks)

    def configure_callbacks(self) -> list[Any]:
        own = self.lightning.configure_callbacks()
        if own:
            kinds = ", ".join(type(c).__name__ for c in (own if isinstance(own, (list, tuple)) else [own]))
            raise ConfigError(
                f"module: {type(self.lightning).__name__}.configure_callbacks() returned Lightning "
                f"callbacks ({kinds}); unifit runs unifit.Callback subclasses (trainer.callbacks)"
            )
        return list(self.hooks)


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside a LightningOptimizer or a StepOptimizer; any other optimizer as it is (an
    optimizer that wraps another one, a Lookahead say, is the one configure_optimizers returned)."""
    if isinstance(optimizer, StepOptimizer) or type(optimizer).__name__ == "LightningOptimizer":
        return optimizer.optimizer
    return optimizer


def _one_or_several(loaders: Any, what: str, several_ok: bool) -> Any:
    """One loader, or Several for validation and test (a list or dict of them, in order, as Lightning's
    sequential CombinedLoader runs them); training takes one (Lightning's "max_size_cycle" of several training
    loaders is refused)."""
    if not isinstance(loaders, (list, tuple, dict)):
        return loaders
    loaders = list(loaders.values()) if isinstance(loaders, dict) else list(loaders)
    if len(loaders) == 1:
        return loaders[0]
    if not several_ok:
        raise ConfigError(
            f"{what} returned {len(loaders)} loaders; unifit trains on one loader (and predicts one at a time): "
            "combine them into one dataset (torch.utils.data.ConcatDataset)"
        )
    return Several(loaders)
