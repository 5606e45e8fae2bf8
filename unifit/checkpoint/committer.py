"""Write and commit checkpoints on one background thread, so training never waits on the disk or S3.

The training thread hands over a snapshot (the state already serialized to bytes, a copy: later
optimizer steps cannot change it) and goes on. A synchronous local write of a ~100 MB
checkpoint stalled the step 0.3 s on a quiet machine and 1.5-2.6 s on a busy one
(benchmarks/results/checkpoint_cost.md), so every store commits in the background. One job at a
time, in order: a new save first waits for the previous one (and raises its error), and the end of fit, a preemption stop and a failure
wait for the last one, so a run never ends with a write missing or a failure unreported.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("unifit")


class Committer:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` (write, commit, prune) on the writer thread after the previous one."""
        self.wait()

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
