"""Hand the launch to horovodrun; unifit starts no cluster of its own.

`command()` is the equivalent horovodrun command line (gloo, no MPI needed); `launch()` runs
that same argument list through horovodrun's own entry point in this process, so a failed rank
ends in one summary line with its exit code. horovodrun starts the processes of every host from
the first host (over ssh for remote hosts), so only node 0 launches.
"""

from __future__ import annotations

import os
import re
import sys

from unifit.errors import ConfigError
from unifit.strategies.launchers.base import Launcher, LaunchSpec, failure_line, fit_command, terminal_announced


class HorovodrunLauncher(Launcher):
    def horovodrun_args(self, spec: LaunchSpec) -> list[str]:
        hosts = spec.hosts or ["localhost"]
        if spec.nnodes != len(hosts):
            raise ConfigError(
                f"--nnodes {spec.nnodes}: horovodrun needs every host's name; give --hosts h1,h2,... "
                "(it starts all hosts' processes from the first one)"
            )
        if spec.node_rank != 0:
            raise ConfigError(
                f"--node-rank {spec.node_rank}: horovodrun starts the processes of every host from the "
                f"first one ({hosts[0]}, over ssh); run 'unifit launch' there only"
            )
        n = spec.nproc_per_node
        slots = ",".join(f"{host}:{n}" for host in hosts)
        return ["-np", str(n * len(hosts)), "-H", slots, "--gloo", sys.executable, *fit_command(spec)]

    def command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, "-m", "horovod.runner.launch", *self.horovodrun_args(spec)]

    def launch(self, spec: LaunchSpec) -> int:
        from unifit.strategies.horovod.strategy import import_horovod

        self.check(spec)
        import_horovod("runner.launch", "HOROVOD_WITH_PYTORCH")  # a missing Horovod says how to install it
        from horovod.runner.launch import run_commandline

        # horovodrun's gloo_built() check imports horovod.tensorflow in a forked child, which would print
        # TensorFlow's start-up log block into a torch job; unifit's Keras engine sets the same default
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        argv, sys.argv = sys.argv, ["horovodrun", *self.horovodrun_args(spec)]
        try:
            # the ranks get pipes (each line prefixed, `[0]<stderr>:`) in a session of their own; rank 0
            # draws its bar and epoch lines on the terminal named by UNIFIT_TTY instead (callbacks/progress.py)
            with terminal_announced(spec):
                run_commandline()
        except RuntimeError as exc:  # horovodrun stopped the other ranks after the first failure
            found = re.search(r"Process name: (\S+)\s+Exit code: (-?\d+)", str(exc))
            rank, code = (found.group(1), int(found.group(2))) if found else ("?", 1)
            print(failure_line({rank: code}, "horovodrun"), file=sys.stderr)
            return code if code > 0 else 1
        finally:
            sys.argv = argv
        return 0
