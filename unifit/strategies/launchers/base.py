"""Launchers start the processes a strategy runs in; they never run training themselves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from unifit.errors import ConfigError

# `unifit launch --strategy NAME -- SCRIPT.py` tells the script's processes the strategy they were started for
LAUNCH_STRATEGY_ENV = "UNIFIT_LAUNCH_STRATEGY"


@dataclass(frozen=True)
class LaunchSpec:
    """What `unifit launch` was asked for."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    hosts: list[str] | None = None  # for launchers that address every host (TF_CONFIG workers)
    max_restarts: int = 0  # restart the whole group this many times after a rank fails (torchrun's elastic agent)
    num_ps: int = 0  # parameter servers to start beside the workers (parameter-server only)
    fit_args: list[str] = field(default_factory=list)  # passed to `unifit <command>` in each process
    command: str = "fit"  # or validate / test / predict
    script: list[str] = field(default_factory=list)  # or: a Python script (and its arguments) each process runs
    env: dict[str, str] = field(default_factory=dict)  # more environment for the started processes


class Launcher(ABC):
    """Turns a LaunchSpec into one command line and runs it, returning its exit code."""

    def __init__(self, strategy: str = "single") -> None:
        self.strategy = strategy

    @abstractmethod
    def command(self, spec: LaunchSpec) -> list[str]:
        """The command that starts every process of this node."""

    supports_restarts = False

    def launch(self, spec: LaunchSpec) -> int:
        """Run the command; SIGTERM/SIGINT sent to `unifit launch` are passed on to it (each rank then
        stops at a step boundary with a checkpoint) and the launch exits with 128 + the signal's number."""
        self.check(spec)
        return run_forwarding_signals(self.command(spec), env=rank_environment(extra=spec.env))

    starts_parameter_servers = False

    def check(self, spec: LaunchSpec) -> None:
        if spec.num_ps and not self.starts_parameter_servers:
            raise ConfigError(
                f"--num-ps {spec.num_ps}: strategy '{self.strategy}' has no parameter servers; use "
                "--trainer.strategy parameter-server (Keras modules), or leave --num-ps out"
            )
        if spec.max_restarts and not self.supports_restarts:
            raise ConfigError(
                f"--max-restarts {spec.max_restarts}: strategy '{self.strategy}' has no restarting launcher (only "
                "torchrun's elastic agent restarts ranks: ddp, smddp-like, fsdp, model-parallel); restart the whole "
                "command instead "
                "(e.g. a Kubernetes restartPolicy or a shell loop) with --ckpt-path auto"
            )


def run_forwarding_signals(command: list[str], env: Mapping[str, str] | None = None) -> int:
    """Popen + wait, forwarding SIGTERM and SIGINT to the child; 128 + signal when one came."""
    import signal

    child = subprocess.Popen(command, env=env)
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received and code != 0 else code


# What launchers stop the remaining ranks with, and what a preempted rank exits with (128 + it): a rank
# ended by one of these was stopped, it did not die.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def death_signal(code: int) -> signal.Signals | None:
    """The signal that killed a process (kill -9, the OOM killer, a segfault) from its exit code:
    negative from Popen and torchrun, 128 + N through a shell (horovodrun); None for a plain exit."""
    number = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        sig = signal.Signals(number)
    except ValueError:
        return None
    return None if sig in _STOP_SIGNALS else sig


def failure_line(codes: Mapping[int | str, int], stopped_by: str) -> str:
    """One line for a failed launch, naming the rank that died when one was killed: the others then
    fail only because it is gone (a reset connection, a timed-out collective), which names nobody."""
    listed = ", ".join(f"rank {rank} exit {code}" for rank, code in codes.items())
    killed = [(rank, sig) for rank, code in codes.items() if (sig := death_signal(code))]
    if killed:
        rank, sig = killed[0]
        return (
            f"unifit: rank {rank} died (killed by {sig.name}); the other ranks were stopped by {stopped_by} "
            f"({listed}); the ranks' own errors are above"
        )
    return f"unifit: launch failed ({listed}, the others stopped by {stopped_by}); the ranks' own errors are above"


