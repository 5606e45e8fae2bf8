"""What every module, PyTorch or Keras, shares: logging and the data it provides."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from unifit.errors import ConfigError
from unifit.frameworks.metrics import REDUCTIONS


class HParams(dict):
    """A dict whose keys read as attributes (`hparams.lr`), like Lightning's AttributeDict."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"hparams has no '{name}' (it has {sorted(self)})") from None


class ModuleBase:
    """Framework-neutral part of TrainModule / KerasModule.

    `framework` names the framework axis; `engine` is the dotted path of the engine that runs
    modules of this kind, so the Trainer never asks which framework a module uses.
    """

    framework: ClassVar[str]
    engine: ClassVar[str]

    _unifit_collector: Any = None
    _step_values: dict[str, Any] | None = None  # logged with on_step=True since the loggers last read them
    # optimizer steps the fit will take (steps per epoch x max_epochs), set before configure_optimizers
    # runs, for schedules that need the total (OneCycleLR); None outside fit
    stepping_batches: int | None = None
    # this fit's TrainerConfig, set before the module's setup and configure_optimizers run (a LightningModule's
    # self.trainer answers max_epochs, precision... from it there, before the loop starts); None outside fit
    fit_config: Any = None

    def save_hyperparameters(self, *names: str) -> None:
        """Keep the calling __init__'s arguments (all, or the ones named) in `self.hparams`, as
        Lightning's save_hyperparameters() does: `self.hparams.lr`, `self.hparams["lr"]`."""
        frame = inspect.currentframe().f_back  # the __init__ that called this
        info = inspect.getargvalues(frame)
        values = {name: info.locals[name] for name in info.args if name != "self"}
        if info.keywords:
            values.update(info.locals[info.keywords])
        unknown = [name for name in names if name not in values]
        if unknown:
            raise ConfigError(
                f"{type(self).__name__}.save_hyperparameters({', '.join(map(repr, names))}): "
                f"{unknown} are not arguments of its __init__ (it has {sorted(values)})"
            )
        self.__dict__["hparams"] = HParams({k: v for k, v in values.items() if not names or k in names})

    @property
    def hparams(self) -> HParams:
        return self.__dict__.setdefault("hparams", HParams())

    def collect_into(self, collector: Any) -> None:
        """Where `log` records from now on (the running engine's MetricCollector); None: nowhere."""
        self._unifit_collector = collector

    def log(
        self,
        name: str,
        value: Any,
        *,
        batch_size: int | None = None,
        reduce_fx: str = "mean",
        rank_zero_only: bool = False,
        on_step: bool = False,
    ) -> None:
        """Record a metric, reduced over the epoch and all ranks: by default a mean weighted by samples
        (`batch_size`, by default the size of the current batch); `reduce_fx` "sum", "max" or "min"
        over every step of every rank instead; `rank_zero_only`: rank 0's value alone (logged there).
        `on_step`: also written per step, as `<name>_step` (rank 0's value, every log_every_n_steps).
        """
        collector = self._unifit_collector
        if collector is not None:
            fx = _reduction(name, reduce_fx)
            value = self._detach(value)
            collector.add(name, value, batch_size or collector.batch_count, fx, rank_zero_only)
            if on_step:
                self.__dict__.setdefault("_step_values", {})[f"{name}_step"] = value

    def step_metrics(self) -> dict[str, Any]:
        """The latest value of each metric logged with on_step=True since the last call (this rank's; values as
        logged, so that reading them is the caller's one device sync)."""
        values = self.__dict__.pop("_step_values", None)
        return values or {}

    def log_dict(self, metrics: dict[str, Any], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    def _detach(self, value: Any) -> Any:
        return value

    def setup_stage(self, stage: str) -> None:
        """Called before the engine sets up for 'fit', 'validate', 'test' or 'predict' (a wrapped
        LightningModule runs its own setup(stage) then)."""

    def enter_evaluation(self, stage: str) -> None:
        """Before Trainer.validate/test/predict's hooks: the model in evaluation mode where the framework has modes
        (given back by exit_evaluation). Not a hook: unifit's own."""

    def exit_evaluation(self, stage: str) -> None:
        """After Trainer.validate/test/predict's hooks: the modes from before enter_evaluation."""

    def on_evaluation_start(self, stage: str) -> None:
        """Before the first batch of Trainer.validate/test/predict (`stage`): a hook (a LightningModule's adapter runs
        the module's and its Lightning callbacks' hooks of that stage here); unifit.Callbacks do not run there."""

    def on_evaluation_end(self, stage: str) -> None:
        """After the last batch of Trainer.validate/test/predict, once metrics are reduced or predictions gathered."""

    def configure_callbacks(self) -> list[Any]:
        """unifit Callbacks this module brings along (run after trainer.callbacks, as Lightning's are)."""
        return []

    def evaluation_weights(self, callback_states: dict[str, Any]) -> None:
        """After a checkpoint's weights were loaded to validate, test or predict with: weights the checkpoint's
        callbacks hold instead (a LightningModule's, see LightningAdapter); none by default."""

    def attach_strategy(self, strategy: Any) -> None:
        """The run's Strategy, once made (a LightningModule's trainer.strategy collectives use it)."""

    @property
    def own_callbacks(self) -> list[Any]:
        """Lightning callbacks the module brings (a LightningModule's configure_callbacks())."""
        return []

    def use_loggers(self, loggers: list[Any]) -> None:
        """The run's loggers (unifit.loggers), for `self.logger` / `self.loggers`."""
        self.__dict__["_unifit_loggers"] = list(loggers)

    @property
    def loggers(self) -> list[Any]:
        """The run's loggers; their `experiment` is the backend's own object (TensorBoard's SummaryWriter, an
        MlflowClient, the wandb run) on rank 0 and a no-op object elsewhere, as in Lightning."""
        return self.__dict__.get("_unifit_loggers", [])

    @property
    def logger(self) -> Any:
        """The first of `loggers` (None when the run logs nowhere), as Lightning's `self.logger`; a module that
        sets its own `self.logger` (a logging.Logger, say) keeps it."""
        if "_own_logger" in self.__dict__:
            return self.__dict__["_own_logger"]
        return self.loggers[0] if self.loggers else None

    @logger.setter
    def logger(self, value: Any) -> None:
        self.__dict__["_own_logger"] = value

    def use_callbacks(self, running: list[Any], every: list[Any]) -> None:
        """The run's Lightning callbacks: `running` are run as they are, which a LightningModule's run does."""
        if running:
            names = ", ".join(type(cb).__name__ for cb in running)
            raise ConfigError(
                f"trainer.callbacks: {names} (Lightning callbacks) run with a LightningModule, and "
                f"{type(self).__name__} is not one: write them as unifit.Callback subclasses (one method per event)"
            )

    # ---- data: the Trainer shards these; batch_size is per replica --------------------------
    def train_dataset(self) -> Any:
        """The training data: a torch Dataset, or a tuple of arrays (x, y, ...)."""
        raise NotImplementedError(
            f"{type(self).__name__} provides no training data: define train_dataset() "
            "or pass a data provider (data: in the YAML, Trainer.fit(module, data=...))"
        )

    def val_dataset(self) -> Any:
        """Validation data, or None for no validation."""
        return None

    def test_dataset(self) -> Any:
        """Data for Trainer.test / `unifit test` (like val_dataset), or None."""
        return None

    def predict_dataset(self) -> Any:
        """Data for Trainer.predict / `unifit predict` (like val_dataset), or None."""
        return None


def _reduction(name: str, reduce_fx: Any) -> str:
    """Lightning's accepted spellings of a reduction ("avg", torch.max, max...) as one of REDUCTIONS."""
    fx = getattr(reduce_fx, "__name__", reduce_fx)
    fx = "mean" if fx == "avg" else fx
    if fx not in REDUCTIONS:
        raise ConfigError(
            f"self.log({name!r}): reduce_fx={reduce_fx!r}; use one of {', '.join(REDUCTIONS)} (or log a "
            "torchmetrics Metric for any other statistic)"
        )
    return str(fx)
