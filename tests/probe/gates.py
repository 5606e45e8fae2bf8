"""A callback that holds training at chosen epoch ends until the test says go, by creating a file.

Tests that act while a run trains (stop S3, kill a rank, ...) use it instead of making epochs
slow and hoping the run lasts long enough: at the end of epoch E (after the built-in callbacks,
so that epoch's checkpoint and TensorBoard scalars are written) the callback creates
`<dir>/held_<E>` and waits until `<dir>/go_<E>` exists. A gate that is never opened fails the
run after `timeout_s` rather than hanging it.
"""

from __future__ import annotations

import os
import time

import unifit


def held(directory: str | os.PathLike, epoch: int) -> str:
    return os.path.join(directory, f"held_{epoch}")


def go(directory: str | os.PathLike, epoch: int) -> str:
    return os.path.join(directory, f"go_{epoch}")


def open_gate(directory: str | os.PathLike, epoch: int) -> None:
    with open(go(directory, epoch), "w"):
        pass


class Gates(unifit.Callback):
    def __init__(self, directory: str, epochs: list[int], timeout_s: float = 120.0) -> None:
        self.directory, self.epochs, self.timeout_s = directory, set(epochs), timeout_s

    def on_epoch_end(self, ctx) -> None:
        epoch = ctx.state.epoch
        if epoch not in self.epochs:
            return
        os.makedirs(self.directory, exist_ok=True)
        with open(held(self.directory, epoch), "w"):
            pass
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(go(self.directory, epoch)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"gate after epoch {epoch} was not opened within {self.timeout_s:g}s")
            time.sleep(0.05)
