"""Report a fit's progress to Kubeflow Trainer (v2.2 and later) when the TrainJob asks for it.

The Trainer's progress plugin gives the training container KUBEFLOW_TRAINER_STATUS_URL (an HTTPS endpoint),
KUBEFLOW_TRAINER_STATUS_CA_CERT (the file of the CA that signed it) and KUBEFLOW_TRAINER_STATUS_TOKEN (a
projected service-account token file, re-read at every post: it rotates). Rank 0 POSTs
`{"trainerStatus": {progressPercentage, estimatedRemainingSeconds, metrics, lastUpdatedTime}}` at most once per
5 s (the controller's limit) from a thread of its own, the newest status replacing one not yet sent: a slow or
unreachable server never slows a step, and never fails the fit (it is said once, in a warning).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.request
from datetime import UTC, datetime
from typing import Any, Mapping

from unifit.loop.callback import Callback
from unifit.loop.context import FitContext

log = logging.getLogger("unifit")

STATUS_URL = "KUBEFLOW_TRAINER_STATUS_URL"
CA_CERT = "KUBEFLOW_TRAINER_STATUS_CA_CERT"
TOKEN = "KUBEFLOW_TRAINER_STATUS_TOKEN"
MIN_INTERVAL_S = 5.0  # the controller's: one status per 5 s per TrainJob
REQUEST_TIMEOUT_S = 5.0


def wanted(env: Mapping[str, str] | None = None) -> bool:
    return bool((os.environ if env is None else env).get(STATUS_URL))


def fraction_done(ctx: FitContext) -> float:
    """How much of the fit is done: of its epochs (and batches of the current one), or of max_steps, whichever
    ends it first."""
    progress, cfg = ctx.progress, ctx.config
    per_epoch = max(1, progress.batches_per_epoch)
    done = (progress.epoch + min(progress.batch_in_epoch, per_epoch) / per_epoch) / cfg.max_epochs
    if cfg.max_steps:
        done = max(done, progress.optimizer_step / cfg.max_steps)
    return min(1.0, done)


class StatusPoster:
    """Posts the newest status, at most once per `min_interval_s`, from one thread; close() sends what is left."""

    def __init__(self, url: str, ca_cert: str | None, token_file: str | None, min_interval_s: float) -> None:
        self.url, self.token_file, self.min_interval_s = url, token_file, min_interval_s
        self._context = ssl.create_default_context(cafile=ca_cert or None) if url.startswith("https") else None
        self._pending: dict[str, Any] | None = None
        self._closing = False
        self._last_sent = float("-inf")
        self._warned = False
        self.sent = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="unifit-kubeflow-progress", daemon=True)
        self._thread.start()

    def put(self, status: dict[str, Any]) -> None:
        with self._cond:
            self._pending = status
            self._cond.notify()

    def close(self) -> None:
        """Send the last status (waiting out the interval), then end the thread; bounded."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=self.min_interval_s + REQUEST_TIMEOUT_S + 1)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None:
                    return
                wait = self._last_sent + self.min_interval_s - time.monotonic()
                if wait > 0:
                    self._cond.wait(timeout=wait)  # a newer status may replace this one meanwhile
                    if time.monotonic() < self._last_sent + self.min_interval_s:
                        continue
                status, self._pending = self._pending, None
                self._last_sent = time.monotonic()
            self._send(status)

    def _send(self, status: dict[str, Any]) -> None:
        try:
            headers = {"Content-Type": "application/json"}
            if self.token_file:
                with open(self.token_file) as f:
                    headers["Authorization"] = f"Bearer {f.read().strip()}"
            body = json.dumps({"trainerStatus": status}).encode()
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S, context=self._context) as response:
                response.read()
            self.sent += 1
            if self._warned:
                log.info("kubeflow progress: %s answers again", self.url)
                self._warned = False
        except Exception as exc:  # never the fit's problem: said once per outage
            if not self._warned:
                log.warning("kubeflow progress: could not post to %s (%s); training goes on", self.url, exc)
                self._warned = True


class KubeflowProgress(Callback):
    """On rank 0: the fit's percentage, its estimated remaining seconds (from this run's pace) and the last
    epoch's metrics, to the TrainJob's status."""

    def __init__(self, env: Mapping[str, str] | None = None, min_interval_s: float | None = None) -> None:
        env = os.environ if env is None else env
        self.url, self.ca_cert, self.token_file = env[STATUS_URL], env.get(CA_CERT), env.get(TOKEN)
        self.min_interval_s = MIN_INTERVAL_S if min_interval_s is None else min_interval_s
        self._poster: StatusPoster | None = None
        self._start = (0.0, 0.0)  # (monotonic time, fraction done) when this run started: a resume's pace is its own
        self._last_put = float("-inf")
        self._last_news: dict[str, Any] = {}

    def on_fit_start(self, ctx: FitContext) -> None:
        if not ctx.is_global_zero:
            return
        self._poster = StatusPoster(self.url, self.ca_cert, self.token_file, self.min_interval_s)
        self._start = (time.monotonic(), fraction_done(ctx))
        self._post(ctx)

    def on_train_batch_end(self, ctx: FitContext, loss: Any, batch_idx: int) -> None:
        if self._poster is not None and time.monotonic() - self._last_put >= self.min_interval_s / 4:
            self._post(ctx)

    def on_epoch_end(self, ctx: FitContext) -> None:
        if self._poster is not None:
            self._post(ctx)

    def on_fit_end(self, ctx: FitContext) -> None:
        if self._poster is not None:  # ended as configured, or stopped early on purpose: done either way
            self._post(ctx, done=1.0)

    def on_teardown(self, ctx: FitContext) -> None:
        if self._poster is not None:
            self._poster.close()
            self._poster = None

    def _post(self, ctx: FitContext, done: float | None = None) -> None:
        assert self._poster is not None
        done = min(fraction_done(ctx), 0.99) if done is None else done  # 100 once the fit has ended (validated)
        status: dict[str, Any] = {
            "progressPercentage": int(done * 100),
            "lastUpdatedTime": datetime.now(UTC).isoformat(),
            "metrics": [{"name": k, "value": f"{v:.6g}"} for k, v in sorted(ctx.state.metrics.items())]
            + [
                {"name": "epoch", "value": str(ctx.progress.epoch)},
                {"name": "step", "value": str(ctx.state.global_step)},
            ],
        }
        started, at_start = self._start
        if at_start < done < 1.0:
            status["estimatedRemainingSeconds"] = round((time.monotonic() - started) * (1.0 - done) / (done - at_start))
        elif done >= 1.0:
            status["estimatedRemainingSeconds"] = 0
        news = {k: v for k, v in status.items() if k != "lastUpdatedTime"}
        if news != self._last_news:  # the same again (the last epoch's end, then the fit's) is not sent twice
            self._poster.put(status)
            self._last_news = news
        self._last_put = time.monotonic()
