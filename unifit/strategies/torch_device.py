"""Pick the torch device for this process: one GPU per process by local rank, else the CPU."""

from __future__ import annotations

from typing import Any

from unifit.errors import ConfigError


def torch_device(accelerator: str, local_rank: int) -> Any:
    import torch

    has_gpu = torch.cuda.is_available()
    if accelerator == "gpu" and not has_gpu:
        raise ConfigError("trainer.accelerator: received 'gpu', but torch sees no CUDA device; use 'auto' or 'cpu'")
    if accelerator == "cpu" or not has_gpu:
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
            "start at most one process per GPU (--nproc-per-node)"
        )
    torch.cuda.set_device(local_rank)  # pin before any CUDA work, as torch's DDP guide does
    return torch.device("cuda", local_rank)