def fit_command(spec: LaunchSpec) -> list[str]:
    """What each started process runs (after the Python interpreter): unifit's command, or the script (run by
    `unifit script`, which answers unifit's refusals in one line, as for an experiment file)."""
    if spec.script:
        return ["-m", "unifit", "script", *spec.script]
    return ["-m", "unifit", spec.command, *spec.fit_args]


# How `unifit launch` tells the processes it starts about the terminal it runs in. A launcher may
# hand its ranks pipes instead of the terminal (horovodrun prefixes every line, `[0]<stderr>:`,
# and starts them in a new session, without a controlling terminal), so rank 0 could not see
# that a progress bar is wanted, nor draw one that is not mangled on the way.
TTY_ENV = "UNIFIT_TTY"  # the device the launcher's stderr is on (/dev/pts/3); or 1 / 0 set by the user
TTY_HOST_ENV = "UNIFIT_TTY_HOST"  # the host that device is on (a rank elsewhere draws no bar)
TTY_STDOUT_ENV = "UNIFIT_TTY_STDOUT"  # "1": the launcher's stdout is that terminal too
TTY_KEYS = (TTY_ENV, TTY_HOST_ENV, TTY_STDOUT_ENV)


def terminal_of(stream: Any) -> str | None:
    """The terminal device a stream writes to, or None (a pipe, a file, no fileno)."""
    try:
        fd = stream.fileno()
        return os.ttyname(fd) if os.isatty(fd) else None
    except (AttributeError, OSError, ValueError):
        return None


def threads_per_rank(ranks_per_node: int) -> int:
    """CPU threads each of this node's ranks computes with: the CPUs this process may use, shared out."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, ranks_per_node))


def rank_environment(
    base: Mapping[str, str] | None = None, ranks_per_node: int = 1, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """`base` (os.environ) for the ranks: OMP_NUM_THREADS (unless the user set it) sharing this node's
    CPUs out between its `ranks_per_node` ranks, so they do not oversubscribe them (torchrun would set 1
    and print a warning banner), and the UNIFIT_TTY variables: set when this process's stderr is a
    terminal, removed when not (a value inherited from an outer launch is stale); a user's own
    UNIFIT_TTY=1 (always a bar) or 0 (never) passes through unchanged; `extra` on top; TF_CPP_MIN_LOG_LEVEL 2."""
    env = dict(os.environ if base is None else base)
    env.pop(LAUNCH_STRATEGY_ENV, None)  # a launch inside a launched script says its own
    env.update(extra or {})
    if ranks_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(ranks_per_node)))
    # TensorFlow's start-up INFO/WARNING lines, before unifit's engine could quiet them (a launched script
    # imports TensorFlow first); as the Keras engine sets it for `unifit fit` (the user's value wins)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if env.get(TTY_ENV) in ("0", "1"):
        return env
    for key in TTY_KEYS:
        env.pop(key, None)
    device = terminal_of(sys.stderr)
    if device:
        env[TTY_ENV] = device
        env[TTY_HOST_ENV] = socket.gethostname()
        if terminal_of(sys.stdout) == device:
            env[TTY_STDOUT_ENV] = "1"
    return env


@contextmanager
def terminal_announced(spec: LaunchSpec) -> Iterator[None]:
    """For launchers that start the ranks from this process with os.environ (torchrun, horovodrun):
    rank_environment()'s variables in os.environ while they run, the previous values afterwards."""
    keys = (*TTY_KEYS, "OMP_NUM_THREADS", *spec.env)
    saved = {key: os.environ.get(key) for key in keys}
    env = rank_environment(ranks_per_node=spec.nproc_per_node, extra=spec.env)
    for key in keys:
        _set_env(key, env.get(key))
    try:
        yield
    finally:
        for key, value in saved.items():
            _set_env(key, value)


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


class SingleProcessLauncher(Launcher):
    """Strategies that run in exactly one process (single, mirrored): no launcher in between."""

    def command(self, spec: LaunchSpec) -> list[str]:
        if spec.nproc_per_node != 1 or spec.nnodes != 1:
            raise ConfigError(
                f"--nproc-per-node {spec.nproc_per_node} --nnodes {spec.nnodes}: strategy '{self.strategy}' runs one "
                "process (mirrored uses every local device from it); for several processes use ddp (PyTorch) or mwms (Keras)"
            )
        return [sys.executable, *fit_command(spec)]
