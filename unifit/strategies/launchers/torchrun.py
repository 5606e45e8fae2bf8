"""Hand the launch to torchrun (torch.distributed.run); unifit starts no cluster of its own.

`command()` is the equivalent torchrun command line; `launch()` runs that same argument list
through torchrun's own entry point in this process, so a failed rank ends in one summary line
and its exit code (2 for a user error) instead of torchrun's traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Iterator

from unifit.strategies.launchers.base import Launcher, LaunchSpec, failure_line, fit_command, terminal_announced
from unifit.strategies.launchers.notices import children

RDZV_READ_TIMEOUT_S = 15


class TorchrunLauncher(Launcher):
    supports_restarts = True

    def torchrun_args(self, spec: LaunchSpec) -> list[str]:
        args = ["--nproc-per-node", str(spec.nproc_per_node)]
        if spec.max_restarts:
            args += ["--max-restarts", str(spec.max_restarts)]
        if spec.nnodes == 1 and not (spec.rdzv_endpoint or spec.master_addr):
            args.append("--standalone")  # a free local port, no rendezvous server to run
        else:
            args += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank)]
            if spec.rdzv_endpoint:
                args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", spec.rdzv_endpoint]
            if spec.master_addr:
                args += ["--master-addr", spec.master_addr]
            if spec.master_port:
                args += ["--master-port", str(spec.master_port)]
        return [*args, *fit_command(spec)]

    def network_args(self, spec: LaunchSpec) -> list[str]:
        """What this node's own network adds to the rendezvous flags (placed before the spec's own)."""
        if not spec.rdzv_endpoint:
            return []
        # store reads give up after 15 s, not torch's 60: an agent whose node lost the network otherwise
        # sits a minute in a read (it asks every 0.1 s how many nodes wait) after its ranks have failed
        conf = [f"read_timeout={RDZV_READ_TIMEOUT_S}"]
        if spec.node_rank == 0 and _endpoint_on_unnamed_nic(spec.rdzv_endpoint):
            conf.append("is_host=1")  # else no node serves the store and every node times out
        args = ["--rdzv-conf", ",".join(conf)]
        local = _address_towards(spec.rdzv_endpoint)
        if local:  # where the other nodes reach this one (its FQDN may resolve to a loopback address)
            args += ["--local-addr", local]
        return args

    def command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", *self.network_args(spec), *self.torchrun_args(spec)]

    def launch(self, spec: LaunchSpec) -> int:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser, run

        args = get_args_parser().parse_args([*self.network_args(spec), *self.torchrun_args(spec)])
        linux = hasattr(os, "waitid") and os.path.isdir("/proc")  # how the watch sees this node's ranks
        stuck = _StuckAgentWatch(spec) if spec.nnodes > 1 and linux else None
        try:
            # the ranks inherit this terminal (UNIFIT_TTY says so all the same) and their share of its CPUs
            with terminal_announced(spec), _agent_logs_quiet():
                run(args)  # torchrun passes SIGTERM/SIGINT on to the ranks and gives them 30 s to stop
        except SignalException as exc:
            print(f"unifit: launch stopped by {exc.sigval.name}; the ranks' own messages are above", file=sys.stderr)
            return 128 + int(exc.sigval)
        except ChildFailedError as exc:
            codes = {rank: failure.exitcode for rank, failure in sorted(exc.failures.items())}
            print(failure_line(codes, "torchrun"), file=sys.stderr)
            # a rank's own exit code (2: user error, 1: training failure), not the signal that ended the rest
            return max([code for code in codes.values() if code > 0], default=1)
        finally:
            if stuck is not None:
                stuck.close()
        return 0


@contextlib.contextmanager
def _agent_logs_quiet() -> Iterator[None]:
    """torchrun's agent logs what unifit says in its own words (the ranks' errors, then one line naming
    the rank that failed); its warnings and errors are shown with UNIFIT_DEBUG=1."""
    if os.environ.get("UNIFIT_DEBUG"):
        yield
        return
    loggers = [logging.getLogger(name) for name in ("torch.distributed.run", "torch.distributed.elastic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class _StuckAgentWatch:
    """Ends this node's launch when a rank has failed and torchrun's agent does not notice.

    The agent reaps a failed rank within its monitor interval (0.1 s), then stops the others. When
    this node has lost its network, the agent instead hangs in a read from the rendezvous store on
    another node (torch 2.x: for minutes, retrying), the failed ranks stay unreaped and the launch
    never ends. A failed rank left unreaped for `grace_s` means exactly that: say so in one line,
    stop this node's remaining ranks and exit with the rank's code.
    """

    def __init__(self, spec: LaunchSpec, grace_s: float = 10.0) -> None:
        self.where = spec.rdzv_endpoint or f"{spec.master_addr}:{spec.master_port or 29500}"
        self.grace_s = grace_s
        self.ranks: dict[int, str] = {}  # child pid -> its RANK, read while it runs
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="unifit-stuck-agent-watch", daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        failed: dict[int, tuple[int, float]] = {}  # pid -> (exit code, first seen)
        while not self._stop.wait(1.0):
            for pid in children(os.getpid()):
                if pid not in self.ranks:
                    self.ranks[pid] = _rank_of(pid)
                try:  # WNOWAIT: look without reaping, the agent still collects it
                    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    continue
                if info is not None:
                    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                    if code != 0:
                        failed.setdefault(pid, (code, time.monotonic()))
            stale = [
                (pid, code)
                for pid, (code, since) in failed.items()
                if time.monotonic() - since > self.grace_s and _is_child(pid)
            ]
            if stale and not self._stop.is_set():
                self._give_up(stale)

    def _give_up(self, stale: list[tuple[int, int]]) -> None:
        listed = ", ".join(f"rank {self.ranks.get(pid, '?')} exit {code}" for pid, code in stale)
        print(
            f"unifit: launch failed ({listed}) and torchrun's agent did not stop within {self.grace_s:.0f} s: the "
            f"rendezvous at {self.where} does not answer (did this node lose its network?); stopping this "
            "node's ranks; the ranks' own errors are above",
            file=sys.stderr,
            flush=True,
        )
        alive = children(os.getpid())
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
            for pid in alive:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(_running(pid) for pid in alive):
                time.sleep(0.1)
        code = next((code for _, code in stale if code > 0), 1)
        os._exit(code)


def _is_child(pid: int) -> bool:
    return pid in children(os.getpid())


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return env.get(b"RANK", b"?").decode()
    except OSError:
        return "?"


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    return host.strip("[]"), int(port) if port.isdigit() else 29400


def _address_towards(endpoint: str) -> str | None:
    """This node's own address on the route to the rendezvous endpoint (no packet is sent), or None
    when that is a loopback (every node on this machine) or the endpoint does not resolve."""
    import ipaddress

    host, port = _split(endpoint)
    try:
        family = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((host, port))
            address = sock.getsockname()[0]
    except (OSError, IndexError):
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


def _endpoint_on_unnamed_nic(endpoint: str) -> bool:
    """Whether the rendezvous endpoint's address is on one of this machine's interfaces although torch's
    own check (the host name's addresses) misses it: a secondary NIC, or a network namespace. torchrun
    would then start no store on this node and every node would time out connecting to it."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    host, _ = _split(endpoint)
    if not host or _matches_machine_hostname(host):
        return False  # torchrun finds it itself (a loopback, the host's own name or address)
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, address in found:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address[0], 0))  # only an address of this machine's interfaces binds
                return True
            except OSError:
                continue
    return False
