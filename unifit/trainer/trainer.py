"""The Trainer: one fit loop for every framework and strategy (see events.py for its pseudocode).

It asks the strategy registry for the distribution axis and the module for its engine (the
framework axis); it never asks which strategy or framework it is running.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from unifit._imports import LIGHTNING, derives_from
from unifit.callbacks import default_callbacks, is_foreign_callback, plan_callbacks
from unifit.callbacks.checkpoint import ModelCheckpoint
from unifit.checkpoint.checkpointer import Checkpointer
from unifit.checkpoint.store import CheckpointStore
from unifit.config.init_args import build
from unifit.config.lightning_cli import check_processes, from_lightning_keywords
from unifit.config.loading import resolved_yaml, validate_trainer, with_updates
from unifit.config.schema import ExperimentConfig, TrainerConfig
from unifit.errors import ConfigError, UnifitError
from unifit.loggers import build_loggers
from unifit.loggers.foreign import LightningLoggerAdapter
from unifit.loop.callback import Callback
from unifit.loop.context import FitContext
from unifit.loop.dispatcher import Dispatcher
from unifit.loop.events import Event
from unifit.loop.state import Progress, TrainState
from unifit.storage import check_writable
from unifit.strategies import environment, registry
from unifit.strategies.launchers.base import LAUNCH_STRATEGY_ENV
from unifit.trainer.adapt import STAGE_SLOT, passed_data, prepare, set_up
from unifit.trainer.evaluation import evaluate

log = logging.getLogger("unifit")


@dataclass
class _Run:
    """What one fit() holds while it runs (save_checkpoint and the error path need it)."""

    checkpoints: Checkpointer
    ctx: FitContext


class Trainer:
    """`Trainer(strategy="ddp", max_epochs=10, batch_size=32).fit(module)`.

    Keyword arguments are the fields of TrainerConfig (see docs/config.md); `callbacks` may
    also hold Callback instances, Lightning callbacks (docs/lightning.md#callbacks) and Keras callbacks
    (docs/keras.md#keras-callbacks-and-modelfits-arguments); `loggers` unifit.loggers.Logger instances and
    Lightning loggers (docs/loggers.md). Lightning's Trainer arguments (`devices=`, `logger=`, `default_root_dir=`...)
    are taken as a LightningCLI file's, and after fit `trainer.logger`, `callback_metrics`, `checkpoint_callback`...
    hold what Lightning's would (docs/lightning.md#a-script-written-for-lightnings-trainer).
    """

    def __init__(self, config: TrainerConfig | None = None, **kwargs: Any) -> None:
        # Lightning's Trainer arguments (devices=, logger=, default_root_dir=...), mapped as a LightningCLI file's
        kwargs, lightning_loggers, processes = from_lightning_keywords(
            kwargs, bool(os.environ.get(LAUNCH_STRATEGY_ENV))
        )
        if processes is not None:  # the processes this script runs in, as Lightning's devices= and num_nodes= ask
            env = environment.detect()
            where = "Trainer(devices=..., num_nodes=...)"
            check_processes(processes, env.local_world_size, env.world_size, where, "-- SCRIPT")
        given = list(kwargs.get("callbacks", []))
        for i, c in enumerate(given):
            if not isinstance(c, (Callback, dict, str)) and not is_foreign_callback(c):
                raise ConfigError(_foreign_callback(i, c))
        objects = [c for c in given if not isinstance(c, (dict, str))]
        if objects:
            kwargs["callbacks"] = [c for c in given if isinstance(c, (dict, str))]
        named = kwargs.get("loggers")  # logger objects (unifit's or Lightning's) beside names and options
        self.logger_objects: list[Any] = [lg for lg in named or [] if not isinstance(lg, (dict, str))]
        self.logger_objects += lightning_loggers
        if self.logger_objects:
            kwargs["loggers"] = [lg for lg in named if isinstance(lg, (dict, str))]
        if config is not None and kwargs:
            raise ConfigError("Trainer(config, **kwargs): pass either a TrainerConfig or keyword arguments, not both")
        self.config = _launched_strategy(config if config is not None else validate_trainer(kwargs))
        registry.entry(self.config.strategy)  # a registered name, or a Strategy class path importable now
        cfg = self.config  # what the framework must know before its first operation (TensorFlow's devices)
        registry.claim_process(
            cfg.strategy,
            environment.detect(),
            accelerator=cfg.accelerator,
            collective_timeout_s=cfg.collective_timeout_s,
            options=cfg.strategy_options,
        )
        # built once TensorFlow has been claimed: a callback's __init__ may touch TensorFlow (a Keras callback)
        built = [build(c.class_path, c.init_args, f"trainer.callbacks.{i}") for i, c in enumerate(cfg.callbacks)]
        for cb in built:
            if not isinstance(cb, Callback) and not is_foreign_callback(cb):
                raise ConfigError(
                    f"trainer.callbacks: {type(cb).__name__} is not a callback: give a unifit.Callback subclass, a "
                    "Lightning or a Keras callback"
                )
        every = built + objects
        self.extra_callbacks: list[Callback] = [c for c in every if isinstance(c, Callback)]
        self.foreign_callbacks: list[Any] = [c for c in every if not isinstance(c, Callback)]  # Lightning's, Keras'
        plan_callbacks(cfg, self.foreign_callbacks, [])  # a refusal or conflict is known now
        self.experiment: ExperimentConfig | None = None  # set by the command line, saved with the run
        self.state = TrainState()
        self._run: _Run | None = None
        self._loggers: list[Any] = []  # the last fit's, which validate/test after it log to
        self._last_fit: _FitFacts | None = None  # what Lightning's views after fit read (checkpoint_callback...)

    # ---- rank facts, Lightning's names: a script's code after fit runs on every launched rank ----------
    @property
    def global_rank(self) -> int:
        """This process's rank in the job (0 in one process)."""
        return environment.detect().rank

    @property
    def world_size(self) -> int:
        return environment.detect().world_size

    @property
    def is_global_zero(self) -> bool:
        """Whether this is the job's rank 0: `if trainer.is_global_zero: model.save(...)` saves once."""
        return self.global_rank == 0

    # ---- Lightning's views after fit: what a script written for Lightning's Trainer reads ------------------
    @property
    def loggers(self) -> list[Any]:
        """The run's loggers (a Lightning logger given is itself): the last fit's, else the ones it will make."""
        made = self._loggers or build_loggers(self.config, self.logger_objects)
        return [lg.logger if isinstance(lg, LightningLoggerAdapter) else lg for lg in made]

    @property
    def logger(self) -> Any:
        """The first logger (`pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")` with a CSV logger)."""
        every = self.loggers
        return every[0] if every else None

    @property
    def log_dir(self) -> str:
        """The first logger's directory, else trainer.root_dir (as Lightning's default_root_dir)."""
        return getattr(self.logger, "log_dir", None) or self.config.root_dir

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (Lightning's global_step)."""
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        """Epochs finished (Lightning's current_epoch after fit: max_epochs when all ran)."""
        return self.state.epoch

    @property
    def callback_metrics(self) -> dict[str, Any]:
        """The last reduced metrics (the module's framework's values: tensors for a PyTorch module, as Lightning's)."""
        convert = self._last_fit.metric_values if self._last_fit is not None else dict
        return convert(self.state.metrics)

    @property
    def checkpoint_callback(self) -> Any:
        """The Lightning ModelCheckpoint given (kept up to date by the fit), else unifit's checkpoint as one:
        `.best_model_path`, `.best_model_score`, `.last_model_path`; None with checkpoints off."""
        given = [cb for cb in self.foreign_callbacks if derives_from(cb, "ModelCheckpoint", *LIGHTNING)]
        if given:
            return given[0]
        if not self.config.checkpoint.enabled:
            return None
        return self._last_fit.checkpoint if self._last_fit is not None else CheckpointView(None, None)

    # ---- public API ---------------------------------------------------------------------------
    def fit(
        self,
        module: Any,
        data: Any = None,
        ckpt_path: str | None = None,
        datamodule: Any = None,
        *,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        class_weight: dict[int, float] | None = None,
        steps_per_epoch: int | None = None,
        validation_freq: int | None = None,
        initial_epoch: int = 0,
        validation_steps: int | None = None,
    ) -> Any:
        """Train `module` (data from `data` or the module itself); resume from `ckpt_path`
        ('last', 'best', a checkpoint name or directory). Returns the final TrainState (for a Keras
        model, a keras.callbacks.History, as model.fit returns).

        Lightning's ways of passing data work too: `fit(model, train_loader, val_loader)`,
        `train_dataloaders=` / `val_dataloaders=`, `datamodule=`; and model.fit's `class_weight`,
        `steps_per_epoch` (trainer.limit_train_batches), `validation_steps` (limit_val_batches),
        `validation_freq` (validate_every_n_epochs) and
        `initial_epoch` (the epoch a fresh run starts counting from)."""
        data, ckpt_path = passed_data("fit", data, ckpt_path, datamodule, train=train_dataloaders, val=val_dataloaders)
        config = _with_fit_arguments(
            self.config, class_weight, steps_per_epoch, validation_freq, initial_epoch, validation_steps
        )
        prepared = prepare(config, module, data, self.foreign_callbacks)
        cfg = prepared.plan.config  # with what the Lightning callbacks given map onto (checkpoint, early stopping...)
        given, (module, strategy, engine) = module, set_up(cfg, prepared.module, prepared.data)
        self.state = TrainState()
        dispatch: Dispatcher | None = None
        try:
            strategy.setup()
            loggers = self._loggers = build_loggers(cfg, self.logger_objects)  # every rank's; rank 0 starts them
            # a bad bucket or an unreachable tracking server stops every rank now, before anything trains
            strategy.rank_zero_call(lambda: _check_destinations(cfg, loggers))
            engine.seed(cfg.seed)  # identical on every rank; the model is broadcast from rank 0 anyway
            engine.setup()
            cfg = engine.config  # this fit's: it may take its batch size from the user's own DataLoader
            self.state.progress = _progress_of(engine, cfg.accumulation_at(0))
            module.use_loggers(loggers)  # self.logger / self.loggers (writing on rank 0 once the fit starts)
            callbacks = self._callbacks(module, cfg, prepared, loggers)
            ctx = FitContext(
                config=cfg,
                state=self.state,
                module=module,
                rank=strategy.rank,
                world_size=strategy.world_size,
                finite_probe=engine.finite_probe,
                current_lrs=engine.current_lrs,
                all_reduce_max=strategy.all_reduce_max,
                save_checkpoint=self.save_checkpoint,
                wait_for_checkpoints=self._wait_for_checkpoints,
                model_files=engine.model_files,
                resolved_config=self._resolved_config(given, cfg),
                threads=engine.threads,
                reduce_logged=lambda: engine.collector.reduce(strategy),
                step_metrics=module.step_metrics,
            )
            run = self._run = _Run(Checkpointer(engine, strategy, cfg, callbacks), ctx)
            if ckpt_path or cfg.resume:
                self._resume(run, ckpt_path or cfg.resume)
                if engine.config is not cfg:  # the checkpoint's batch size (the batch size finder's) goes on
                    cfg = ctx.config = engine.config
                    ctx.resolved_config = self._resolved_config(given, cfg)
            if ctx.resumed_from is None:
                engine.seed(cfg.seed + strategy.data_parallel_rank)  # per-replica randomness (dropout, augmentation)
                self.state.progress.epoch = initial_epoch
            if cfg.batch_size_find is not None:
                cfg = self._find_batch_size(engine, ctx, given, prepared.plan.reports.get("batch_size_find"))
            if cfg.lr_find is not None:
                self._find_lr(engine, cfg, prepared.plan.reports.get("lr_find"), resumed=ctx.resumed_from is not None)
            self._last_fit = _FitFacts(getattr(module, "metric_values", dict), ctx, callbacks)
            dispatch = Dispatcher([cb for cb in callbacks if strategy.is_global_zero or not cb.rank_zero_only], ctx)
            dispatch(Event.SETUP)
            dispatch(Event.FIT_START)
            self._loop(engine, strategy, dispatch, ctx)
            run.checkpoints.wait()  # the last checkpoint is committed before fit ends
            dispatch(Event.FIT_END)
            result = engine.fit_result(self.state)
        except BaseException as error:
            try:
                if dispatch is not None:  # may save a checkpoint (checkpoint.save_on_exception)
                    dispatch(Event.EXCEPTION, error)
            finally:
                if self._run is not None:
                    self._run.checkpoints.finish_after(error)
            raise
        finally:
            try:
                if dispatch is not None:
                    dispatch(Event.TEARDOWN)
            finally:
                self._run = None
                engine.close()
                strategy.teardown()
        return result

    def _find_batch_size(self, engine: Any, ctx: FitContext, given: Any, report: Any) -> TrainerConfig:
        """The batch size finder of a fresh fit (a resumed one goes on at the size its checkpoint was trained at);
        the fit's sizes follow the size found."""
        if ctx.resumed_from is not None:
            log.info(
                "batch size finder: skipped, the fit resumes from a checkpoint at batch size %d",
                engine.config.batch_size,
            )
        else:
            found = engine.find_batch_size(ctx.config.batch_size_find)
            ctx.state.progress.take_sizes(
                engine.global_batch, engine.batches_per_epoch, engine.config.accumulation_at(0)
            )
            if report is not None:  # Lightning's BatchSizeFinder object is told, as Lightning's would be
                report(found)
            ctx.config = engine.config
            ctx.resolved_config = self._resolved_config(given, ctx.config)
        return ctx.config

    @staticmethod
    def _find_lr(engine: Any, cfg: TrainerConfig, report: Any, resumed: bool) -> None:
        """The lr range test of a fresh fit (a resumed one trains on with the lr it has, as it was tuned)."""
        if resumed:
            log.info("lr_find: skipped, the fit resumes from a checkpoint with its lr")
            return
        found = engine.find_lr(cfg.lr_find)
        if report is not None:  # Lightning's LearningRateFinder object is told, as Lightning's would be
            report(lrs=found.lrs, losses=found.losses)

    def validate(
        self,
        module: Any,
        data: Any = None,
        ckpt_path: str | None = None,
        datamodule: Any = None,
        *,
        dataloaders: Any = None,
    ) -> dict[str, float]:
        """One pass over the validation data on every rank (each a disjoint shard), with the weights of
        `ckpt_path` if given: what validation_step logs, exact over all ranks. `data` (or Lightning's
        `dataloaders=` / `datamodule=`): a DataLoader, a data module or provider; by default the module's."""
        return self._evaluate("validate", module, data, ckpt_path, datamodule, dataloaders).metrics

    def test(
        self,
        module: Any,
        data: Any = None,
        ckpt_path: str | None = None,
        datamodule: Any = None,
        *,
        dataloaders: Any = None,
    ) -> dict[str, float]:
        """As validate, over test_dataset() with test_step."""
        return self._evaluate("test", module, data, ckpt_path, datamodule, dataloaders).metrics

    def predict(
        self,
        module: Any,
        data: Any = None,
        ckpt_path: str | None = None,
        datamodule: Any = None,
        *,
        dataloaders: Any = None,
        return_predictions: bool | None = None,
    ) -> Any:
        """predict_step over predict_dataset(), sharded over the ranks; on rank 0 every sample's
        output once, in dataset order (None on the other ranks). `return_predictions=False` (as Lightning's,
        with a prediction writer that saves each rank's own): nothing is gathered, None is returned."""
        keep = return_predictions is not False
        return self._evaluate("predict", module, data, ckpt_path, datamodule, dataloaders, keep).predictions

    def _evaluate(
        self,
        stage: str,
        module: Any,
        data: Any,
        ckpt_path: Any,
        datamodule: Any,
        dataloaders: Any,
        keep_predictions: bool = True,
    ) -> Any:
        data, ckpt_path = passed_data(stage, data, ckpt_path, datamodule, **{STAGE_SLOT[stage]: dataloaders})
        # after a fit, its loggers (test metrics in the fit's tracked run, as Lightning's trainer.test does)
        loggers = (self._loggers or build_loggers(self.config, self.logger_objects)) if stage != "predict" else []
        resolved = self._resolved_config(module, self.config)
        return evaluate(
            self.config,
            stage,
            module,
            data,
            ckpt_path,
            callbacks=self.foreign_callbacks,
            keep_predictions=keep_predictions,
            loggers=loggers,
            resolved_config=resolved,
            step=self.state.global_step,
        )

    def save_checkpoint(
        self, name: str | None = None, after_commit: Callable[[CheckpointStore, str], None] | None = None
    ) -> str | None:
        """Save a checkpoint now. Every rank must call it (rank 0 writes; a call on one rank
        only fails after trainer.collective_timeout_s instead of hanging). The state is captured
        at once; on a remote store it is committed in the background, then `after_commit(store,
        name)` runs (on rank 0). Returns the checkpoint's path on rank 0."""
        run = self._run
        if run is None:
            raise UnifitError("save_checkpoint() works only while fit() runs (e.g. from a callback)")
        path = run.ctx.last_checkpoint = run.checkpoints.save(self.state, name, after_commit)
        return path if run.ctx.is_global_zero else None

    def _wait_for_checkpoints(self) -> None:
        if self._run is not None:
            self._run.checkpoints.wait()

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self, engine: Any, strategy: Any, dispatch: Dispatcher, ctx: FitContext) -> None:
        cfg, state, progress = ctx.config, ctx.state, ctx.state.progress  # this fit's (max_steps: its epochs)
        check_every = _val_check_batches(cfg, progress.batches_per_epoch, engine.validates_mid_accumulation)
        for epoch in itertools.count(progress.epoch):
            if epoch >= ctx.config.max_epochs:  # read each epoch: a callback may add one (SWA's BatchNorm epoch)
                break
            if cfg.max_steps is not None and progress.optimizer_step >= cfg.max_steps:
                break  # resumed from a checkpoint taken at max_steps
            skip = progress.batch_in_epoch  # > 0 only in the first epoch of a resume from a mid-epoch checkpoint
            dispatch(Event.TRAIN_EPOCH_START)
            if engine.forks_loader_workers_each_epoch and self._run is not None:
                self._run.checkpoints.wait()  # no commit thread mid-write while the loader forks its workers
            batch_start, batch_end = (
                dispatch.handlers(Event.TRAIN_BATCH_START),
                dispatch.handlers(Event.TRAIN_BATCH_END),
            )
            started = time.perf_counter()
            validates = engine.has_validation and (epoch + 1) % cfg.validate_every_n_epochs == 0
            batch_idx = skip - 1
            for batch in engine.train_batches(epoch, skip):
                # a call of several batches (Keras' steps_per_execution): hooks get its first and last index
                first, batch_idx = batch_idx + 1, batch_idx + engine.batches_in_step
                for hook in batch_start:
                    hook(ctx, batch, first)
                if state.end_epoch:  # Lightning's on_train_batch_start returning -1: the rest of the epoch skipped
                    state.end_epoch = False
                    break
                ctx.steps_before_call, ctx.batches_before_call = progress.optimizer_step, first
                loss = engine.train_step(batch, batch_idx)
                progress.batch_in_epoch = batch_idx + 1
                progress.optimizer_step = engine.optimizer_steps
                for hook in batch_end:
                    hook(ctx, loss, batch_idx)
                if cfg.max_steps is not None and progress.optimizer_step >= cfg.max_steps:  # an early epoch end
                    state.request_stop(f"max_steps={cfg.max_steps} reached")
                if state.should_stop:
                    break
                if validates and check_every and ctx.passed_batch(check_every):
                    if batch_idx + 1 < progress.batches_per_epoch:  # the epoch's end validates anyway
                        validating = time.perf_counter()
                        self._validate(engine, strategy, dispatch, ctx)
                        started += time.perf_counter() - validating  # not counted in the training throughput
            engine.end_of_epoch()
            metrics = engine.collector.reduce(strategy)
            # the slowest rank's time, so every rank holds identical metrics
            elapsed = float(strategy.all_reduce_max(np.array([time.perf_counter() - started]))[0])
            samples = engine.collector.last_samples
            progress.samples_seen += int(samples)
            metrics["throughput/samples_per_s"] = samples / elapsed if elapsed > 0 else 0.0
            metrics.update(_lr_metrics(engine))
            state.metrics = metrics
            dispatch(Event.TRAIN_EPOCH_END)
            last = epoch + 1 == ctx.config.max_epochs or state.should_stop
            validate = validates or (engine.has_validation and last)
            if validate:
                self._validate(engine, strategy, dispatch, ctx)
            engine.epoch_metrics(state.metrics, validate)
            state.metrics.update(_lr_metrics(engine))  # a metric-driven schedule may have changed them
            progress.epoch = epoch + 1
            progress.batch_in_epoch = 0
            dispatch(Event.EPOCH_END)
            if state.should_stop:
                log.info("stopping after epoch %d: %s", progress.epoch, state.stop_reason)
                break

    def _validate(self, engine: Any, strategy: Any, dispatch: Dispatcher, ctx: FitContext) -> None:
        """One pass over the validation data, its metrics (reduced over the ranks) into the state's."""
        with engine.validating():  # eval mode; inside an epoch, the training metrics keep accumulating in theirs
            dispatch(Event.VALIDATION_START)
            for batch_idx, batch in enumerate(engine.val_batches()):
                engine.validation_step(batch, batch_idx)
            ctx.state.metrics.update(engine.collector.reduce(strategy))
            dispatch(Event.VALIDATION_END)  # what the module logs at its epoch end is reduced there too

    # ---- helpers -------------------------------------------------------------------------------
    def _callbacks(self, module: Any, cfg: TrainerConfig, prepared: Any, loggers: list[Any]) -> list[Callback]:
        every = [
            *default_callbacks(cfg, prepared.plan.reports, loggers),
            *self.extra_callbacks,
            *prepared.callbacks,
            *module.configure_callbacks(),
        ]
        first, last = [cb for cb in every if cb.runs_first], [cb for cb in every if cb.runs_last]
        return first + [cb for cb in every if not (cb.runs_first or cb.runs_last)] + last

    def _resume(self, run: _Run, spec: str) -> None:
        """Every rank continues from the checkpoint `spec` names (see Checkpointer.read for which)."""
        resumed = run.checkpoints.resume(spec, run.ctx.state.progress)
        if resumed is not None:
            self.state = run.ctx.state = resumed.state
            run.ctx.last_checkpoint = resumed.path
            run.ctx.resumed_from = resumed.path.rstrip("/").rsplit("/", 1)[-1]

    def _resolved_config(self, module: Any, cfg: TrainerConfig) -> str:
        """The experiment as this fit runs it (`cfg`: with an adopted batch size, say)."""
        if self.experiment is not None:
            return resolved_yaml(self.experiment.model_copy(update={"trainer": cfg}))
        cls = type(module)
        return resolved_yaml(
            ExperimentConfig(module={"class_path": f"{cls.__module__}.{cls.__qualname__}"}, trainer=cfg)
        )


class CheckpointView:
    """unifit's checkpoint callback as Lightning's ModelCheckpoint reads after fit: with a monitor, the best
    checkpoint's path and score; without one, the last checkpoint (as Lightning's default ModelCheckpoint)."""

    def __init__(
        self, saver: ModelCheckpoint | None, ctx: FitContext | None, metric_values: Callable[..., Any] = dict
    ) -> None:
        self._saver, self._ctx, self._values = saver, ctx, metric_values

    @property
    def monitor(self) -> str | None:
        return self._saver.config.monitor if self._saver is not None else None

    @property
    def last_model_path(self) -> str:
        return (self._ctx.last_checkpoint if self._ctx is not None else None) or ""

    @property
    def best_model_path(self) -> str:
        name = self._saver.best_name if self._saver is not None else None
        if name is None or not self.last_model_path:
            return self.last_model_path
        return f"{self.last_model_path.rsplit('/', 1)[0]}/{name}"

    @property
    def best_model_score(self) -> Any:
        value = self._saver.best_value if self._saver is not None else None
        return None if value is None else self._values({"score": value})["score"]


@dataclass
class _FitFacts:
    """What the views after fit read of the last fit."""

    metric_values: Callable[[dict[str, float]], dict[str, Any]]
    ctx: FitContext
    callbacks: list[Callback]

    @property
    def checkpoint(self) -> CheckpointView:
        saver = next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)
        return CheckpointView(saver, self.ctx, self.metric_values)


def _with_fit_arguments(
    config: TrainerConfig,
    class_weight: Any,
    steps_per_epoch: Any,
    validation_freq: Any,
    initial_epoch: Any,
    validation_steps: Any = None,
) -> TrainerConfig:
    """model.fit's arguments as the trainer options they are; one given both ways must agree."""
    given = {
        "class_weight": class_weight,
        "limit_train_batches": steps_per_epoch,
        "validate_every_n_epochs": validation_freq,
        "limit_val_batches": validation_steps,
    }
    names = {
        "limit_train_batches": "steps_per_epoch",
        "validate_every_n_epochs": "validation_freq",
        "limit_val_batches": "validation_steps",
    }
    updates = {}
    for field, value in given.items():
        if value is None:
            continue
        if field in config.model_fields_set and getattr(config, field) != value:
            raise ConfigError(
                f"fit({names.get(field, field)}={value!r}): trainer.{field} is {getattr(config, field)!r}; give one"
            )
        updates[field] = value
    if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, int) or not 0 <= initial_epoch:
        raise ConfigError(f"fit(initial_epoch={initial_epoch!r}): give the epoch to start counting from (0 or more)")
    if initial_epoch >= config.max_epochs:
        raise ConfigError(
            f"fit(initial_epoch={initial_epoch}): max_epochs is {config.max_epochs}, so no epoch would train; "
            "raise max_epochs (the epoch count training ends at, as model.fit's epochs)"
        )
    if not updates:
        return config
    try:
        return with_updates(config, updates)
    except ConfigError as exc:
        arguments = ", ".join(f"{names.get(k, k)}={v!r}" for k, v in updates.items())
        raise ConfigError(f"fit({arguments}): {exc}") from None


