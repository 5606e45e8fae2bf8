"""Weights & Biases from rank 0: the resolved config as the run's config, every metric at its step, and optionally
the last checkpoint as a model artifact.

wandb sends from its own background service, so a step never waits on the network; `mode: offline` writes the run
under `dir` for `wandb sync` later (no network at all). The run's id is kept in every checkpoint, and a resumed fit
reopens the same run (`resume='allow'`) and logs the steps after the checkpoint's (online, those after the
run's last step: W&B keeps a run's steps increasing; offline, a resumed run's directory holds the steps from the
checkpoint's on, with the values they had, since the resume is exact). The API key comes from wandb's own login (WANDB_API_KEY or ~/.netrc),
never from the experiment file.
"""

from __future__ import annotations

import os
from typing import Any

from unifit._imports import require
from unifit.errors import ConfigError
from unifit.loggers.base import NoOpExperiment, RunInfo, TrackedRunLogger


class WandbLogger(TrackedRunLogger):
    name = "wandb"

    def __init__(
        self,
        project: str = "unifit",
        entity: str | None = None,
        run_name: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        mode: str = "online",
        dir: str | None = None,
        log_checkpoints: bool = False,
    ) -> None:
        super().__init__()
        self.project, self.entity, self.run_name, self.group = project, entity, run_name, group
        self.tags, self.mode, self.dir = list(tags or []), mode, dir
        self.log_checkpoints = log_checkpoints
        self._run: Any = None
        self._last_step = -1

    def check(self) -> None:
        """Online runs need wandb's login before any process trains (offline runs need nothing)."""
        if self.mode != "online" or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") == "offline":
            return
        netrc = os.path.expanduser(os.environ.get("NETRC", "~/.netrc"))
        if not (os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read()):
            raise ConfigError(
                f"{self.field}: mode 'online' and no wandb login (WANDB_API_KEY is empty, no ~/.netrc entry); "
                "run 'wandb login', set WANDB_API_KEY in the environment, or use mode: offline"
            )

    def start(self, run: RunInfo) -> None:
        wandb = require("wandb", purpose="Weights & Biases logging (trainer.loggers: wandb)")
        directory = self.dir or (run.root_dir if "://" not in run.root_dir else None)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run_name,
            group=self.group,
            tags=self.tags or None,
            mode=self.mode,
            dir=directory,
            id=self.run_id,
            resume="allow" if self.run_id else None,
            config=run.hyperparameters,
            settings=wandb.Settings(console="off", silent=True),
            reinit="create_new",
        )
        self.run_id = self._run.id
        if run.resumed_at_step is not None or run.adds_to_run:  # online, wandb knows the run's last step
            self._last_step = max(run.resumed_at_step or 0, int(getattr(self._run, "step", 0) or 0) - 1)
        super().start(run)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._run is None:
            return
        values = {k: float(v) for k, v in metrics.items()}
        if step is None:  # the module's own call without a step: wandb's next one
            self._run.log(values)
            return
        if step < self._last_step:  # W&B keeps a run's steps increasing: a test of an earlier checkpoint, say
            self._run.summary.update(values)
            return
        self._last_step = step
        self._run.log(values, step=step)

    def log_checkpoint(self, path: str) -> None:
        if self._run is None or not self.log_checkpoints:
            return
        import wandb

        artifact = wandb.Artifact(f"checkpoint-{self.run_id}", type="model")
        if "://" in path:  # on S3 (or another store): W&B records a reference, the files stay where they are
            artifact.add_reference(path)
        else:
            artifact.add_dir(path)
        self._run.log_artifact(artifact, aliases=["latest", path.rstrip("/").rsplit("/", 1)[-1]])

    def finish(self, status: str) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "success" else 1)
            self._run = None
        super().finish(status)

    @property
    def save_dir(self) -> str | None:
        return self.dir

    @property
    def experiment(self) -> Any:
        """The wandb Run, as Lightning's WandbLogger.experiment is."""
        return self._run if self._run is not None else NoOpExperiment()

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if self._run is not None:
            self._run.config.update(dict(params), allow_val_change=True)
