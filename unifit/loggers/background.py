"""Send records to a tracking server from a background thread, so a slow or unreachable server never
slows a training step.

Records queue in order; the thread sends runs of records of one kind (metrics, artifacts, the run's
status) with the logger's `send`, which must do all of a run or raise. A failed send is retried with
backoff and nothing is dropped: an outage is reported once, and the next successful send catches up.
`close` waits a bounded time for the queue to drain and says what could not be sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from unifit.storage import redact_url

log = logging.getLogger("unifit")


class Rejected(Exception):
    """Raised by a logger's `send` when the server refuses the records for good (a deleted run, a bad value):
    they are dropped with a warning instead of being retried in front of everything that follows."""


class BackgroundSender:
    def __init__(
        self,
        send: Callable[[str, list[Any]], None],
        what: str,
        *,
        max_run: int = 1000,
        max_backoff_s: float = 10.0,
        linger_s: float = 1.0,
        max_queued: int = 500_000,
    ) -> None:
        self._send, self.what = send, what
        self.max_run, self.max_backoff_s, self.linger_s = max_run, max_backoff_s, linger_s
        self.max_queued = max_queued  # an outage of hours at most: past it the oldest records go, with a warning
        self._dropped = 0
        self._queue: deque[tuple[str, Any]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._abandoned = False  # close() gave up: the thread sends nothing more (its request in flight aside)
        self._inflight = 0  # records taken off the queue, being sent
        self._failing = False
        self._thread = threading.Thread(target=self._run, name=f"unifit-{what}", daemon=True)
        self._thread.start()

    def put(self, kind: str, record: Any) -> None:
        """Queue one record; returns at once."""
        with self._cond:
            self._queue.append((kind, record))
            if len(self._queue) > self.max_queued:
                self._queue.popleft()
                self._dropped += 1
                if self._dropped == 1:
                    log.warning("%s: more than %d records waiting; dropping the oldest", self.what, self.max_queued)
            if len(self._queue) >= self.max_run:
                self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._inflight

    def close(self, timeout_s: float) -> int:
        """Stop after the queue is sent or `timeout_s` passed; returns how many records were not sent."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        with self._cond:
            self._abandoned = True
            left = len(self._queue) + self._inflight
        if left:
            log.warning(
                "%s: %d records were not sent within %.0fs (the server stayed unreachable); they are lost",
                self.what,
                left,
                timeout_s,
            )
        return left

    def _next_run(self) -> tuple[str, list[Any]]:
        kind = self._queue[0][0]
        run: list[Any] = []
        for k, record in self._queue:
            if k != kind or len(run) == self.max_run:
                break
            run.append(record)
        return kind, run

    def _run(self) -> None:
        backoff = 0.5
        while True:
            with self._cond:
                # a second's records in one request, and the training thread never woken per record: a step logged
                # every few ms costs neither a request nor a thread switch each
                self._cond.wait_for(lambda: len(self._queue) >= self.max_run or self._closing, self.linger_s)
                if self._abandoned or (self._closing and not self._queue):
                    return
                if not self._queue:
                    continue
                kind, run = self._next_run()
                for _ in run:  # in flight: out of the queue, so a full queue's dropping never touches it
                    self._queue.popleft()
                self._inflight = len(run)
            try:
                self._send(kind, run)
            except Rejected as exc:  # refused for good: drop them, the rest goes on
                log.warning("%s: the server refused %d %s records (%s); dropped", self.what, len(run), kind, exc)
            except Exception as exc:  # keep training; report once, retry with backoff
                if self._abandoned:
                    return
                if not self._failing:
                    log.warning(
                        "%s failing (%s: %s); training goes on, records are kept and retried",
                        self.what,
                        type(exc).__name__,
                        redact_url(str(exc).splitlines()[0][:300]) if str(exc) else "",
                    )
                self._failing = True
                with self._cond:  # back in front, in order
                    self._queue.extendleft(reversed([(kind, record) for record in run]))
                    self._inflight = 0
                time.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            with self._cond:
                self._inflight = 0
            if self._failing:
                log.warning("%s recovered; caught up", self.what)
            self._failing, backoff = False, 0.5
