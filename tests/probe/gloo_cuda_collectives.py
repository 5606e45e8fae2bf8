"""Minimal reproduction (not a test): which collectives gloo runs on CUDA tensors, for share_gpus.

    torchrun --standalone --nproc-per-node 2 tests/probe/gloo_cuda_collectives.py {ar|list|into|rs|funcol}

Seen on an H100 with torch 2.11.0+cu130 (2026-11-26): all_reduce and all_gather (list) work; all_gather_into_tensor
and reduce_scatter_tensor print nothing; funcol.all_gather_tensor (what DTensor redistributes with, i.e. tensor
parallelism) dies with SIGSEGV in wait_tensor. fsdp's share_gpus path avoids them; model-parallel refuses
share_gpus with tensor_parallel."""

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

dist.init_process_group("gloo")
rank, device = dist.get_rank(), torch.device("cuda:0")
torch.cuda.set_device(device)
x = torch.full((4, 3), float(rank), device=device)


def all_reduce() -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y)
    return y


def all_gather_list() -> torch.Tensor:
    outs = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(outs, x)
    return torch.cat(outs)


def all_gather_into() -> torch.Tensor:
    out = torch.empty((8, 3), device=device)
    dist.all_gather_into_tensor(out, x)
    return out


def reduce_scatter() -> torch.Tensor:
    out = torch.empty((2, 3), device=device)
    dist.reduce_scatter_tensor(out, x)
    return out


def functional_all_gather() -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, dist.group.WORLD))


step = {"ar": all_reduce, "list": all_gather_list, "into": all_gather_into, "rs": reduce_scatter}
step["funcol"] = functional_all_gather
try:
    out = step[sys.argv[1]]()
    torch.cuda.synchronize()
    print(rank, sys.argv[1], "ok", out.flatten()[:8].tolist(), flush=True)
except Exception as exc:  # noqa: BLE001 - the point is to print what each collective does
    print(rank, sys.argv[1], "raised", type(exc).__name__, str(exc)[:200], flush=True)
dist.destroy_process_group()
