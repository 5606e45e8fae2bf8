"""Pick the torch device for this process: the GPU its strategy names (one per process, by local rank), else the CPU."""

from __future__ import annotations

from typing import Any

from unifit.errors import ConfigError


def torch_device(accelerator: str, index: int) -> Any:
    import torch

    has_gpu = torch.cuda.is_available()
    if accelerator == "gpu" and not has_gpu:
        raise ConfigError("trainer.accelerator: received 'gpu', but torch sees no CUDA device; use 'auto' or 'cpu'")
    if accelerator == "cpu" or not has_gpu:
        return torch.device("cpu")
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"local rank {index} has no GPU ({torch.cuda.device_count()} visible); "
            "start at most one process per GPU (--nproc-per-node); to test several ranks on one GPU (slower than "
            "one GPU each), ddp, smddp-like and fsdp take trainer.strategy_options '{share_gpus: true}'"
        )
    torch.cuda.set_device(index)  # pin before any CUDA work, as torch's DDP guide does
    return torch.device("cuda", index)


def gpus_visible() -> int:
    """The CUDA devices this process may use (0 without a CUDA build or driver), without initialising CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
