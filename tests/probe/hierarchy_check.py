"""Run under torchrun as 2 nodes x 2 ranks: the smddp-like hook's gradients must equal flat DDP's.

Writes one JSON file per rank into $HIERARCHY_OUT (ranks writing one pipe at once can interleave their
lines): the largest absolute difference over every gradient.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from unifit.strategies import environment
from unifit.strategies.smddp import SMDDPLikeStrategy


def main() -> None:
    strategy = SMDDPLikeStrategy(environment.detect(), options={"bucket_cap_mb": 0.05})  # many small buckets
    strategy.setup()
    assert strategy._hook is not None, "the hierarchical hook must be active with 2 nodes x 2 ranks"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10)
    )
    flat = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.05)
    hierarchical = strategy.wrap_module(copy.deepcopy(model), torch.device("cpu"))
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + strategy.rank)  # every rank its own data
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        for net in (flat, hierarchical):
            net.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
        for a, b in zip(flat.parameters(), hierarchical.parameters()):
            worst = max(worst, float((a.grad - b.grad).abs().max()))
    buckets = len(list(hierarchical.module.parameters()))
    report = {"rank": strategy.rank, "nodes": strategy.topology.nodes, "max_abs_diff": worst, "params": buckets}
    Path(os.environ["HIERARCHY_OUT"], f"rank{strategy.rank}.json").write_text(json.dumps(report))
    dist.barrier()
    strategy.teardown()


if __name__ == "__main__":
    main()
