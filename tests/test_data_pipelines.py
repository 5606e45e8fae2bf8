"""Real data pipelines: an IterableDataset is dealt to ranks and loader workers by whole batches, in
stream order; every rank takes the same number of full batches per epoch; validation takes them all."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import assert_ok, launch_probe, reports
from unifit.errors import ConfigError
from unifit.frameworks.torch.iterable import stream_loader


class Numbers(torch.utils.data.IterableDataset):
    def __init__(self, n: int, with_len: bool = True) -> None:
        self.n, self.with_len = n, with_len

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        if not self.with_len:
            raise TypeError("no length")
        return self.n


def _epoch(stream, rank: int, train: bool, workers: int = 0, limit=None, skip: int = 0) -> list[list[int]]:
    loader = stream_loader(
        stream,
        "train_dataset()",
        batch_size=4,
        world_size=2,
        rank=rank,
        train=train,
        limit=limit,
        num_workers=workers,
        pin_memory=False,
    )
    loader.dataset.set_epoch(0, skip)
    return [batch.tolist() for batch in loader]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_stream_batches_by_rank_and_worker_in_order(workers):
    stream = Numbers(23)  # 5 full batches of 4 and 3 left over; 2 ranks
    rank0, rank1 = (_epoch(stream, r, train=True, workers=workers) for r in (0, 1))
    assert rank0 == [[0, 1, 2, 3], [8, 9, 10, 11]] and rank1 == [[4, 5, 6, 7], [12, 13, 14, 15]]  # 2 full batches each
    assert _epoch(stream, 0, train=True, workers=workers, skip=1) == [[8, 9, 10, 11]]  # a mid-epoch resume
    val0, val1 = (_epoch(stream, r, train=False, workers=workers) for r in (0, 1))
    assert sorted(x for b in val0 + val1 for x in b) == list(range(23))  # validation: every element once
    assert val1[-1] == [20, 21, 22]  # the last, partial batch too


def test_a_stream_without_length_needs_limit_train_batches():
    with pytest.raises(ConfigError, match="has no __len__.*trainer.limit_train_batches"):
        _epoch(Numbers(23, with_len=False), 0, train=True)
    assert _epoch(Numbers(23, with_len=False), 0, train=True, limit=1) == [[0, 1, 2, 3]]
    with pytest.raises(ConfigError, match="ended after 3 batches on rank 0.*takes 4"):  # batches 0, 2, 4 are rank 0's
        _epoch(Numbers(23, with_len=False), 0, train=True, limit=4)


@pytest.mark.launch
@pytest.mark.timeout(180)
def test_streams_train_and_validate_under_ddp_with_loader_workers(tmp_path):
    result = launch_probe(
        "ddp",
        tmp_path,
        "--module.class_path",
        "tests.probe.probe.StreamProbe",
        "--trainer.num_workers",
        "2",
        "--trainer.max_epochs",
        "2",
    )
    assert_ok(result)
    ranks = reports(tmp_path)
    epoch = [r["seen"]["train_epoch_0"] for r in ranks]
    assert len(epoch[0]) == len(epoch[1]) == 32  # 64 samples, batch 8: 4 full batches per rank
    assert not set(epoch[0]) & set(epoch[1]) and sorted(epoch[0] + epoch[1]) == list(range(64))
    assert len({r["weights_sha256"] for r in ranks}) == 1
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["val/index_mean"] == pytest.approx(18.0)  # all 37 validation samples, each once
