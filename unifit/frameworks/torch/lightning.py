"""Train an unchanged `lightning.LightningModule` (and `LightningDataModule`) on every torch strategy.

`LightningAdapter` is a TrainModule that delegates to the LightningModule: its steps, optimizers,
data loaders and own hooks, each hook preceded by the same hook of the run's Lightning callbacks, as
Lightning's Trainer calls them. The module and its callbacks see a stand-in for Lightning's Trainer
(frameworks/torch/lightning_trainer.py), and `self.log` / `log_dict` write
into unifit's metrics, which are exact sample-weighted means over all ranks (so `sync_dist` is
always honoured). Manual optimization and the hooks inside the optimizer step run through unifit's
step seams (frameworks/torch/step_seams.py): `self.trainer.strategy` and `precision_plugin` are small
stand-ins that route Lightning's own `manual_backward`, `LightningOptimizer.step` and `clip_gradients`
there. What unifit cannot honour exactly is refused at set-up in one line rather than ignored
(docs/lightning.md lists what is covered and what is refused).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from unifit._imports import LIGHTNING, derives_from
from unifit.errors import ConfigError
from unifit.frameworks.torch.combined import Combined
from unifit.frameworks.torch.data import batch_size_of
from unifit.frameworks.torch.lightning_compat import combined_mode, give_device_mesh, restored_without_restarting
from unifit.frameworks.torch.lightning_trainer import TrainerView
from unifit.frameworks.torch.module import TrainModule, restore_modes, training_modes
from unifit.frameworks.torch.step_seams import STEP_HOOKS
from unifit.frameworks.torch.user_loaders import Several

# Trainer.validate/test/predict -> the word in Lightning's hook names
_HOOK_STAGE = {"validate": "validation", "test": "test", "predict": "predict"}
# the steps, whose batch_idx Lightning passes only when they take it
_STEPS = ("training_step", "validation_step", "test_step", "predict_step")
# the hooks Lightning moves a batch to the device with, in its order
_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
# the hooks inside the optimizer step a Lightning Callback may have (with the trainer and module first)
_CALLBACK_STEP_HOOKS = ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")


# Lightning callbacks that need the whole model on every rank, refused under a sharded strategy (fsdp)
_WHOLE_MODEL_CALLBACKS = {
    "WeightAveraging": "keeps a whole, unsharded copy of the model, which a sharded strategy's parameters cannot be "
    "averaged into (Lightning's WeightAveraging does not support sharding either): use ddp, or average after training",
    "ModelPruning": "re-parametrizes whole weights (weight_orig and a mask), which fsdp's sharded parameters are not: "
    "use ddp, or prune before or after training",
    "StochasticWeightAveraging": "averages whole copies of the model, which Lightning refuses for sharded models too "
    "('SWA does not currently support sharded models'): use ddp",
}


def is_lightning_module(obj: Any) -> bool:
    return derives_from(obj, "LightningModule", *LIGHTNING)


def is_lightning_datamodule(obj: Any) -> bool:
    return derives_from(obj, "LightningDataModule", *LIGHTNING)


def _overrides(obj: Any, hook: str) -> bool:
    """True when `hook` is defined below Lightning's base classes (by the user, a demo module or one of
    Lightning's own callbacks), or set on the instance (LightningDataModule.from_datasets sets its loaders so)."""
    if hook in getattr(obj, "__dict__", {}):
        return True
    for cls in type(obj).__mro__:
        if hook in vars(cls):
            return not (
                cls.__module__.startswith(("lightning.pytorch.core", "pytorch_lightning.core", "torch."))
                or (cls.__name__ == "Callback" and cls.__module__.endswith("callbacks.callback"))
            )
    return False


def is_monitoring(callback: Any) -> bool:
    """Lightning runs these (checkpoints, early stopping) after the module's on_train_epoch_end, the others before."""
    return derives_from(callback, "Checkpoint", *LIGHTNING) or derives_from(callback, "EarlyStopping", *LIGHTNING)


