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
    fit_args: list[str] = field(default_factory=list)  # passed to `unifit fit` in each process


class Launcher(ABC):
    """Turns a LaunchSpec into one command line and runs it, returning its exit code."""

    def __init__(self, strategy: str = "single") -> None:
        self.strategy = strategy

    @abstractmethod
    def command(self, spec: LaunchSpec) -> list[str]:
        """The command that starts every process of this node."""

    def launch(self, spec: LaunchSpec) -> int:
        return subprocess.call(self.command(spec))


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
