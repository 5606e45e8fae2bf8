"""metrics.csv as Lightning's CSVLogger writes it: one row per logged step, the columns every name logged so far
(sorted, `step` among them), a row leaving empty what it did not log. Rank 0 writes it in the run directory (or
`path`, an S3 URL too); a new column rewrites the file with the wider header, as Lightning's does. A resumed run
keeps the rows up to its checkpoint's step and drops any after it, so no step appears twice.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from unifit.config.schema import join_path
from unifit.loggers.base import Logger, RunInfo
from unifit.storage import filesystem


class CSVLogger(Logger):
    name = "csv"
    version = 0

    def __init__(self, path: str | None = None) -> None:
        super().__init__()
        self.path = path
        self._fs: Any = None
        self._columns: list[str] = []
        self._written = 0  # rows in the file
        self._pending: list[dict[str, Any]] = []

    def start(self, run: RunInfo) -> None:
        super().start(run)
        self.path = self.path or join_path(run.root_dir, "metrics.csv")
        self._fs, self._file = filesystem(self.path, run.storage_options)
        protocols = self._fs.protocol if isinstance(self._fs.protocol, (tuple, list)) else (self._fs.protocol,)
        self._appends = bool({"file", "local"} & set(protocols))  # an object store rewrites the file instead
        continues = run.resumed_at_step is not None or run.adds_to_run
        if continues and self._fs.exists(self._file):
            columns, rows = self._read()
            self._columns = columns
            last = run.resumed_at_step if run.resumed_at_step is not None else float("inf")
            self._rewrite([row for row in rows if int(float(row["step"])) <= last])
        else:
            self._fs.makedirs(self._file.rsplit("/", 1)[0], exist_ok=True)
            self._fs.pipe_file(self._file, b"")

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.started:
            self._pending.append({**metrics, "step": step if step is not None else self._written + len(self._pending)})

    def epoch_end(self) -> None:
        self.save()

    def save(self) -> None:
        """Written at each epoch's end and at the end of the fit: appended, or the whole file rewritten (read back,
        nothing kept in memory) when a new name widens the header, as Lightning's CSVLogger does."""
        if not self._pending:
            return
        new = sorted({key for row in self._pending for key in row} - set(self._columns))
        if new or not self._columns or not self._appends:
            rows = self._read()[1] if self._written else []
            self._columns = sorted({*self._columns, *new})
            self._rewrite(rows + self._pending)
        else:
            with self._fs.open(self._file, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self._columns).writerows(self._pending)
            self._written += len(self._pending)
        self._pending = []

    def _read(self) -> tuple[list[str], list[dict[str, Any]]]:
        reader = csv.DictReader(io.StringIO(self._fs.cat_file(self._file).decode()))
        return list(reader.fieldnames or []), list(reader)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        out = io.StringIO(newline="")
        writer = csv.DictWriter(out, fieldnames=self._columns)
        writer.writeheader()
        writer.writerows(rows)
        self._fs.pipe_file(self._file, out.getvalue().encode())
        self._written = len(rows)

    def finish(self, status: str) -> None:
        if self.started:
            self.save()
        super().finish(status)

    @property
    def save_dir(self) -> str | None:
        return self.path.rsplit("/", 1)[0] if self.path else None
