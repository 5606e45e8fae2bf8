"""Commit checkpoints in the background when the store is remote, so training never waits on S3.

One job at a time, in order: a new save first waits for the previous upload (and raises its
error), and the end of fit waits for the last one, so a run never ends with an upload missing
or a failure unreported. Local stores commit synchronously (a local write is fast).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("unifit")


class Committer:
    def __init__(self, background: bool) -> None:
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()
        if not self.background:
            job()
            return

        def run() -> None:
            try:
                job()
            except BaseException as exc:  # raised to the training thread at the next wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name="unifit-checkpoint-commit", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the pending commit is done; raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
