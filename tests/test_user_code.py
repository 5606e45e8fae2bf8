"""Users' own code as written: a LightningModule's DataLoader sets the batch size, its own sampler or batch
sampler is kept and sharded over ranks, and what unifit cannot honour is refused in one line. In process and
fast; the same code under real launches is in tests/test_zoo.py (the LSTM demo's batch sampler under ddp,
fsdp and horovod)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, WeightedRandomSampler

import unifit
from unifit.errors import ConfigError
from unifit.frameworks.torch.user_samplers import ShardedBatchSampler, ShardedUserSampler

L = pytest.importorskip("lightning")


def _options(tmp_path) -> dict:
    return dict(
        root_dir=str(tmp_path), progress_bar=False, tensorboard={"enabled": False}, checkpoint={"enabled": False}
    )


def test_an_unchanged_boring_model_trains_with_its_dataloaders_batch_size(tmp_path, capsys):
    from lightning.pytorch.demos.boring_classes import BoringModel

    state = unifit.Trainer(strategy="single", max_epochs=1, **_options(tmp_path)).fit(BoringModel())
    assert state.progress.global_batch == 1 and state.progress.steps_per_epoch == 64  # DataLoader(..., 64 samples)
    assert "(batch_size 1 from the training DataLoader)" in capsys.readouterr().out
    with pytest.raises(ConfigError) as info:
        unifit.Trainer(strategy="single", max_epochs=1, batch_size=32, **_options(tmp_path / "b")).fit(BoringModel())
    message = str(info.value)
    assert "\n" not in message and "batch_size is 1 but trainer.batch_size is 32" in message, message


@pytest.mark.parametrize("world", [2, 3])
def test_a_weighted_sampler_is_drawn_once_and_split_between_ranks(world):
    weights = torch.rand(50, generator=torch.Generator().manual_seed(0))
    user = WeightedRandomSampler(weights, num_samples=50, replacement=True)
    shards = [
        ShardedUserSampler(user, "train_dataloader()", world_size=world, rank=r, seed=7, train=True)
        for r in range(world)
    ]
    drawn = [list(s) for s in shards]
    assert all(len(d) == len(shards[0]) == -(-50 // world) for d in drawn)  # equal shares: equal step counts
    single = list(ShardedUserSampler(user, "x", world_size=1, rank=0, seed=7, train=True))
    interleaved = [drawn[i % world][i // world] for i in range(50)]
    assert interleaved == single, "the ranks' shares together are not the one-process epoch"
    state = torch.random.get_rng_state()
    for s in shards:
        s.set_epoch(1)
    assert [list(s) for s in shards] != drawn  # a new epoch draws anew ...
    assert torch.equal(state, torch.random.get_rng_state())  # ... without moving the training's own generator
    shards[0].set_epoch(1, skip=3)
    assert list(shards[0]) == shards[0].indices[3:]  # a mid-epoch resume skips what was trained on


def test_a_batch_sampler_keeps_its_batches_whole_and_disjoint():
    user = BatchSampler(RandomSampler(range(40)), batch_size=4, drop_last=False)
    shards = [
        ShardedBatchSampler(user, "train_dataloader()", world_size=3, rank=r, seed=1, train=True) for r in range(3)
    ]
    batches = [list(s) for s in shards]
    assert all(len(b) == len(user) // 3 == 3 for b in batches)  # 10 batches over 3 ranks: 3 each, one unused
    flat = [i for rank in batches for batch in rank for i in batch]
    assert len(flat) == len(set(flat)) == 36 and all(len(batch) == 4 for rank in batches for batch in rank)
    evaluation = [
        ShardedBatchSampler(
            BatchSampler(SequentialSampler(range(40)), 4, False),
            "val_dataloader()",
            world_size=3,
            rank=r,
            seed=1,
            train=False,
        )
        for r in range(3)
    ]
    assert sorted(i for s in evaluation for b in s for i in b) == list(range(40))  # evaluation: every sample once
    with pytest.raises(ConfigError, match="gives 2 batches per epoch, fewer than the 3 ranks"):
        ShardedBatchSampler(
            BatchSampler(SequentialSampler(range(8)), 4, False),
            "train_dataloader()",
            world_size=3,
            rank=0,
            seed=1,
            train=True,
        )
