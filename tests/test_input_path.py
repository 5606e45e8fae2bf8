"""The input path (unifit/frameworks/torch/input_path.py): in-memory data gathered a batch at a time gives
exactly the batches the per-sample DataLoader gave; the copy-ahead and on-device data run on a GPU (tests/gpu)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from unifit.frameworks.torch import data as tdata
from unifit.frameworks.torch.input_path import GatheredTensors, on_device, place_on_device


def _dataset(n: int = 53) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 2, generator=g), torch.randint(0, 5, (n,), generator=g))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_gathered_batches_equal_collated_samples_with_sharding_reshuffling_and_a_mid_epoch_skip(drop_last, workers):
    dataset = _dataset()
    options = dict(
        batch_size=4, world_size=2, rank=1, seed=3, drop_last=drop_last, num_workers=workers, pin_memory=False
    )
    loader = tdata.train_loader(dataset, **options)
    assert isinstance(loader.dataset, GatheredTensors) and loader.dataset.tensors[0] is dataset.tensors[0]
    for epoch, skip in ((0, 0), (1, 0), (1, 8)):  # a resumed epoch starts past the samples already seen
        loader.sampler.set_epoch(epoch, skip)
        reference = DataLoader(dataset, batch_size=4, sampler=list(loader.sampler), drop_last=drop_last)
        got, want = list(loader), list(reference)
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            assert type(a) is type(b) is list
            assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))


def test_validation_shards_are_gathered_too_and_datasets_of_their_own_are_kept():
    dataset = _dataset(37)
    loader = tdata.val_loader(dataset, batch_size=8, world_size=3, rank=2, num_workers=0, pin_memory=False)
    want = DataLoader(dataset, batch_size=8, sampler=list(range(2, 37, 3)))
    assert all(all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(loader, want, strict=True))

    class Own(TensorDataset):  # its own __getitem__ (an augmentation, say): read sample by sample as before
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return x * 2, y

    own = Own(*dataset.tensors)
    assert tdata.val_loader(own, batch_size=8, world_size=1, rank=0, num_workers=0, pin_memory=False).dataset is own


def test_on_cpu_nothing_is_placed_or_copied_ahead():
    loader = tdata.train_loader(
        _dataset(), batch_size=4, world_size=1, rank=0, seed=0, drop_last=False, num_workers=0, pin_memory=False
    )
    assert not place_on_device(loader.dataset, torch.device("cpu"), True, 0, "train_dataset()")
    assert loader.dataset.tensors[0].device.type == "cpu"
    batches = iter(loader)
    assert on_device(batches, loader, None, torch.device("cpu")) is batches
