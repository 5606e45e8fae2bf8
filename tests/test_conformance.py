"""The strategy conformance suite: every strategy, started by its own launcher, must pass it.

Later strategies join by adding their row to helpers.STRATEGIES. Exact resume per strategy is proved from a harder
point in tests/test_long_jobs.py (preempted mid-epoch, the same curve and bit-identical weights as this suite's
shared run); resuming a finished run with more epochs, in tests/test_precision.py, test_fsdp.py and the Keras tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import StrategyCase, metrics_lines, reports, selected_params, strategy_params

pytestmark = pytest.mark.launch

N_TRAIN, N_VAL = 64, 37


@pytest.fixture(scope="module", params=strategy_params())
def trained(request, reference_run) -> tuple[StrategyCase, Path]:
    """One 3-epoch probe run per strategy, shared by the checks below (and by tests/test_long_jobs.py); the first
    makes every selected strategy's, two at a time."""
    reference_run.prefetch(selected_params(request, "trained") or [request.param])
    return request.param, reference_run(request.param)


@pytest.mark.timeout(240)
def test_every_rank_reported(trained):
    case, root = trained
    got = reports(root)
    assert [r["rank"] for r in got] == list(range(case.nproc))
    assert all(r["world_size"] == case.nproc for r in got)


@pytest.mark.timeout(240)
def test_train_shards_are_disjoint_and_cover_each_epoch(trained):
    case, root = trained
    got = reports(root)
    for epoch in range(3):
        shards = [r["seen"][f"train_epoch_{epoch}"] for r in got]
        flat = [i for shard in shards for i in shard]
        assert sorted(flat) == list(range(N_TRAIN)), f"epoch {epoch}: shards do not cover the data exactly once"
    if len(got) > 1:  # reshuffled each epoch
        assert got[0]["seen"]["train_epoch_0"] != got[0]["seen"]["train_epoch_1"]
    by_replica = got[0]["seen_by_replica"]
    if case.replicas > case.nproc:  # several replicas in one process: each its own part
        parts = [set(by_replica[f"train_epoch_0/replica{r}"]) for r in range(case.replicas)]
        assert all(parts) and not set.intersection(*parts)


@pytest.mark.timeout(240)
def test_validation_shards_are_disjoint_and_uneven_shards_average_exactly(trained):
    _, root = trained
    got = reports(root)
    per_rank_val = [len(r["seen"]["val"]) // 3 for r in got]  # validated after each of 3 epochs
    assert sum(per_rank_val) == N_VAL
    seen = sorted(i for r in got for i in r["seen"]["val"][: per_rank_val[r["rank"]]])
    assert seen == list(range(N_VAL))
    metrics = got[0]["metrics"]
    assert metrics["val/index_mean"] == pytest.approx((N_VAL - 1) / 2, abs=1e-12)
    expected = sum((rank + 1) * n for rank, n in enumerate(per_rank_val)) / N_VAL
    assert metrics["val/rank_plus_one"] == pytest.approx(expected, abs=1e-12)


@pytest.mark.timeout(240)
def test_weights_and_metrics_identical_on_all_ranks(trained):
    _, root = trained
    got = reports(root)
    assert len({r["weights_sha256"] for r in got}) == 1
    assert all(r["replicas_identical"] for r in got)
    assert all(r["metrics"] == got[0]["metrics"] for r in got)
    assert all(r["global_step"] == got[0]["global_step"] for r in got)


@pytest.mark.timeout(240)
def test_only_rank_zero_wrote_files(trained):
    case, root = trained
    ckpts = sorted(p.name for p in (root / "checkpoints").iterdir())
    steps = 8 // case.replicas  # 64 samples, batch 8 per replica
    assert ckpts == [f"epoch={e:04d}-step={e * steps:07d}" for e in (1, 2, 3)] + ["last.json"]
    events = list((root / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, events
    assert len(metrics_lines(root)) == 3
    assert (root / "config.yaml").is_file()


@pytest.mark.timeout(240)
def test_tensorboard_holds_epoch_and_step_scalars(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, root = trained
    acc = EventAccumulator(str(root / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "val/loss", "lr", "throughput/samples_per_s", "train/loss_step", "lr_step"} <= tags
    lines = metrics_lines(root)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [line["step"] for line in lines]
    assert [e.value for e in loss] == pytest.approx([line["train/loss"] for line in lines], rel=1e-6)
