"""Errors unifit raises on purpose.

`UnifitError` and its subclasses are *user* errors: the command line prints their one-line
message and exits with `exit_code`, without a traceback (set UNIFIT_DEBUG=1 to see one).
"""

from __future__ import annotations


class UnifitError(Exception):
    """A problem the user can fix; the message says what was received and how to fix it."""

    exit_code = 2


class ConfigError(UnifitError):
    """Invalid experiment configuration (YAML file, overrides or Trainer arguments)."""


class MissingExtraError(UnifitError, ImportError):
    """An optional dependency is missing; the message names the `pip install` that fixes it."""


class CheckpointNotFoundError(UnifitError):
    """A checkpoint was asked for (e.g. `--ckpt-path last`) but none is committed there."""


class DistributedError(UnifitError):
    """Ranks disagree or a collective could not complete (e.g. save called on one rank only)."""

    exit_code = 1


class NonFiniteLossError(UnifitError):
    """Training stopped on every rank because the loss became NaN or infinite."""

    exit_code = 1


def error_prefix(rank: int) -> str:
    """How a rank's one-line error starts: rank 0 speaks for the job, the others name themselves."""
    return f"unifit: error (rank {rank}): " if rank else "unifit: error: "


def first_line(exc: BaseException) -> str:
    """The first line of an exception from a library (gloo, Horovod), for a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Preempted(UnifitError):
    """A rank received SIGTERM or SIGINT: every rank stopped at the same step (after committing a
    checkpoint) and exits with 128 + the signal's number, the shell's code for "ended by that signal"."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
