"""Simulated hosts for multi-host tests: one network namespace per host, joined by a bridge.

Each host gets its own namespace with one interface, `eth0`, holding its own address
(10.77.0.1, 10.77.0.2, ...); the hosts' veth peers are enslaved to a bridge living in a third
("switch") namespace, so nothing is added to the machine's own network and every name is unique
per cluster (a rerun, or a crashed earlier run, never collides). The file system is shared, as
on a cluster with a shared directory. Needs root and `ip netns`; see `unavailable()`.

    with Cluster(2) as cluster:
        proc = cluster.popen(0, [sys.executable, "-m", "unifit", "launch", ...], log=tmp_path / "h0.log")
        cluster.cut(1)  # host 1 loses its network (link down inside its namespace)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

IFNAME = "eth0"  # the interface's name inside every host namespace (GLOO_SOCKET_IFNAME)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why these tests cannot run here (not root, no `ip netns`), or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command (ip netns)"
    name = f"ufprobe{uuid.uuid4().hex[:6]}"
    try:
        made = _ip("netns", "add", name, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns add` failed: {exc}"
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class Cluster:
    """`n` simulated hosts on one bridge; `remove()` (or leaving the `with`) kills what runs in them."""

    def __init__(self, n: int = 2, subnet: str = "10.77.0", own_hosts_file: bool = False) -> None:
        """own_hosts_file: in each host, this machine's host name resolves to that host's address (an
        /etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts), as on real machines;
        without it every host's name resolves as on this machine (often to a loopback address)."""
        tag = uuid.uuid4().hex[:6]
        self.switch = f"uf{tag}-sw"
        self.namespaces = [f"uf{tag}-h{i}" for i in range(n)]
        self.addresses = [f"{subnet}.{i + 1}" for i in range(n)]
        self.own_hosts_file = own_hosts_file
        self.procs: list[subprocess.Popen] = []

    # ---- set-up and removal ----------------------------------------------------------------
    def create(self) -> Cluster:
        try:
            for ns in (self.switch, *self.namespaces):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
                port = f"p{i}"
                _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", IFNAME, "up")
                if self.own_hosts_file:
                    etc = Path("/etc/netns") / ns
                    etc.mkdir(parents=True, exist_ok=True)
                    (etc / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
        except Exception:
            self.remove()
            raise
        return self

    def pids(self, host: int | None = None) -> list[int]:
        """Processes running inside one host's namespace (or any of them)."""
        found: list[int] = []
        for ns in self.namespaces if host is None else [self.namespaces[host]]:
            out = _ip("netns", "pids", ns, check=False).stdout
            found += [int(p) for p in out.split()]
        return found

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def remove(self) -> None:
        self.kill_all()
        for ns in (*self.namespaces, self.switch):
            for _ in range(5):  # a namespace with a process still exiting cannot be deleted yet
                if _ip("netns", "del", ns, check=False).returncode == 0 or ns not in self.list():
                    break
                time.sleep(0.2)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        try:
            Path("/etc/netns").rmdir()  # only when empty: other clusters may be running
        except OSError:
            pass

    @staticmethod
    def list() -> list[str]:
        return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]

    def __enter__(self) -> Cluster:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---- running things on a host ----------------------------------------------------------
    def prefix(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host]]

    def run(self, host: int, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(host), *cmd], check=check, capture_output=True, text=True, timeout=30)

    def popen(
        self, host: int, cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | str | None = None
    ) -> subprocess.Popen:
        """Start `cmd` on `host` in a session of its own, stdout and stderr into `log`."""
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [*self.prefix(host), *cmd],
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
            )
        self.procs.append(proc)
        return proc

    def cut(self, host: int) -> None:
        """The host loses its network: its link goes down inside its namespace."""
        _ip("-n", self.namespaces[host], "link", "set", IFNAME, "down")
