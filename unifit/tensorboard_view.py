"""`unifit tensorboard URL`: follow training logs kept on S3 (or any fsspec URL) with TensorBoard.

TensorBoard 2.21 reads s3:// only when TensorFlow is *not* installed beside it, and no
tensorflow-io release fits TensorFlow 2.21, so `tensorboard --logdir s3://...` fails in a
TensorFlow environment. This command keeps a local mirror of the prefix up to date through
fsspec (downloading only files whose size changed) and serves the mirror with TensorBoard's
own server, so it works in any environment and for any fsspec URL.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any

from unifit._imports import require
from unifit.storage import filesystem

log = logging.getLogger("unifit")


class RemoteMirror:
    """Copies new and grown files under `url` into `local_dir`."""

    def __init__(self, url: str, local_dir: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url, self.local_dir = url, local_dir
        self.fs, self.root = filesystem(url, storage_options)
        self._got: dict[str, int] = {}

    def sync_once(self) -> int:
        """Download what changed; returns the number of files fetched."""
        self.fs.invalidate_cache()
        fetched = 0
        root = self.root.rstrip("/")
        for path, info in self.fs.find(root, detail=True).items():
            rel = path[len(root) :].lstrip("/")
            if not rel or self._got.get(rel) == info.get("size"):
                continue
            target = os.path.join(self.local_dir, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            self.fs.get_file(path, target + ".part")
            os.replace(target + ".part", target)  # TensorBoard never sees a half-downloaded file
            self._got[rel] = info.get("size")
            fetched += 1
        return fetched


def serve(
    url: str,
    *,
    host: str = "127.0.0.1",
    port: int = 6006,
    refresh_s: float = 10.0,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Mirror `url` and serve it until interrupted."""
    require("tensorboard", purpose="unifit tensorboard")
    from tensorboard import program

    local = tempfile.mkdtemp(prefix="unifit-tb-mirror-")
    mirror = RemoteMirror(url, local, storage_options)
    mirror.sync_once()
    board = program.TensorBoard()
    board.configure(
        argv=[
            None,
            "--logdir",
            local,
            "--host",
            host,
            "--port",
            str(port),
            "--reload_interval",
            str(max(1, int(refresh_s))),
        ]
    )
    print(f"unifit: TensorBoard at {board.launch()} following {url} (mirror in {local})", flush=True)
    try:
        while True:
            time.sleep(refresh_s)
            try:
                mirror.sync_once()
            except Exception as exc:  # keep serving what we have; try again next round
                log.warning("could not refresh from %s: %s: %s", url, type(exc).__name__, exc)
    except KeyboardInterrupt:
        pass
