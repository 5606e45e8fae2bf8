"""Ends a process stuck in a collective, for communication libraries that can wait forever.

A rank that never joins a collective (a crashed peer's launcher not noticing, a peer stuck in
user code, `save_checkpoint` called on one rank only) would leave the others waiting. The
strategy arms the watchdog around every blocking collective; one that has not returned after
the timeout gets a one-line error and the process exits with code 1, so its launcher stops the
rest. One thread per process, polling: arming costs two assignments, so it can guard every step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator


class CollectiveWatchdog:
    def __init__(self, timeout_s: float, prefix: str) -> None:
        self.timeout_s = timeout_s
        self.prefix = prefix  # how this rank's errors start, e.g. "unifit: error (rank 1): "
        self._what: str | None = None
        self._since = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="unifit-collective-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        outer = self._what
        if outer is None:  # nested guards: the outermost one times the whole wait
            self._since, self._what = time.monotonic(), what
        try:
            yield
        finally:
            if outer is None:
                self._what = None

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            what = self._what
            if what is not None and time.monotonic() - self._since > self.timeout_s:
                sys.stderr.write(
                    f"{self.prefix}{what} did not finish within trainer.collective_timeout_s="
                    f"{self.timeout_s:g}s; another rank failed, or did not join it (every rank must call the same "
                    "collectives, e.g. do not call save_checkpoint inside 'if rank == 0')\n"
                )
                sys.stderr.flush()
                os._exit(1)
