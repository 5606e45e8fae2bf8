"""Keep the device fed: in-memory data gathered a batch at a time (on the host, or on the device itself when it
fits), and on CUDA each batch copied to the device ahead of use, on a side stream, while the step before computes.

Why: a DataLoader over a TensorDataset indexes and collates one sample at a time, which is the host time a small
GPU step waits for; and a copy issued just before the step that needs it leaves the GPU idle while it runs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import TensorDataset

log = logging.getLogger("unifit")

DEVICE_SHARE = 0.25  # in-memory data goes onto the device (data_on_device: auto) when it takes at most this share
# of the device memory free at set-up


class GatheredTensors(TensorDataset):
    """A TensorDataset read one batch at a time: one indexing operation per tensor instead of a sample at a time
    through collate. The same values in the same layout as default_collate gives (a list of batched tensors)."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        first = self.tensors[0]
        index = torch.as_tensor(indices)
        if first.is_cuda:  # the data lives on the device: the indices go there without waiting for it
            index = index.pin_memory().to(first.device, non_blocking=True)
        return [tensor[index] for tensor in self.tensors]


def batched(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The collate_fn of a GatheredTensors loader: its batches come gathered already."""
    return batch


def gathered(dataset: Any) -> Any:
    """`dataset` read a batch at a time where it is a plain TensorDataset (a subclass may have its own
    __getitem__: it is kept as it is)."""
    return GatheredTensors(*dataset.tensors) if type(dataset) is TensorDataset else dataset


def place_on_device(dataset: Any, device: torch.device, setting: str | bool, num_workers: int, what: str) -> bool:
    """Move a GatheredTensors' tensors onto `device` (setting True, or "auto" where they fit in DEVICE_SHARE of its
    free memory), so batches are gathered there and never copied; the decision is logged. True where moved."""
    if device.type != "cuda" or not isinstance(dataset, GatheredTensors) or setting is False:
        return False
    size = sum(tensor.numel() * tensor.element_size() for tensor in dataset.tensors)
    free = torch.cuda.mem_get_info(device)[0]
    if num_workers:
        why = f"trainer.num_workers is {num_workers} (worker processes cannot index device memory)"
    elif setting == "auto" and size > DEVICE_SHARE * free:
        why = f"it takes {size / 2**20:.0f} MiB, over {DEVICE_SHARE:.0%} of the {free / 2**20:.0f} MiB free"
    else:
        dataset.tensors = tuple(tensor.to(device) for tensor in dataset.tensors)
        log.info("%s: %.1f MiB of tensors placed on %s; batches are gathered there", what, size / 2**20, device)
        return True
    log.info("%s: kept in host memory, copied a batch at a time: %s", what, why)
    return False


class ToDevice:
    """unifit's own way to a device: a plain copy, which may be issued ahead of the step that uses it (a module's
    own transfer hooks run in line, as Lightning runs them)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, batch: Any, dataloader_idx: int = 0) -> Any:
        return to_device(batch, self.device)


def on_device(
    batches: Iterable[Any],
    loader: Any,
    transfer: Callable[[Any, int], Any] | None,
    device: torch.device,
    index: int = 0,
) -> Iterable[Any]:
    """`loader`'s `batches` moved by `transfer` (None: they are where they should be). On CUDA unifit's own copy runs
    ahead on a side stream where fetching a batch early changes nothing: data gathered from in-memory tensors, or
    loaded by worker processes (which fetch ahead anyway). A dataset read in this process may draw on the global RNG
    (augmentations): fetched early, a resumed run would draw differently, so its batches are copied in line."""
    if transfer is None:
        return batches
    if isinstance(transfer, ToDevice) and device.type == "cuda" and _fetched_ahead_safely(loader):
        return copy_ahead(batches, transfer, device)
    return (transfer(batch, index) for batch in batches)


def _fetched_ahead_safely(loader: Any) -> bool:
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, GatheredTensors):
        return not dataset.tensors[0].is_cuda  # on the device already: nothing to copy
    return getattr(loader, "num_workers", 0) > 0


def copy_ahead(batches: Iterable[Any], transfer: Callable[[Any], Any], device: torch.device) -> Iterator[Any]:
    """The batches, each already on `device`: batch k+1's host-to-device copy is issued on a side stream before
    step k runs, so it overlaps that step. The step's stream waits for the copy, and each tensor is recorded on
    that stream so the allocator does not reuse its memory while the step still reads it. Holds one extra batch."""
    side = torch.cuda.Stream(device)

    def start(batch: Any) -> Any:
        with torch.cuda.stream(side):
            return transfer(batch)

    iterator = iter(batches)
    upcoming = next(iterator, _END)
    upcoming = _END if upcoming is _END else start(upcoming)
    while upcoming is not _END:
        current = upcoming
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(side)
        _record_on(current, compute)
        following = next(iterator, _END)
        upcoming = _END if following is _END else start(following)
        yield current


_END = object()


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def _record_on(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, torch.Tensor):
        if batch.is_cuda:
            batch.record_stream(stream)
    elif isinstance(batch, (tuple, list)):
        for part in batch:
            _record_on(part, stream)
    elif isinstance(batch, dict):
        for part in batch.values():
            _record_on(part, stream)
