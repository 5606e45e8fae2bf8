"""Checkpoint commits are atomic; uncommitted ones are never loaded; retention protects what matters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import unifit
from tests.probe.probe import ProbeModule
from unifit.checkpoint.store import MARKER, CheckpointStore, checkpoint_name
from unifit.errors import CheckpointNotFoundError


def _writer(text: str):
    def write(fs, directory):
        fs.pipe_file(f"{directory}/state.pt", text.encode())

    return write


def test_save_commits_and_points_last(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(checkpoint_name(1, 10), _writer("one"), {"epoch": 1})
    store.save(checkpoint_name(2, 20), _writer("two"), {"epoch": 2})
    assert store.committed() == ["epoch=0001-step=0000010", "epoch=0002-step=0000020"]
    fs, path = store.resolve("last")
    assert fs.cat_file(f"{path}/state.pt") == b"two"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]


def test_uncommitted_checkpoint_is_ignored(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(checkpoint_name(1, 10), _writer("one"), {"epoch": 1})
    half = tmp_path / checkpoint_name(2, 20)
    half.mkdir()
    (half / "state.pt").write_text("partial")  # no commit marker
    assert store.committed() == ["epoch=0001-step=0000010"]
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        store.resolve(str(half))
    assert store.resolve("last")[1].endswith("epoch=0001-step=0000010")


def test_failed_write_leaves_nothing_and_keeps_last(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(checkpoint_name(1, 10), _writer("one"), {"epoch": 1})

    def broken(fs, directory):
        fs.pipe_file(f"{directory}/state.pt", b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.save(checkpoint_name(2, 20), broken, {"epoch": 2})
    assert sorted(os.listdir(tmp_path)) == ["epoch=0001-step=0000010", "last.json"]


def test_prune_keeps_newest_best_and_resumed_from(tmp_path):
    store = CheckpointStore(str(tmp_path))
    names = [checkpoint_name(e, e * 10) for e in range(1, 7)]
    for name in names:
        store.save(name, _writer(name), {})
    store.set_best(names[1], "val/acc", 0.9)
    deleted = store.prune(2, protected={names[0]})
    assert store.committed() == [names[0], names[1], names[4], names[5]]
    assert deleted == [names[2], names[3]]
    assert store.resolve("best")[1].endswith(names[1])


def test_missing_pointer_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="--ckpt-path best: no committed checkpoint"):
        CheckpointStore(str(tmp_path / "nothing")).resolve("best")


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_process_killed_mid_save_leaves_no_committed_partial_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from unifit.checkpoint.store import CheckpointStore
        store = CheckpointStore({str(tmp_path)!r})
        store.save("epoch=0001-step=0000010", lambda fs, d: fs.pipe_file(d + "/state.pt", b"good"), {{}})
        def slow(fs, d):
            with fs.open(d + "/state.pt", "wb") as f:
                f.write(b"x" * 1000)
                f.flush()
                print("writing", flush=True)
                time.sleep(60)
        store.save("epoch=0002-step=0000020", slow, {{}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    store = CheckpointStore(str(tmp_path))
    assert store.committed() == ["epoch=0001-step=0000010"]
    fs, path = store.resolve("last")
    assert fs.cat_file(f"{path}/state.pt") == b"good"
    assert not (tmp_path / "epoch=0002-step=0000020").exists()
    assert not os.path.exists(os.path.join(path, "..", "epoch=0002-step=0000020", MARKER))


class _Weights(unifit.Callback):
    """Records the first layer's weight after every optimizer step (before the checkpoint callback)."""

    def __init__(self, at_step: dict[int, threading.Event] | None = None) -> None:
        self.weights: dict[int, torch.Tensor] = {}
        self.at_step = at_step or {}

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        step = ctx.progress.optimizer_step
        self.weights[step] = ctx.module.net[0].weight.detach().clone()
        if step in self.at_step:
            self.at_step[step].set()


def _fit(tmp_path, callback, **checkpoint):
    trainer = unifit.Trainer(
        max_epochs=1,
        batch_size=8,
        root_dir=str(tmp_path),
        progress_bar=False,
        tensorboard={"enabled": False},
        callbacks=[callback],
        checkpoint={"every_n_steps": 2, "keep_last_n": None, **checkpoint},
    )
    return trainer, trainer.fit(ProbeModule(dropout=0.0))


def test_save_is_written_in_the_background_from_a_snapshot(tmp_path, monkeypatch):
    """The save at step 2 is held until step 3 has trained: training goes on while it is written,
    and what is written is step 2's state, not the parameters the later steps changed."""
    step3 = threading.Event()
    waited: list[bool] = []
    real_save = CheckpointStore.save

    def held_save(self, name, write, meta, directory=None):
        if meta["global_step"] == 2:
            waited.append(step3.wait(timeout=30))  # a save on the training thread would time out here
        return real_save(self, name, write, meta, directory)

    monkeypatch.setattr(CheckpointStore, "save", held_save)
    recorder = _Weights({3: step3})
    trainer, _ = _fit(tmp_path, recorder)
    assert waited == [True]
    store = CheckpointStore(trainer.config.checkpoint_dir)
    fs, path = store.resolve(checkpoint_name(0, 2))
    saved = torch.load(fs.open(f"{path}/state.pt"), weights_only=True)["engine"]["model"]["net.0.weight"]
    assert torch.equal(saved, recorder.weights[2])
    assert not torch.equal(saved, recorder.weights[3])
    assert store.resolve("last")[1].endswith(checkpoint_name(1, 8))  # the end of fit waited for the last one


def test_background_write_failure_stops_training_at_the_next_save(tmp_path, monkeypatch):
    real_save = CheckpointStore.save

    def failing_save(self, name, write, meta, directory=None):
        if meta["global_step"] == 2:
            raise OSError("disk full")
        return real_save(self, name, write, meta, directory)

    monkeypatch.setattr(CheckpointStore, "save", failing_save)
    recorder = _Weights()
    with pytest.raises(OSError, match="disk full"):
        _fit(tmp_path, recorder)
    assert max(recorder.weights) == 4  # raised by the save at step 4, on the training thread
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    assert checkpoint_name(0, 2) not in store.committed()
