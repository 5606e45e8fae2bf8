"""Hand the launch to torchrun (torch.distributed.run); unifit starts no cluster of its own.

`command()` is the equivalent torchrun command line; `launch()` runs that same argument list
through torchrun's own entry point in this process, so a failed rank ends in one summary line
and its exit code (2 for a user error) instead of torchrun's traceback.
"""

from __future__ import annotations

import sys

from unifit.strategies.launchers.base import LaunchSpec, Launcher, failure_line, fit_command, terminal_announced


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

    def command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", *self.torchrun_args(spec)]

    def launch(self, spec: LaunchSpec) -> int:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser, run

        args = get_args_parser().parse_args(self.torchrun_args(spec))
        try:
            with terminal_announced():  # the ranks inherit this terminal; UNIFIT_TTY says so all the same
                run(args)  # torchrun passes SIGTERM/SIGINT on to the ranks and gives them 30 s to stop
        except SignalException as exc:
            print(f"unifit: launch stopped by {exc.sigval.name}; the ranks' own messages are above", file=sys.stderr)
            return 128 + int(exc.sigval)
        except ChildFailedError as exc:
            codes = {rank: failure.exitcode for rank, failure in sorted(exc.failures.items())}
            print(failure_line(codes, "torchrun"), file=sys.stderr)
            # a rank's own exit code (2: user error, 1: training failure), not the signal that ended the rest
            return max([code for code in codes.values() if code > 0], default=1)
        return 0
