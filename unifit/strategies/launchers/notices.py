"""Preemption notices sent to `unifit launch` itself go on to its ranks.

SLURM's `--signal=USR2@90` (submitit's) or `USR1` (Lightning's requeue) reaches the launch when it is the job
step's task (`srun unifit launch`). No launcher underneath passes these on (torchrun's agent and horovodrun
handle SIGTERM and SIGINT only, and the default action of SIGUSR1/2 ends a process), so the launch sends the
notice to every process below it that handles it, which are unifit's ranks (their Preemption callback stops
them with a checkpoint); a process that does not handle it (horovodrun, mpirun, a shell) is left alone. Linux
says which signals a process catches in /proc/PID/status (SigCgt).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("unifit")

NOTICES = (signal.SIGUSR1, signal.SIGUSR2)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc (empty where there is none)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (empty where there is none)."""
    found: list[int] = []
    stack = [pid]
    while stack:
        below = children(stack.pop())
        found += below
        stack += below
    return found


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler of its own for `sig`."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (sig - 1) & 1)


@contextmanager
def notices_passed_on() -> Iterator[None]:
    """While the launch runs, SIGUSR1/SIGUSR2 to this process go on to the processes below it that handle them."""
    if not os.path.isdir("/proc") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        ranks = [pid for pid in descendants(os.getpid()) if catches(pid, signum)]
        for pid in ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        name = signal.Signals(signum).name
        if ranks:
            log.warning("unifit launch: %s passed on to %d rank process(es)", name, len(ranks))
        else:
            log.warning("unifit launch: %s received, but no process below handles it yet (starting up)", name)

    previous = {sig: signal.signal(sig, forward) for sig in NOTICES}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