class LightningAdapter(TrainModule):
    """A LightningModule (with its LightningDataModule, if any) as a unifit TrainModule."""

    def __init__(self, lightning_module: Any, datamodule: Any = None, given: Any = None) -> None:
        super().__init__()
        self.lightning = lightning_module
        self.datamodule = datamodule
        self.given = given  # loaders passed to fit/validate/test/predict (trainer/adapt.py's GivenData), or None
        self.view = TrainerView(lightning_module, datamodule)
        lightning_module.trainer = self.view  # also reaches nested LightningModules
        lightning_module.log = self._log  # instance attributes: the class and other instances stay Lightning's
        lightning_module.log_dict = self._log_dict
        self._loader_idx: int | None = None  # which of several evaluation loaders the step's batch is from
        self._scope: str | None = None  # where self.log is called from: "step", "epoch" or elsewhere (None)
        self._prepared = False
        self._step_output: Any = None  # what training_step returned, until on_train_batch_end
        self.batch_indices: list[int] = []  # the dataset indices of the batch being predicted (records_batch_indices)
        self.stage = "fit"
        self.hooks: list[Any] = []
        self._listeners: dict[str, list[Any]] = {}  # hook name -> the run's Lightning callbacks that define it
        own = lightning_module.configure_callbacks()  # first, as Lightning's Trainer calls it
        self._own_callbacks: list[Any] = list(own) if isinstance(own, (list, tuple)) else [own] if own else []

    def __deepcopy__(self, memo: dict[int, Any]) -> LightningAdapter:
        """Not copied: a copy of the LightningModule (WeightAveraging's AveragedModel deep-copies it) keeps its
        self.log bound to this run, as Lightning's copies keep theirs (the strategy's process groups cannot be
        copied)."""
        return self

    def attach_strategy(self, strategy: Any) -> None:
        self.view.dist = strategy
        if not getattr(strategy, "shards_parameters", False):
            return
        for kind, reason in _WHOLE_MODEL_CALLBACKS.items():
            found = [cb for cb in self._running() if derives_from(cb, kind, *LIGHTNING)]
            if found:
                raise ConfigError(f"trainer.callbacks: Lightning's {type(found[0]).__name__} {reason}")

    def agree_on_pruning(self) -> None:
        """After a pruning callback's epoch hook, every rank takes rank 0's masks: a random pruning method would
        draw other masks on each rank (unifit seeds each rank's randomness apart), and the replicas would differ."""
        if self.view.world_size == 1 or not any(derives_from(cb, "ModelPruning", *LIGHTNING) for cb in self._running()):
            return
        masks = {name: buffer for name, buffer in self.lightning.named_buffers() if name.endswith("_mask")}
        chosen = self.view.dist.broadcast_object({name: mask.cpu() for name, mask in masks.items()})
        for name, mask in masks.items():
            mask.copy_(chosen[name])

    # ---- the run's Lightning callbacks ------------------------------------------------------------
    @property
    def own_callbacks(self) -> list[Any]:
        return self._own_callbacks

    def use_callbacks(self, running: list[Any], every: list[Any]) -> None:
        """`running`: the Lightning callbacks run as they are, each of its hooks before the module's; `every`: all
        of this run's, those mapped onto unifit's own included (what trainer.callbacks shows)."""
        self.view.callbacks = list(every)
        self._listeners = {}
        for callback in running:
            for name in dir(type(callback)):
                if (name.startswith("on_") or name in ("setup", "teardown")) and _overrides(callback, name):
                    self._listeners.setdefault(name, []).append(callback)

    def listens(self, hook: str) -> bool:
        """Whether one of the running Lightning callbacks defines `hook`."""
        return bool(self._listeners.get(hook))

    def callback_state(self) -> dict[str, Any]:
        """Each running callback's state_dict, by its state_key (Lightning's checkpoint["callbacks"])."""
        return {cb.state_key: state for cb in self._running() if (state := cb.state_dict())}

    def load_callback_state(self, states: dict[str, Any]) -> None:
        for callback in self._running():
            if callback.state_key in states:
                callback.load_state_dict(states[callback.state_key])
                if derives_from(callback, "BaseFinetuning", *LIGHTNING):
                    # unifit's checkpoint restored the optimizer's param groups already, with their current
                    # learning rates; Lightning's on_fit_start would set them again from older ones it keeps
                    restored_without_restarting(callback)

    def _running(self) -> list[Any]:
        return list(dict.fromkeys(cb for listeners in self._listeners.values() for cb in listeners))

    def fan_out(self, name: str, *args: Any) -> Any:
        """Lightning's order for one hook: the callbacks' (with the trainer and the module first), then the
        module's; for on_train_epoch_end the monitoring callbacks (checkpoints, early stopping) come after it."""
        listeners = self._listeners.get(name, ())
        late = [cb for cb in listeners if is_monitoring(cb)] if name == "on_train_epoch_end" else []
        for callback in listeners:
            if callback not in late:
                getattr(callback, name)(self.view, self.lightning, *args)
        if name in _STEPS and not self._takes_batch_idx(name):  # Lightning's GAN example: training_step(self, batch)
            args = (args[0], *args[2:])
        out = getattr(self.lightning, name)(*args)
        for callback in late:
            getattr(callback, name)(self.view, self.lightning, *args)
        return out

    def _takes_batch_idx(self, step: str) -> bool:
        """Whether the module's step takes batch_idx, which Lightning passes only then (its own rule: a parameter
        of that name, *args, or a second argument)."""
        known = self.__dict__.setdefault("_batch_idx_taken", {})
        if step not in known:
            spec = inspect.getfullargspec(getattr(self.lightning, step))
            params = spec.args[1:]  # without self
            known[step] = "batch_idx" in params or spec.varargs is not None or len(params) >= 2
        return known[step]

    def callbacks_only(self, name: str, *args: Any) -> None:
        """A hook only callbacks have (on_exception, on_save_checkpoint, ...)."""
        for callback in self._listeners.get(name, ()):
            getattr(callback, name)(self.view, self.lightning, *args)

    def use_loggers(self, loggers: list[Any]) -> None:
        """trainer.logger(s) / self.logger(s): the run's loggers (unifit.loggers), writing on rank 0."""
        self.view.loggers = list(loggers)

    # the checkpoint holds the LightningModule's own keys, as Lightning's checkpoints do
    @property
    def state_module(self) -> torch.nn.Module:
        return self.lightning

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.lightning.state_dict(*args, **kwargs)

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.lightning.load_state_dict(state, strict=strict, assign=assign)

    def evaluation_weights(self, callback_states: dict[str, Any]) -> None:
        """The weights a Lightning checkpoint evaluates with: its "state_dict", which a callback's on_save_checkpoint
        may have replaced (WeightAveraging puts the averaged weights there), as Lightning loads it."""
        replaced = callback_states.get("LightningModule", {}).get("state_dict")
        if replaced is not None:
            self.lightning.load_state_dict(replaced)

    def setup_stage(self, stage: str) -> None:
        self.stage = stage

    def to(self, *args: Any, **kwargs: Any) -> LightningAdapter:
        self._prepare()  # the engine's first call: Lightning's set-up hooks run before the model is placed
        self.lightning.to(*args, **kwargs)
        return self

    def _prepare(self) -> None:
        """Lightning's order: prepare_data (data module, module), setup(stage) (data module, callbacks, module),
        configure_model."""
        if self._prepared:
            return
        self._prepared = True
        parts = [part for part in (self.datamodule, self.lightning) if part is not None]
        for part in parts:
            part.prepare_data()  # every process calls it: keep downloads idempotent (docs/lightning.md)
        if self.datamodule is not None:
            self.datamodule.setup(self.stage)
        self.fan_out("setup", self.stage)
        mesh = getattr(self.view.dist, "device_mesh", None)
        if mesh is not None:  # Lightning's ModelParallelStrategy sets it for configure_model (self.device_mesh)
            give_device_mesh(self.lightning, mesh)
        if _overrides(self.lightning, "configure_sharded_model"):  # Lightning 1.x's name, still called by 2.x
            self.lightning.configure_sharded_model()
        self.lightning.configure_model()

    def teardown(self) -> None:
        """Lightning's order: the data module's, the callbacks', the module's."""
        if self.datamodule is not None:
            self.datamodule.teardown(self.stage)
        self.fan_out("teardown", self.stage)

    # ---- moving a batch, and the model's modes around validation --------------------------------
    def batch_transfer(self, device: torch.device) -> Any:
        """Lightning's three hooks when the module or its data module overrides any of them (on every device, CPU
        too); each is the module's, or the data module's where only that one defines it, as in Lightning."""
        owners = [self._transfer_owner(hook) for hook in _TRANSFER_HOOKS]
        if all(owner is None for owner in owners):
            return super().batch_transfer(device)
        before, move, after = (getattr(owner or self.lightning, hook) for owner, hook in zip(owners, _TRANSFER_HOOKS))

        def transfer(batch: Any, dataloader_idx: int) -> Any:
            return after(move(before(batch, dataloader_idx), device, dataloader_idx), dataloader_idx)

        return transfer

    def _transfer_owner(self, hook: str) -> Any:
        return next((p for p in (self.lightning, self.datamodule) if p is not None and _overrides(p, hook)), None)

    def on_validation_model_zero_grad(self) -> None:
        self.lightning.on_validation_model_zero_grad()

    def on_validation_model_eval(self) -> None:
        self.lightning.on_validation_model_eval()

    def on_validation_model_train(self) -> None:
        self.lightning.on_validation_model_train()

    def overrides_model_train(self) -> bool:
        return _overrides(self.lightning, "on_validation_model_train")

    # ---- inside the optimizer step: the LightningModule's own hooks -----------------------------
    @property
    def automatic_optimization(self) -> bool:  # type: ignore[override]
        return bool(self.lightning.automatic_optimization)

    @property
    def forward_only(self) -> bool:  # type: ignore[override]
        return self.view.fit_loop._skip_backward

    def overrides(self, hook: str) -> bool:
        """Whether the LightningModule defines `hook` itself."""
        return _overrides(self.lightning, hook)

    def step_hooks(self) -> set[str]:
        """The module's hooks inside the step, and those its callbacks define."""
        own = {h for h in (*STEP_HOOKS, "lr_scheduler_step") if _overrides(self.lightning, h)}
        return own | {h for h in _CALLBACK_STEP_HOOKS if self._listeners.get(h)}

    def bind_steps(self, seams: Any) -> None:
        super().bind_steps(seams)
        self.view.seams = seams

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The LightningModule's backward hook, given the (scaled) loss, as Lightning's precision plugin calls it."""
        self.lightning.backward(loss, *args, **kwargs)

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self._call_step("on_before_zero_grad", optimizer)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        self.lightning.optimizer_zero_grad(epoch, batch_idx, optimizer)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self._call_step("on_before_backward", loss)

    def on_after_backward(self) -> None:
        self._call_step("on_after_backward")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._call_step("on_before_optimizer_step", optimizer)

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
        out = self._call_step("training_step", batch, batch_idx)
        if out is None and self.lightning.automatic_optimization and self.view.world_size > 1:
            raise ConfigError(  # Lightning's own rule: every rank's backward takes part in the gradients' average
                f"{type(self.lightning).__name__}.training_step returned None (a skipped batch) on "
                f"{self.view.world_size} ranks, which Lightning allows on one process only: return a loss "
                "(e.g. loss * 0 for a batch to skip)"
            )
        self._step_output = out
        return out

    def batch_outputs(self) -> dict[str, Any]:
        """What on_train_batch_end receives as `outputs`, as Lightning makes it from training_step's return: under
        automatic optimization the loss detached and divided by accumulate_grad_batches, with the other keys;
        under manual optimization the returned dict (its loss detached)."""
        out, self._step_output = self._step_output, None
        extra = dict(out) if isinstance(out, dict) else {"loss": out} if isinstance(out, torch.Tensor) else {}
        loss = extra.get("loss")
        if isinstance(loss, torch.Tensor):
            accumulate = self.view.accumulate_grad_batches if self.lightning.automatic_optimization else 1
            extra["loss"] = (loss / accumulate if accumulate != 1 else loss).detach()
        return extra

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> None:
        self._evaluation_step("test", batch, batch_idx, dataloader_idx)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> None:
        self._evaluation_step("validation", batch, batch_idx, dataloader_idx)

    def _evaluation_step(self, name: str, batch: Any, batch_idx: int, dataloader_idx: int | None) -> None:
        """Lightning's batch hooks around the step; with several loaders each gets `dataloader_idx`, and what it
        logs is named `<key>/dataloader_idx_<i>`, as Lightning names it."""
        more = () if dataloader_idx is None else (dataloader_idx,)
        self._loader_idx = dataloader_idx
        try:
            self._call_step(f"on_{name}_batch_start", batch, batch_idx, *more)
            out = self._call_step(f"{name}_step", batch, batch_idx, *more)
            self._call_step(f"on_{name}_batch_end", out, batch, batch_idx, *more)
        finally:
            self._loader_idx = None

    @property
    def records_batch_indices(self) -> bool:
        """A prediction writer runs: the engine gives each predicted batch's dataset indices (batch_indices)."""
        return any(derives_from(cb, "BasePredictionWriter", *LIGHTNING) for cb in self._running())

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        more = () if dataloader_idx is None else (dataloader_idx,)  # with several loaders, as Lightning passes it
        self.fan_out("on_predict_batch_start", batch, batch_idx, *more)
        out = self.fan_out("predict_step", batch, batch_idx, *more)  # no callback has it: the module's step
        if self.records_batch_indices:  # what Lightning's predict loop keeps for its prediction writers
            self.view.predict_loop.record(dataloader_idx or 0, self.batch_indices, out)
        self.fan_out("on_predict_batch_end", out, batch, batch_idx, *more)
        return out

    def on_evaluation_start(self, stage: str) -> None:
        """Lightning's order: on_<stage>_start, on_<stage>_epoch_start (validate: 'validation')."""
        self.view.training, self.view.stage = False, stage
        if stage == "predict":
            self.view.predict_loop.reset()
        name = _HOOK_STAGE[stage]
        log = stage != "predict"  # Lightning allows self.log in the validation and test hooks only
        self._call_in("epoch" if log else None, self.fan_out, f"on_{name}_start")
        self._call_in("epoch" if log else None, self.fan_out, f"on_{name}_epoch_start")

    def on_evaluation_end(self, stage: str) -> None:
        name = _HOOK_STAGE[stage]
        log = stage != "predict"
        self._call_in("epoch" if log else None, self.fan_out, f"on_{name}_epoch_end")  # reduced after (evaluation.py)
        self.fan_out(f"on_{name}_end")

    def enter_evaluation(self, stage: str) -> None:
        """Lightning's on_<stage>_model_eval (by default trainer.model.eval()), each submodule's mode kept first."""
        self.__dict__["_modes_before"] = training_modes(self)
        getattr(self.lightning, f"on_{_HOOK_STAGE[stage]}_model_eval")()

    def exit_evaluation(self, stage: str) -> None:
        """Lightning's on_<stage>_model_train when the module overrides it, else each submodule's mode back; then
        teardown(stage) of the data module, the callbacks and the module."""
        hook = f"on_{_HOOK_STAGE[stage]}_model_train"
        if stage != "predict" and _overrides(self.lightning, hook):
            getattr(self.lightning, hook)()
        else:
            restore_modes(self.__dict__.pop("_modes_before", []))
        self.teardown()

    def _call_step(self, name: str, *args: Any) -> Any:
        """A step, a batch hook or a hook inside the step: self.log's values count for this batch."""
        return self._call_in("step", self.fan_out, name, *args)

    def call_epoch_hook(self, name: str, *args: Any) -> Any:
        """An epoch-level hook (on_train_epoch_end, on_validation_epoch_start...): self.log's values count
        once per rank (batch_size 1 unless given), reduced over the ranks as sync_dist does."""
        return self._call_in("epoch", self.fan_out, name, *args)

    def call_batch_hook(self, name: str, *args: Any, batch: Any) -> Any:
        """on_train_batch_start/end and the like: self.log's values count for `batch`'s samples."""
        if self._unifit_collector is not None:
            self._unifit_collector.batch_count = batch_size_of(batch)
        return self._call_in("step", self.fan_out, name, *args)

    def _call_in(self, scope: str | None, fn: Any, *args: Any) -> Any:
        outer = self._scope
        self._scope = outer or scope  # hooks inside a step (manual_backward's) count with the step
        try:
            return fn(*args)
        finally:
            self._scope = outer

    @property
    def fit_config(self) -> Any:
        return self.view.config

    @fit_config.setter
    def fit_config(self, config: Any) -> None:
        """self.trainer's max_epochs, precision, ... in setup() and configure_optimizers(), as Lightning has them."""
        self.view.config = config
        if self.view.ctx is None and config is not None:
            self.view.max_epochs = config.max_epochs

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
        several_ok = hook != "train_dataloader"  # evaluated (or predicted) one after another
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
        """unifit's callbacks that call this module's hooks (its own Lightning callbacks are own_callbacks)."""
        return list(self.hooks)


def _one_or_several(loaders: Any, what: str, several_ok: bool) -> Any:
    """One loader; Several for validation and test (a list or dict of them, in order, as Lightning's sequential
    CombinedLoader runs them); for training a Combined (Lightning's "max_size_cycle" for a list or dict, or the
    mode of the CombinedLoader the module returned)."""
    mode = None
    if derives_from(loaders, "CombinedLoader", *LIGHTNING):
        mode, loaders = combined_mode(loaders), loaders.iterables
    if not isinstance(loaders, (list, tuple, dict)):
        return loaders
    keys = list(loaders) if isinstance(loaders, dict) else None
    items = list(loaders.values()) if isinstance(loaders, dict) else list(loaders)
    if several_ok:
        if mode in (None, "sequential"):  # one after another, each step told its dataloader_idx
            return items[0] if len(items) == 1 else Several(items)
        if "predict" in what:
            raise ConfigError(
                f"{what} returned CombinedLoader(mode={mode!r}); predict runs mode='sequential' only, as "
                "Lightning's trainer.predict() does: return the list of loaders"
            )
        return Combined(items, keys, mode, what)  # validation / test batches combined, as Lightning's loop gives them
    return Combined(items, keys, mode or "max_size_cycle", what)
