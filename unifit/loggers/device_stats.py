"""Device statistics for the loggers (Lightning's DeviceStatsMonitor): the memory allocator's statistics of the GPU
this process trains on, and the host's CPU, memory and swap use. Read on the host (allocator counters, psutil),
never from the device, so logging them does not wait for the GPU."""

from __future__ import annotations

import sys
from typing import Any


def device_stats(cpu_stats: bool | None) -> dict[str, float]:
    """Lightning's keys: torch.cuda.memory_stats() on a GPU, `cpu_percent`, `cpu_vm_percent` and `cpu_swap_percent`
    on CPU (`cpu_stats`: None, on CPU only; True, always; False, never)."""
    stats = _gpu_stats()
    if cpu_stats or (cpu_stats is None and not stats):
        stats.update(_cpu_stats())
    return stats


def _gpu_stats() -> dict[str, float]:
    torch: Any = sys.modules.get("torch")  # only where this process uses it: never imported here
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats(torch.cuda.current_device())
        return {key: float(value) for key, value in stats.items() if isinstance(value, (int, float))}
    tf: Any = sys.modules.get("tensorflow")
    if tf is not None and tf.config.list_logical_devices("GPU"):
        info = tf.config.experimental.get_memory_info("GPU:0")
        return {"allocated_bytes.all.current": float(info["current"]), "allocated_bytes.all.peak": float(info["peak"])}
    return {}


def _cpu_stats() -> dict[str, float]:
    import psutil

    return {
        "cpu_percent": float(psutil.cpu_percent()),
        "cpu_vm_percent": float(psutil.virtual_memory().percent),
        "cpu_swap_percent": float(psutil.swap_memory().percent),
    }
