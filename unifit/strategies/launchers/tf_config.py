"""Start MultiWorkerMirroredStrategy workers: one process each, with its own TF_CONFIG.

One host: free ports on 127.0.0.1. Several hosts (`--hosts h1,h2 --node-rank R`, or SageMaker's
SM_HOSTS): worker i of host h listens on h:(base port + i), and this node starts its own workers.
A user-provided TF_CONFIG is respected by `unifit fit` itself; this launcher writes one only for
the workers it starts. When one worker fails, the others are stopped, so nothing hangs.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

from unifit.strategies.launchers.base import Launcher, LaunchSpec, failure_line, fit_command, rank_environment


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class TFConfigLauncher(Launcher):
    def cluster(self, spec: LaunchSpec) -> tuple[list[str], list[int]]:
        """(all worker addresses, indices of the workers this node starts)."""
        n = spec.nproc_per_node
        if spec.hosts:
            base = spec.master_port or 23456
            workers = [f"{host}:{base + i}" for host in spec.hosts for i in range(n)]
            return workers, list(range(spec.node_rank * n, (spec.node_rank + 1) * n))
        return [f"127.0.0.1:{port}" for port in _free_ports(n)], list(range(n))

    def command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, *fit_command(spec)]

    def launch(self, spec: LaunchSpec) -> int:
        self.check(spec)
        workers, mine = self.cluster(spec)
        procs = []
        # the workers inherit this terminal (UNIFIT_TTY says so all the same) and their share of its CPUs
        base = rank_environment(ranks_per_node=len(mine), extra=spec.env)
        for index in mine:
            tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
            env = {**base, "TF_CONFIG": json.dumps(tf_config)}
            procs.append(subprocess.Popen(self.command(spec), env=env))
        received: list[int] = []

        def forward(signum: int, frame: object) -> None:  # each worker stops at a step boundary, checkpointed
            received.append(signum)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = _wait_all(dict(zip(mine, procs)), signalled=received)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 128 + received[0] if received and code != 0 else code


def _wait_all(workers: dict[int, subprocess.Popen], grace_s: float = 10.0, signalled: list[int] | None = None) -> int:
    """Wait for every worker (by its index, which is its rank); on the first failure stop the rest and
    return its exit code (after a forwarded signal the others get 30 s: they are committing a checkpoint)."""
    procs = list(workers.values())
    try:
        while True:
            codes = {index: p.poll() for index, p in workers.items()}
            failed = {index: code for index, code in codes.items() if code not in (None, 0)}
            if failed:
                _stop(procs, 30.0 if signalled else grace_s)
                print(failure_line(failed, "unifit launch"), file=sys.stderr)
                first = next(iter(failed.values()))
                return first if first > 0 else 1
            if all(c == 0 for c in codes.values()):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs, grace_s)
        return 130


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
