"""MLflow tracking from rank 0: the resolved config as the run's params, every metric at its step, the config file
and (optionally) the last checkpoint as artifacts, the run's status at the end.

Everything after the run is opened goes through a BackgroundSender, so an unreachable or slow tracking server never
slows a step: records wait in order and are retried until the server answers (mlflow's own HTTP retries are set to
0 unless you set MLFLOW_HTTP_REQUEST_MAX_RETRIES, since unifit retries itself; nor does it print the run's URL,
which may hold credentials, unless MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT is set). The run's id is kept in every
checkpoint, so a resumed fit continues the same run; points the run already has (steps up to its last one per
metric, written before the interruption) are not sent twice. Credentials come from MLflow's own environment
(MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME / _PASSWORD), never from the experiment file.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import re
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable

from unifit._imports import require
from unifit.errors import ConfigError
from unifit.loggers.background import BackgroundSender, Rejected
from unifit.loggers.base import NoOpExperiment, RunInfo, TrackedRunLogger
from unifit.storage import filesystem, redact_url

log = logging.getLogger("unifit")
_PARAM_CHARS = 500  # the longest param value every MLflow server version stores
_PARAMS_PER_BATCH = 100
_METRIC_NAME = re.compile(r"[^a-zA-Z0-9_/. \-]+")  # what MLflow refuses in a metric name
_REFUSED = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST", "INVALID_STATE"}


def _retrying(call: Callable[[], Any], attempts: int = 5) -> Any:
    """A start-up call to the server, retried with backoff (1, 2, 4, 8 s) unless the server refused it for good."""
    from mlflow.exceptions import MlflowException

    for attempt in range(attempts):
        try:
            return call()
        except MlflowException as exc:
            if exc.error_code in _REFUSED or exc.error_code == "RESOURCE_ALREADY_EXISTS" or attempt == attempts - 1:
                raise
            time.sleep(2**attempt)


class MLflowLogger(TrackedRunLogger):
    name = "mlflow"

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "unifit",
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
        log_checkpoints: bool = False,
        flush_timeout_s: float = 120.0,
    ) -> None:
        super().__init__()
        self.tracking_uri = tracking_uri
        self.experiment_name, self.run_name, self.tags = experiment, run_name, dict(tags or {})
        self.log_checkpoints, self.flush_timeout_s = log_checkpoints, flush_timeout_s
        self.experiment_id: str | None = None
        self._client: Any = None
        self._sender: BackgroundSender | None = None
        self._sent: dict[str, dict[int, float]] = {}  # on resume: what the run has past the checkpoint
        self._storage_options: dict[str, Any] = {}

    def _uri(self) -> str:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise ConfigError(
                f"{self.field}.tracking_uri: not set and MLFLOW_TRACKING_URI is empty; give the tracking server, e.g. "
                "http://127.0.0.1:5000 (start one with: mlflow server --host 127.0.0.1 --port 5000)"
            )
        return uri

    def check(self) -> None:
        """Before any process trains: the tracking server answers (one line, exit 2, if it does not)."""
        uri = self._uri()
        if not uri.startswith(("http://", "https://")):
            return
        parts = urllib.parse.urlsplit(uri)
        request = urllib.request.Request(f"{redact_url(uri).replace('***@', '').rstrip('/')}/health")
        if parts.username:  # credentials in the URI: sent as basic auth, as mlflow's client sends them
            token = base64.b64encode(f"{parts.username}:{parts.password or ''}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=10):
                pass
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ConfigError(
                f"{self.field}.tracking_uri: the MLflow server at {redact_url(uri)} did not answer ({reason}); "
                "start it (mlflow server --host 127.0.0.1 --port 5000) or fix tracking_uri"
            ) from None

    def start(self, run: RunInfo) -> None:
        require("mlflow", purpose="MLflow logging (trainer.loggers: mlflow)")
        from mlflow import MlflowClient

        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # the URL may hold credentials
        self._storage_options = run.storage_options
        self._client = client = MlflowClient(self._uri())
        known: dict[str, Any] = {}
        self._sent = {}
        tracked = self._tracked_run() if self.run_id is not None else None
        if tracked is not None:  # resumed: the same run
            self.experiment_id = tracked.info.experiment_id
            known = dict(tracked.data.params)
            if run.resumed_at_step is not None:  # a fit goes on: what the run has past the checkpoint
                self._sent = {key: self._points_after(key, run.resumed_at_step) for key in tracked.data.metrics}
            _retrying(lambda: client.update_run(self.run_id, status="RUNNING"))
        else:
            self.experiment_id = _retrying(self._experiment_id)
            created = _retrying(lambda: client.create_run(self.experiment_id, run_name=self.run_name, tags=self.tags))
            self.run_id = created.info.run_id
        self._log_params(run.hyperparameters, known)
        super().start(run)
        self._sender = BackgroundSender(self._send, f"mlflow logging to {redact_url(self._uri())}")
        log.info("mlflow: run %s in experiment %r", self.run_id, self.experiment_name)

    def _experiment_id(self) -> str:
        """The experiment's id, created when missing (another job creating it at the same moment is fine)."""
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(self.experiment_name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self._client.create_experiment(self.experiment_name))
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return str(self._client.get_experiment_by_name(self.experiment_name).experiment_id)

    def _tracked_run(self) -> Any:
        """The checkpoint's run on this server. One that is not there (another server, deleted) is a warning and a
        new run; any other failure is retried, then raised."""
        from mlflow.exceptions import MlflowException

        try:
            return _retrying(lambda: self._client.get_run(self.run_id))
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            log.warning(
                "mlflow: the checkpoint's run %s is not on %s (%s); logging to a new run",
                self.run_id,
                redact_url(self._uri()),
                redact_url(str(exc).splitlines()[0][:200]),
            )
            self.run_id = None
            return None

    def _points_after(self, key: str, step: int) -> dict[int, float]:
        history = _retrying(lambda: self._client.get_metric_history(self.run_id, key))
        return {m.step: m.value for m in history if m.step > step}

    def _log_params(self, hyperparameters: dict[str, Any], known: dict[str, Any]) -> None:
        """Params cannot change in MLflow: a resumed run adds only the names it did not have."""
        from mlflow.entities import Param

        params = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in hyperparameters.items() if k not in known]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            batch = params[i : i + _PARAMS_PER_BATCH]
            _retrying(lambda batch=batch: self._client.log_batch(self.run_id, params=batch, synchronous=True))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Queued for the background sender. Names lose the characters MLflow refuses (as Lightning's MLFlowLogger
        does). After a resume, a point the run already has with the same value (the resume is exact) is not sent
        again; a different value (the run was resumed with other settings) is."""
        if self._sender is None:
            return
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), step or 0
        for key, value in metrics.items():
            key, value = _METRIC_NAME.sub("", key), float(value)
            had = self._sent.get(key, {}).get(step)
            if had is None or not math.isclose(had, value, rel_tol=1e-6, abs_tol=1e-12):
                self._sender.put("metric", Metric(key, value, now, step))

    def log_text(self, text: str, path: str) -> None:
        if self._sender is not None:
            self._sender.put("text", (text, path))

    def log_checkpoint(self, path: str) -> None:
        if self._sender is not None and self.log_checkpoints:
            self._sender.put("checkpoint", path)

    def _send(self, kind: str, records: list[Any]) -> None:
        """Runs on the sender's thread; raises to have the whole run of records retried, or Rejected where the
        server refuses them for good (a deleted run, a bad value), so they do not hold up what follows."""
        from mlflow.exceptions import MlflowException

        try:
            self._send_now(kind, records)
        except MlflowException as exc:
            if exc.error_code in _REFUSED:
                raise Rejected(redact_url(str(exc).splitlines()[0][:200])) from None
            raise

    def _send_now(self, kind: str, records: list[Any]) -> None:
        if kind == "metric":
            self._client.log_batch(self.run_id, metrics=records, synchronous=True)
        elif kind == "text":
            for text, path in records:
                self._client.log_text(self.run_id, text, path)
        elif kind == "checkpoint":
            for path in records:
                fs, root = filesystem(path, self._storage_options)
                with tempfile.TemporaryDirectory(prefix="unifit-mlflow-") as local:
                    fs.get(root.rstrip("/") + "/", local, recursive=True)
                    name = root.rstrip("/").rsplit("/", 1)[-1]
                    self._client.log_artifacts(self.run_id, local, f"checkpoints/{name}")
        elif kind == "status":
            self._client.set_terminated(self.run_id, records[-1])

    def finish(self, status: str) -> None:
        if self._sender is not None:
            final = "FINISHED" if status == "success" else "FAILED"
            self._sender.put("status", final)
            if self._sender.close(self.flush_timeout_s):  # records left (a long upload, a server down): the status
                try:  # is still worth one direct try, or the run shows RUNNING for ever
                    self._client.set_terminated(self.run_id, final)
                except Exception as exc:
                    log.warning("mlflow: run %s not marked %s (%s)", self.run_id, final, type(exc).__name__)
            self._sender = None
        super().finish(status)

    @property
    def experiment(self) -> Any:
        """mlflow.MlflowClient, as Lightning's MLFlowLogger.experiment is (with `run_id` on this logger)."""
        return self._client if self.started else NoOpExperiment()

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if self.started:
            self._log_params({str(k): v for k, v in dict(params).items()}, {})
