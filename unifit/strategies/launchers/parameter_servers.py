"""Start a parameter-server cluster: on each host K parameter servers and N workers (tf.distribute.Server
processes, `python -m unifit.strategies.tf_server`), and on the first host the chief, which coordinates: `unifit fit`
of an experiment, or a user's script (`-- SCRIPT.py`) with TF_CONFIG's task "chief", where TensorFlow's own
`TFConfigClusterResolver` + `ParameterServerStrategy` or unifit's `Trainer(strategy="parameter-server")` connect.

One host: free ports on 127.0.0.1. Several hosts (`--hosts h0,h1 --node-rank R`, as for mwms, or SageMaker's
SM_HOSTS): every node computes the same cluster from the host list and a base port (--master-port, default 23456):
the chief at h0:base, then each host's workers and parameter servers on the next ports, numbered across hosts so
no two tasks share a port even when two "hosts" are one machine. Each node starts its own tasks.

The run ends when the chief ends: the first host's launch stops its servers then, and every other host's launch
stops its own once the chief's address stops answering. A worker that dies is reported and left out (the chief's
coordinator goes on without it); a parameter server that dies makes the chief end with one line naming it, and
the launches stop everything.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from unifit.errors import ConfigError
from unifit.strategies.launchers.base import LaunchSpec, death_signal, fit_command, rank_environment
from unifit.strategies.launchers.tf_config import TFConfigLauncher, _free_ports, _stop
from unifit.strategies.tf_server import END_WITH_PARENT

SERVER = [sys.executable, "-m", "unifit.strategies.tf_server"]
CHIEF_GRACE_S = 60.0  # after a parameter server died: how long the chief has to end with its own line
CHIEF_START_S = 600.0  # another host's launch: how long the chief may take to answer the first time
DEFAULT_BASE_PORT = 23456
Task = tuple[str, int]  # ("worker" or "ps", index across the cluster)


def layout(spec: LaunchSpec) -> tuple[dict[str, list[str]], list[Task]]:
    """The cluster (chief, worker and ps addresses, the same on every node) and the tasks this node starts."""
    n, k = spec.nproc_per_node, spec.num_ps
    hosts = spec.hosts or ["127.0.0.1"]
    if spec.hosts:
        base = spec.master_port or DEFAULT_BASE_PORT
        ports = list(range(base, base + 1 + len(hosts) * (n + k)))
    else:
        ports = _free_ports(1 + n + k)
    per_host = [ports[1 + h * (n + k) : 1 + (h + 1) * (n + k)] for h in range(len(hosts))]
    cluster = {
        "chief": [f"{hosts[0]}:{ports[0]}"],
        "worker": [f"{host}:{port}" for host, own in zip(hosts, per_host) for port in own[:n]],
        "ps": [f"{host}:{port}" for host, own in zip(hosts, per_host) for port in own[n:]],
    }
    h = spec.node_rank
    return cluster, [("ps", h * k + j) for j in range(k)] + [("worker", h * n + i) for i in range(n)]


class ParameterServerLauncher(TFConfigLauncher):
    starts_parameter_servers = True

    def check(self, spec: LaunchSpec) -> None:
        super().check(spec)
        if spec.num_ps < 1:
            raise ConfigError(
                f"--num-ps: received {spec.num_ps}; parameter-server needs at least 1 parameter server "
                "(e.g. unifit launch --nproc-per-node 2 --num-ps 1 ...)"
            )
        if spec.nnodes > 1 and not spec.hosts:
            raise ConfigError(
                f"--nnodes {spec.nnodes}: parameter-server addresses every host; give them with --hosts h0,h1,... "
                "and this host's place with --node-rank (the same command on each host)"
            )
        if spec.hosts and not 0 <= spec.node_rank < len(spec.hosts):
            raise ConfigError(
                f"--node-rank {spec.node_rank}: --hosts lists {len(spec.hosts)} hosts; give 0 to {len(spec.hosts) - 1}"
            )

    def launch(self, spec: LaunchSpec) -> int:
        self.check(spec)
        cluster, mine = layout(spec)
        # the workers and the chief share this host's CPUs (a parameter server does little computing)
        base = rank_environment(ranks_per_node=spec.nproc_per_node + (spec.node_rank == 0), extra=spec.env)

        def started(command: list[str], kind: str, index: int) -> subprocess.Popen:
            task = {"cluster": cluster, "task": {"type": kind, "index": index}, "rpc_layer": "grpc"}
            env = {**base, "TF_CONFIG": json.dumps(task), END_WITH_PARENT: "1"}
            return subprocess.Popen(command, env=env)

        servers = {task: started(SERVER, *task) for task in mine}
        chief = started([sys.executable, *fit_command(spec)], "chief", 0) if spec.node_rank == 0 else None
        received: list[int] = []

        def forward(signum: int, frame: object) -> None:  # the chief stops at a step boundary, checkpointed
            received.append(signum)
            if chief is not None and chief.poll() is None:
                chief.send_signal(signum)

        try:
            with _on_stop_signals(forward):
                if chief is not None:
                    code = _wait(chief, servers, every_worker=len(cluster["worker"]) == spec.nproc_per_node)
                else:  # another host: its servers serve on until the chief has checkpointed and ended
                    code = _serve_until_the_chief_ends(cluster["chief"][0], servers, received)
        finally:
            if chief is not None:
                _stop([chief], 10.0)
            _kill(list(servers.values()))
        return 128 + received[0] if received and code != 0 else code


def _report_ended(servers: dict[Task, subprocess.Popen], reported: set[Task]) -> bool:
    """Print one line for each server that ended since the last call; True when a parameter server did."""
    lost_ps = False
    for (kind, index), server in servers.items():
        if server.poll() is None or (kind, index) in reported:
            continue
        reported.add((kind, index))
        if kind == "worker":
            print(
                f"unifit: worker {index} ended (exit {server.returncode}); the coordinator runs its steps on the "
                "other workers",
                file=sys.stderr,
            )
        else:
            lost_ps = True
            print(
                f"unifit: error: parameter server {index} ended (exit {server.returncode}); the run cannot go on "
                "without its variables: restart the job with --ckpt-path auto",
                file=sys.stderr,
            )
    return lost_ps


def _wait(chief: subprocess.Popen, servers: dict[Task, subprocess.Popen], every_worker: bool = True) -> int:
    """The chief's exit code. Servers that end are reported once (also when the chief ended first); a parameter
    server that ends gives the chief CHIEF_GRACE_S to end with its own line, then the launch ends it. With
    `every_worker` (one host), the chief is stopped when every worker is gone; across hosts its watchdog does that."""
    reported: set[Task] = set()
    lost_ps_at: float | None = None
    while True:
        chief_ended = chief.poll() is not None
        if _report_ended(servers, reported):
            lost_ps_at = lost_ps_at or time.time()
        if chief_ended:
            sig = death_signal(chief.returncode)
            if sig is not None:
                print(
                    f"unifit: error: the chief (the coordinator) died (killed by {sig.name}); stopping the workers "
                    "and parameter servers: restart the job with --ckpt-path auto",
                    file=sys.stderr,
                )
            return chief.returncode if chief.returncode >= 0 else 1
        if lost_ps_at is not None and time.time() - lost_ps_at > CHIEF_GRACE_S:
            print(
                f"unifit: error: the chief did not end within {CHIEF_GRACE_S:g}s of losing a parameter server; "
                "stopping it",
                file=sys.stderr,
            )
            return 1
        if every_worker and all(servers[key].poll() is not None for key in servers if key[0] == "worker"):
            print("unifit: error: every worker ended; stopping the chief", file=sys.stderr)
            return 1
        time.sleep(0.2)


def _serve_until_the_chief_ends(chief: str, servers: dict[Task, subprocess.Popen], signalled: list[int]) -> int:
    """Another host's launch: keep this host's servers until the chief's address (which its coordinator listens
    on) stops answering, reporting servers that end; 0, or 1 when one of this host's parameter servers ended.
    After a SIGTERM or SIGINT (in `signalled`) the chief has CHIEF_GRACE_S to checkpoint and end."""
    reported: set[Task] = set()
    lost_ps, seen, started, silent = False, False, time.time(), 0
    signalled_at: float | None = None
    while True:
        lost_ps = _report_ended(servers, reported) or lost_ps
        answered = _answers(chief)
        seen, silent = seen or answered, 0 if answered else silent + 1
        if seen and silent >= 3:
            print(f"unifit: the chief at {chief} ended; stopping this host's servers", file=sys.stderr)
            return 1 if lost_ps else 0
        if signalled and signalled_at is None:
            signalled_at = time.time()
            print(
                f"unifit: received {signal.Signals(signalled[0]).name}: this host's servers serve on until the chief "
                f"has checkpointed and ended (at most {CHIEF_GRACE_S:g}s)",
                file=sys.stderr,
            )
        if signalled_at is not None and time.time() - signalled_at > CHIEF_GRACE_S:
            return 128 + signalled[0]
        if not seen and time.time() - started > CHIEF_START_S:
            print(
                f"unifit: error: the chief at {chief} did not answer within {CHIEF_START_S:g}s; start the same "
                "command with --node-rank 0 on the first host of --hosts",
                file=sys.stderr,
            )
            return 1
        if lost_ps and all(s.poll() is not None for s in servers.values()):
            return 1
        time.sleep(1.0)


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return True
    except OSError:
        return False


def serve_task(tf_config: str) -> int:
    """Serve this process's TF_CONFIG task (a worker or parameter server of a cluster that someone else started,
    e.g. SageMaker's `parameter_server` distribution) until the chief ends, as another host's launch does."""
    config = json.loads(tf_config)
    task, cluster = config["task"], config["cluster"]
    chief = (cluster.get("chief") or cluster.get("master"))[0]
    env = {**rank_environment(ranks_per_node=1), "TF_CONFIG": tf_config, END_WITH_PARENT: "1"}
    server = subprocess.Popen(SERVER, env=env)
    received: list[int] = []
    try:
        with _on_stop_signals(lambda signum, frame: received.append(signum)):
            return _serve_until_the_chief_ends(
                chief, {(str(task["type"]).lower(), int(task["index"])): server}, received
            )
    finally:
        _kill([server])


@contextmanager
def _on_stop_signals(handler: Any) -> Iterator[None]:
    """SIGTERM and SIGINT call `handler` meanwhile."""
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, restored in previous.items():
            signal.signal(sig, restored)


def _kill(servers: list[subprocess.Popen]) -> None:
    """Servers ignore SIGTERM (see tf_server) and have nothing to save."""
    for server in servers:
        if server.poll() is None:
            server.kill()
        server.wait()
