"""Mirror a growing local directory to a URL from a background thread (TensorBoard logs to S3).

Only files whose size changed since their last upload are sent; the writer rotates its event
file past a size limit, so no sync re-uploads more than that (the known quadratic cost of
re-uploading one ever-growing event file). Training never waits: `request()` only wakes the
thread. Transient errors are retried by s3fs and then by this loop with backoff; a lasting
outage is reported once, and the next successful pass catches up.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from unifit.storage import filesystem

log = logging.getLogger("unifit")


class DirectorySync:
    def __init__(
        self,
        local_dir: str,
        url: str,
        storage_options: dict[str, Any] | None = None,
        every_s: float = 30.0,
        max_backoff_s: float = 60.0,
    ) -> None:
        self.local_dir, self.url = local_dir, url
        self.fs, self.root = filesystem(url, storage_options)
        self.every_s, self.max_backoff_s = every_s, max_backoff_s
        self._sent: dict[str, int] = {}  # relative path -> size uploaded
        self._wake = threading.Event()
        self._stop = False
        self._failing = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="unifit-sync", daemon=True)

    def start(self) -> DirectorySync:
        self._thread.start()
        return self

    def request(self) -> None:
        """Ask for a sync soon; returns at once."""
        self._wake.set()

    def close(self, timeout_s: float = 60.0) -> bool:
        """Stop the thread after one last pass; returns whether everything was uploaded."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "tensorboard sync to %s did not finish within %.0fs; some event files were not uploaded",
                self.url,
                timeout_s,
            )
            return False
        return self.sync_once()

    def pending(self) -> list[str]:
        return [rel for rel, size in self._local_files().items() if self._sent.get(rel) != size]

    def sync_once(self) -> bool:
        """Upload what changed; True when nothing is left to send."""
        with self._lock:
            try:
                for rel in self.pending():
                    local = os.path.join(self.local_dir, rel)
                    size = os.path.getsize(local)  # what the upload below will contain at least
                    self.fs.put_file(local, f"{self.root.rstrip('/')}/{rel}")
                    self._sent[rel] = size
            except Exception as exc:  # keep training; report once, retry with backoff
                if not self._failing:
                    log.warning(
                        "tensorboard sync to %s failing (%s: %s); training goes on, retrying in the background",
                        self.url,
                        type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "",
                    )
                self._failing = True
                return False
            if self._failing:
                log.warning("tensorboard sync to %s recovered; caught up", self.url)
            self._failing = False
            return True

    def _local_files(self) -> dict[str, int]:
        found = {}
        for folder, _, files in os.walk(self.local_dir):
            for name in files:
                path = os.path.join(folder, name)
                found[os.path.relpath(path, self.local_dir)] = os.path.getsize(path)
        return found

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop:
            ok = self.sync_once()
            backoff = 1.0 if ok else min(backoff * 2, self.max_backoff_s)
            self._wake.wait(self.every_s if ok else backoff)
            self._wake.clear()
