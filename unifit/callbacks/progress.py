"""Progress on rank 0: one summary line per epoch always, a tqdm bar only on a terminal.

Where rank 0's stderr is a terminal (`unifit fit`, ranks started by torchrun or by the TF_CONFIG
launcher, which inherit it) the bar goes there. Under `unifit launch` with horovodrun the ranks
write into pipes that horovodrun prefixes line by line (`[0]<stderr>:`), which garbles a bar
redrawn with carriage returns; the launcher names its terminal in UNIFIT_TTY
(strategies/launchers/base.py), and rank 0 writes the bar, and its summary lines where the
launcher's stdout is that terminal too, straight to that device, in order. Not on a terminal
(CI, logs, `| tee`): no bar, the summary lines only. UNIFIT_TTY=0 turns the bar off, UNIFIT_TTY=1
draws it on stderr whatever stderr is.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import IO, Any

from unifit.frameworks.lr_policy import LRPolicy
from unifit.loop.callback import Callback
from unifit.strategies.launchers.base import TTY_ENV, TTY_HOST_ENV, TTY_STDOUT_ENV

log = logging.getLogger("unifit")
_devices: dict[str, IO[str] | None] = {}  # terminal devices opened by this process (once each)


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


def _launcher_terminal() -> str | None:
    """The terminal device named by the launcher, when this process can write to it."""
    device = os.environ.get(TTY_ENV, "")
    if not device.startswith("/") or os.environ.get(TTY_HOST_ENV) != socket.gethostname():
        return None  # not set, 0/1, or a terminal on another host
    return device if os.access(device, os.W_OK) else None


def _open_device(device: str) -> IO[str] | None:
    if device not in _devices:
        try:
            # O_NOCTTY: a rank in a session without a terminal (horovodrun's) must not acquire this one
            fd = os.open(device, os.O_WRONLY | os.O_NOCTTY)
        except OSError:
            _devices[device] = None
        else:
            if os.isatty(fd):
                _devices[device] = os.fdopen(fd, "w", buffering=1, encoding="utf-8", errors="replace")
            else:
                os.close(fd)
                _devices[device] = None
    return _devices[device]


def bar_wanted() -> bool:
    """Whether this process shows a bar (before anything is opened: every rank builds the callbacks)."""
    choice = os.environ.get(TTY_ENV, "")
    if choice == "0":
        return False
    return choice == "1" or sys.stderr.isatty() or _launcher_terminal() is not None


def bar_stream() -> IO[str] | None:
    """Where the bar goes: stderr when it is a terminal (or UNIFIT_TTY=1), else the launcher's terminal."""
    choice = os.environ.get(TTY_ENV, "")
    if choice == "0":
        return None
    if choice == "1" or sys.stderr.isatty():
        return sys.stderr
    device = _launcher_terminal()
    return _open_device(device) if device else None


def line_stream() -> IO[str]:
    """Where the summary lines go: stdout, or the launcher's terminal when stdout is that terminal
    but reaches it only through the launcher (then the lines and the bar share one stream, in order)."""
    if sys.stdout.isatty() or os.environ.get(TTY_STDOUT_ENV) != "1":
        return sys.stdout
    device = _launcher_terminal()
    stream = _open_device(device) if device else None
    return stream or sys.stdout


class EpochSummary(Callback):
    """Plain lines (fit as logs): the set-up, each epoch's averaged metrics, the final metrics; and, logged, what
    trainer.lr_scaling does to the module's lr (after the batch size finder: said once, with the size trained at)."""

    rank_zero_only = True

    def on_setup(self, ctx: Any) -> None:
        cfg = ctx.config
        adopted = f" (batch_size {cfg.batch_size} from {cfg.batch_size_from})" if cfg.batch_size_from else ""
        self._print(
            f"unifit: strategy {cfg.strategy}, world size {ctx.world_size}, "
            f"global batch {ctx.global_batch}{adopted}, "
            f"{ctx.batches_per_epoch} batches/epoch per rank, {ctx.threads} CPU thread"
            f"{'s' if ctx.threads != 1 else ''} per rank"
        )
        lrs = ctx.current_lrs()
        policy = LRPolicy.of_fit(cfg, ctx.global_batch, ctx.batches_per_epoch)
        line = policy.scaling_line(lrs[0] if lrs else None, ctx.state.global_step)
        if line:
            log.info(line)

    def on_epoch_end(self, ctx: Any) -> None:
        self._print(
            f"epoch {ctx.state.epoch}/{ctx.config.max_epochs}  step {ctx.state.global_step}  "
            f"{format_metrics(ctx.state.metrics)}"
        )

    def on_fit_end(self, ctx: Any) -> None:
        self._print(f"final metrics: {format_metrics(ctx.state.metrics)}")

    @staticmethod
    def _print(line: str) -> None:
        print(line, file=line_stream(), flush=True)


class ProgressBar(Callback):
    """A tqdm bar per epoch, cleared when the epoch ends (its summary line stays); only added
    when rank 0 can draw on a terminal (see `wanted`). It is first drawn when an epoch's first
    step has ended: by then every rank has started the epoch (the step's gradients were averaged
    over all of them), so what they log at an epoch's start (TensorFlow's input pipeline, the
    first step's tracing) is on the screen already, not printed onto the bar."""

    rank_zero_only = True

    def __init__(self, refresh_every_n_steps: int = 20) -> None:
        self.every = refresh_every_n_steps
        self._bar: Any = None
        self._stream: IO[str] | None = None
        self._desc = ""

    @staticmethod
    def wanted(enabled: bool) -> bool:
        return enabled and bar_wanted()

    def on_train_epoch_start(self, ctx: Any) -> None:
        self._close()
        self._stream = bar_stream()
        self._desc = f"epoch {ctx.state.epoch + 1}/{ctx.config.max_epochs}"

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        if self._bar is None:
            if self._stream is None:
                return
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=ctx.batches_per_epoch, desc=self._desc, leave=False, dynamic_ncols=True, file=self._stream
            )
        self._bar.update(1)
        if batch_idx % self.every == 0 and loss is not None:  # None: a skipped batch
            self._bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)

    def on_train_epoch_end(self, ctx: Any) -> None:
        self._close()

    def on_teardown(self, ctx: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