def _check_destinations(cfg: TrainerConfig, loggers: list[Any]) -> None:
    """Every place the run writes is writable and every tracking server answers (rank 0 checks; a bad bucket,
    credentials or an unreachable server stop every rank before any trains)."""
    locations = {"trainer.root_dir": cfg.root_dir}
    if cfg.checkpoint.enabled:
        locations["trainer.checkpoint.dir"] = cfg.checkpoint_dir
    if cfg.tensorboard.enabled and cfg.tensorboard_dir:
        locations["trainer.tensorboard.log_dir"] = cfg.tensorboard_dir
    if cfg.tensorboard.enabled and cfg.tensorboard_sync_to:
        locations["trainer.tensorboard.sync_to"] = cfg.tensorboard_sync_to
    for where, url in locations.items():
        check_writable(url, cfg.storage_options, where)
    for logger in loggers:
        logger.check()


def _foreign_callback(i: int, callback: Any) -> str:
    kind = f"{type(callback).__module__}.{type(callback).__qualname__}"
    return (
        f"trainer.callbacks[{i}]: received a {kind}, which is not a callback: give a unifit.Callback subclass "
        "(one method per event), a Lightning callback or a Keras callback"
    )


def _launched_strategy(config: TrainerConfig) -> TrainerConfig:
    """In a script started by `unifit launch --strategy NAME -- SCRIPT.py`: that strategy, unless the
    script names one itself, which must then be the same."""
    launched = os.environ.get(LAUNCH_STRATEGY_ENV)
    if not launched or config.strategy == launched:
        return config
    if "strategy" in config.model_fields_set:
        raise ConfigError(
            f"trainer.strategy: the script asks for '{config.strategy}', but it was started by "
            f"`unifit launch --strategy {launched}`; leave strategy out of the script's Trainer (the "
            f"launch decides) or launch it with --strategy {config.strategy}"
        )
    return config.model_copy(update={"strategy": launched})


