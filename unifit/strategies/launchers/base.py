"""Launchers start the processes a strategy runs in; they never run training themselves."""

from __future__ import annotations

import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from unifit.errors import ConfigError


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
    fit_args: list[str] = field(default_factory=list)  # passed to `unifit fit` in each process


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
        return run_forwarding_signals(self.command(spec))

    def check(self, spec: LaunchSpec) -> None:
        if spec.max_restarts and not self.supports_restarts:
            raise ConfigError(
                f"--max-restarts {spec.max_restarts}: strategy '{self.strategy}' has no restarting launcher (only "
                "torchrun's elastic agent restarts ranks: ddp, smddp-like); restart the whole command instead "
                "(e.g. a Kubernetes restartPolicy or a shell loop) with --ckpt-path auto")


def run_forwarding_signals(command: list[str]) -> int:
    """Popen + wait, forwarding SIGTERM and SIGINT to the child; 128 + signal when one came."""
    import signal

    child = subprocess.Popen(command)
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


def fit_command(spec: LaunchSpec) -> list[str]:
    """What each started process runs."""
    return ["-m", "unifit", "fit", *spec.fit_args]


class SingleProcessLauncher(Launcher):
    """Strategies that run in exactly one process (single, mirrored): no launcher in between."""

    def command(self, spec: LaunchSpec) -> list[str]:
        if spec.nproc_per_node != 1 or spec.nnodes != 1:
            raise ConfigError(
                f"--nproc-per-node {spec.nproc_per_node} --nnodes {spec.nnodes}: strategy '{self.strategy}' runs one "
                "process (mirrored uses every local device from it); for several processes use ddp (PyTorch) or mwms (Keras)"
            )
        return [sys.executable, *fit_command(spec)]
