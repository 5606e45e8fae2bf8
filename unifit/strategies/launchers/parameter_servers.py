"""Start a parameter-server cluster on this host: K parameter servers and N workers (tf.distribute.Server
processes, `python -m unifit.strategies.tf_server`) and the chief, which runs unifit's loop and coordinates.

Each process gets its TF_CONFIG (free ports on 127.0.0.1). The run ends when the chief ends: the servers are
stopped then. A worker that dies is reported and left out (the chief's coordinator goes on without it); a
parameter server that dies makes the chief end with one line naming it, and the launch stops everything.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from unifit.errors import ConfigError
from unifit.strategies.launchers.base import LaunchSpec, death_signal, fit_command, rank_environment
from unifit.strategies.launchers.tf_config import TFConfigLauncher, _free_ports, _stop
from unifit.strategies.tf_server import END_WITH_PARENT

SERVER = [sys.executable, "-m", "unifit.strategies.tf_server"]
CHIEF_GRACE_S = 60.0  # after a parameter server died: how long the chief has to end with its own line


class ParameterServerLauncher(TFConfigLauncher):
    starts_parameter_servers = True

    def check(self, spec: LaunchSpec) -> None:
        super().check(spec)
        if spec.num_ps < 1:
            raise ConfigError(
                f"--num-ps: received {spec.num_ps}; parameter-server needs at least 1 parameter server "
                "(e.g. unifit launch --nproc-per-node 2 --num-ps 1 ...)"
            )
        if spec.nnodes > 1 or spec.hosts:
            raise ConfigError(
                "--nnodes/--hosts: parameter-server starts its cluster on one host for now; on several hosts run "
                "`python -m unifit.strategies.tf_server` for each ps and worker task and `unifit fit` in the chief, "
                "each with its TF_CONFIG (docs/strategies/parameter-server.md)"
            )
        if spec.script:
            raise ConfigError("unifit launch -- SCRIPT.py: parameter-server runs an experiment file (-c exp.yaml)")

    def launch(self, spec: LaunchSpec) -> int:
        self.check(spec)
        ports = _free_ports(1 + spec.nproc_per_node + spec.num_ps)
        addresses = [f"127.0.0.1:{port}" for port in ports]
        cluster = {
            "chief": addresses[:1],
            "worker": addresses[1 : 1 + spec.nproc_per_node],
            "ps": addresses[1 + spec.nproc_per_node :],
        }
        base = rank_environment(ranks_per_node=1 + spec.nproc_per_node, extra=spec.env)

        def started(command: list[str], kind: str, index: int) -> subprocess.Popen:
            task = {"cluster": cluster, "task": {"type": kind, "index": index}, "rpc_layer": "grpc"}
            env = {**base, "TF_CONFIG": json.dumps(task), END_WITH_PARENT: "1"}
            return subprocess.Popen(command, env=env)

        servers = {("ps", i): started(SERVER, "ps", i) for i in range(spec.num_ps)}
        servers.update({("worker", i): started(SERVER, "worker", i) for i in range(spec.nproc_per_node)})
        chief = started([sys.executable, *fit_command(spec)], "chief", 0)
        received: list[int] = []

        def forward(signum: int, frame: object) -> None:  # the chief stops at a step boundary, checkpointed
            received.append(signum)
            if chief.poll() is None:
                chief.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = _wait(chief, servers)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _stop([chief, *servers.values()], 10.0)
        return 128 + received[0] if received and code != 0 else code


def _wait(chief: subprocess.Popen, servers: dict[tuple[str, int], subprocess.Popen]) -> int:
    """The chief's exit code. Servers that end are reported once (also when the chief ended first); a parameter
    server that ends gives the chief CHIEF_GRACE_S to end with its own line, then the launch ends it."""
    reported: set[tuple[str, int]] = set()
    lost_ps_at: float | None = None
    while True:
        chief_ended = chief.poll() is not None
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
                lost_ps_at = lost_ps_at or time.time()
                print(
                    f"unifit: error: parameter server {index} ended (exit {server.returncode}); the run cannot go on "
                    "without its variables: restart the job with --ckpt-path auto",
                    file=sys.stderr,
                )
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
        if all(servers[key].poll() is not None for key in servers if key[0] == "worker"):
            print("unifit: error: every worker ended; stopping the chief", file=sys.stderr)
            return 1
        time.sleep(0.2)
