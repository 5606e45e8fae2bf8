"""What every logger is: the surface Lightning code reads (`self.logger.experiment`, `log_metrics`,
`log_hyperparams`, `name`, `version`, `save_dir`, `log_dir`), plus the three calls unifit's fit makes
(`start`, `log_metrics`, `finish`) and the state a checkpoint keeps (the tracked run's id).

A logger is made on every rank; only rank 0 starts it. Until it is started (on ranks other than 0,
always) every call is a no-op and `experiment` is an object whose every method does nothing, as
Lightning's rank_zero_only loggers behave.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class NoOpExperiment:
    """`experiment` where nothing is written, as Lightning's dummy experiment: any attribute, call, item or item
    assignment does nothing and gives this object back (`experiment.add_image(...)`, `experiment.summary[k] = v`)."""

    def __getattr__(self, name: str) -> Any:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __getitem__(self, key: Any) -> Any:
        return self

    def __setitem__(self, key: Any, value: Any) -> None: ...


@dataclass
class RunInfo:
    """What a logger starts from: the run's directory, its resolved config (secrets redacted) as a flat
    {'trainer.max_epochs': 10, ...} mapping, where a resumed run continues, or whether an evaluation adds its
    metrics to a run (the tracked run of the checkpoint it evaluates)."""

    root_dir: str
    hyperparameters: dict[str, Any]
    resumed_at_step: int | None  # the checkpoint's global step; None for a fresh run
    storage_options: dict[str, Any]
    adds_to_run: bool = False  # validate/test of a checkpoint: add to what its run recorded, drop nothing


class Logger:
    """Base of unifit's loggers (and of a user's own, named by `class_path` in trainer.loggers)."""

    name: str = "logger"
    version: Any = None
    field: str = "trainer.loggers"  # where the experiment file names it, for error messages

    @classmethod
    def from_config(cls, spec: Any, cfg: Any) -> Logger:
        """Made from its trainer.loggers entry (`spec`, a pydantic model) and the trainer's config."""
        return cls(**spec.model_dump(exclude={"name"}))

    def __init__(self) -> None:
        self.started = False

    # ---- what the fit calls, on rank 0 -------------------------------------------------------------
    def start(self, run: RunInfo) -> None:
        """Open the tracked run (or reopen the one this run's checkpoint names) and record hyperparameters."""
        self.started = True

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record scalars at an optimizer step; must return at once (send in the background)."""

    def log_text(self, text: str, path: str) -> None:
        """Keep a small text file with the run (the resolved config as config.yaml), where the backend stores files."""

    def log_checkpoint(self, path: str) -> None:
        """The fit's last checkpoint (a directory, local or a URL), for loggers that keep artifacts."""

    def check(self) -> None:
        """Before any process trains (rank 0): raise ConfigError when the backend cannot be reached."""

    def epoch_end(self) -> None:
        """An epoch's metrics were logged: a good moment to flush."""

    def finish(self, status: str) -> None:
        """`status`: 'success' or 'failed'. Sends what is buffered (bounded wait) and closes the run."""
        self.started = False

    def state_dict(self) -> dict[str, Any]:
        """Kept in every checkpoint, so that a resumed run continues the same tracked run."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    # ---- Lightning's logger surface --------------------------------------------------------------
    @property
    def experiment(self) -> Any:
        return NoOpExperiment()

    @property
    def save_dir(self) -> str | None:
        return None

    @property
    def log_dir(self) -> str | None:
        return self.save_dir

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """unifit logs the resolved config at start; a module's own call adds to it."""

    def log_graph(self, model: Any, input_array: Any = None) -> None: ...

    def save(self) -> None: ...

    def finalize(self, status: str = "success") -> None:
        """Lightning's name for the end; the fit calls `finish` itself, so a module's call is a no-op."""

    @property
    def group_separator(self) -> str:
        return "/"


class TrackedRunLogger(Logger):
    """A logger whose backend keeps a run by id on a server (MLflow, W&B): the id is kept in every checkpoint, so
    a resumed fit continues the same run; Lightning reads it as `version`."""

    def __init__(self) -> None:
        super().__init__()
        self.run_id: str | None = None

    @property
    def version(self) -> str | None:
        return self.run_id

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if self.run_id else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id", self.run_id)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'trainer': {'max_epochs': 10}} -> {'trainer.max_epochs': 10}; lists stay whole."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
