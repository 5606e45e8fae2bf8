"""Hand the launch to torchrun (torch.distributed.run); unifit starts no cluster of its own."""

from __future__ import annotations

import sys

from unifit.strategies.launchers.base import LaunchSpec, Launcher, fit_command


class TorchrunLauncher(Launcher):
    def command(self, spec: LaunchSpec) -> list[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(spec.nproc_per_node)]
        if spec.nnodes == 1 and not (spec.rdzv_endpoint or spec.master_addr):
            cmd.append("--standalone")  # a free local port, no rendezvous server to run
        else:
            cmd += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank)]
            if spec.rdzv_endpoint:
                cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", spec.rdzv_endpoint]
            if spec.master_addr:
                cmd += ["--master-addr", spec.master_addr]
            if spec.master_port:
                cmd += ["--master-port", str(spec.master_port)]
        return [*cmd, *fit_command(spec)]