def _progress_of(engine: Any, accumulate: int) -> Progress:
    """A fresh Progress with this run's sizes (the position starts at zero or comes from a checkpoint)."""
    return Progress().take_sizes(engine.global_batch, engine.batches_per_epoch, accumulate)


def _val_check_batches(cfg: TrainerConfig, batches_per_epoch: int, mid_accumulation: bool) -> int | None:
    """Training batches between two validations inside an epoch (trainer.val_check_interval), or None. Inside an
    accumulation window (as Lightning validates) only where the engine keeps the gradients being accumulated."""
    interval = cfg.val_check_interval
    if interval is None:
        return None
    every = interval if isinstance(interval, int) else max(1, int(batches_per_epoch * interval))
    inside = [n for n in sorted(cfg.accumulations()) if every % n]
    if inside and not mid_accumulation:
        multiple = math.lcm(*cfg.accumulations())
        raise ConfigError(
            f"trainer.val_check_interval: {interval} gives a validation every {every} batches, inside a window of "
            f"accumulate_grad_batches={inside[-1]}, where this strategy's gradients being "
            f"accumulated would not survive a validation; give a multiple of {multiple} batches"
        )
    return every


def _lr_metrics(engine: Any) -> dict[str, float]:
    """The learning rates the next optimizer step uses, one per param group."""
    return {"lr" if i == 0 else f"lr/group{i}": lr for i, lr in enumerate(engine.current_lrs())}
