"""The run directory's metrics.jsonl: one line per epoch, appended on a local disk (nothing kept in memory over a
long run), rewritten whole on an object store (memory:// stands in for one); a resume keeps the epochs up to its
checkpoint and drops the ones after it, and elapsed_s continues."""

from __future__ import annotations

import json
from types import SimpleNamespace

import fsspec
import pytest

from unifit.callbacks.run_directory import RunDirectory
from unifit.loop.state import Progress, TrainState


def _ctx(epoch: int, resumed_from: str | None = None) -> SimpleNamespace:
    state = TrainState(progress=Progress(epoch=epoch, optimizer_step=10 * epoch), metrics={"loss": 1.0 / (epoch + 1)})
    return SimpleNamespace(state=state, resolved_config="trainer: {}\n", resumed_from=resumed_from)


def _epochs(fs, root: str) -> list[int]:
    return [json.loads(line)["epoch"] for line in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_lines_per_epoch_and_a_resume_drops_the_epochs_after_its_checkpoint(tmp_path, where):
    root = str(tmp_path / "run") if where == "local" else f"memory://{tmp_path.name}/run"
    fs = fsspec.filesystem("file" if where == "local" else "memory")
    first = RunDirectory(root)
    first.on_setup(_ctx(0))
    for epoch in (1, 2, 3):
        first.on_epoch_end(_ctx(epoch))
    assert _epochs(fs, root) == [1, 2, 3]
    assert len(first.lines) == (0 if where == "local" else 3)  # appended on disk: nothing grows in memory

    resumed = RunDirectory(root)
    resumed.on_setup(_ctx(2, resumed_from="epoch=2"))  # the checkpoint of epoch 2: epoch 3 is trained again
    resumed.on_epoch_end(_ctx(3))
    assert _epochs(fs, root) == [1, 2, 3]
    lines = fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()
    assert json.loads(lines[-1])["elapsed_s"] >= json.loads(lines[1])["elapsed_s"]  # wall time continues
