"""Sample-weighted metric averaging over ranks, simulated with a fake two-rank world."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from unifit.errors import ConfigError, DistributedError
from unifit.frameworks.metrics import MetricCollector, _agreed_kinds


class TwoRankWorld:
    """Plays both ranks: all_gather returns both ranks' (kinds, local values); all_reduce adds the other's sums.
    `other_keys`: a list of keys reduced by mean, or a dict key -> kind; `other_local`: its max/min/rank 0 values."""

    def __init__(self, other_keys, other_sums, other_local=None):
        kinds = other_keys if isinstance(other_keys, dict) else {key: "mean" for key in other_keys}
        self.other, self.other_sums = (kinds, other_local or {}), other_sums

    rank = 0

    def reports_metrics(self, rank):
        return True

    def all_gather_object(self, obj):
        return [obj, self.other]

    def all_reduce_sum(self, values):
        other = np.zeros_like(values)  # the other rank's sums; the last slot, samples trained on, stays 0
        other[: len(self.other_sums)] = self.other_sums
        return values + other


def _collector():
    return MetricCollector(lambda v: np.asarray(v, dtype=float))


def test_weighted_mean_is_exact_with_uneven_shards():
    rank0 = _collector()
    for value, count in [(1.0, 10), (3.0, 10), (2.0, 5)]:
        rank0.add("val/acc", value, count)
    # rank 1 logged one batch of 2 samples with value 10: sums (20, 2)
    world = TwoRankWorld(["val/acc"], np.array([20.0, 2.0]))
    result = rank0.reduce(world)
    assert result["val/acc"] == pytest.approx((10 + 30 + 10 + 20) / 27)
    assert rank0.last_total("val/acc") == 27


def test_rank_with_no_batches_may_log_nothing():
    idle = _collector()
    world = TwoRankWorld(["val/acc"], np.array([6.0, 3.0]))
    assert idle.reduce(world) == {"val/acc": 2.0}


def test_keys_reduced_in_sorted_order():
    collector = _collector()
    collector.add("b", 1.0, 1)
    collector.add("a", 5.0, 1)
    world = TwoRankWorld(["a", "b"], np.array([0.0, 0.0, 1.0, 1.0]))  # [a_sum, b_sum, a_n, b_n]
    assert collector.reduce(world) == {"a": 2.5, "b": 0.5}


def test_sum_max_min_and_rank_zero_only_reduce_as_lightning_with_sync_dist():
    """sum: every step of every rank, unweighted; max/min: over every step of every rank; rank_zero_only:
    rank 0's own (here weighted) mean, whatever the other ranks logged."""
    rank0 = _collector()
    for value, count in [(1.0, 4), (3.0, 2)]:
        rank0.add("n", value, count, "sum")
        rank0.add("hi", value, count, "max")
        rank0.add("lo", value, count, "min")
        rank0.add("mine", value, count, rank_zero_only=True)
    other = {"n": "sum", "hi": "max", "lo": "min"}  # rank 1 logs no rank_zero_only key: allowed
    world = TwoRankWorld(other, np.array([5.0, 1.0]), {"hi": 7.0, "lo": 0.5})  # [n_sum, n_count]
    assert rank0.reduce(world) == {"n": 9.0, "hi": 7.0, "lo": 0.5, "mine": pytest.approx(10 / 6)}


def test_a_key_reduced_two_ways_is_an_error():
    collector = _collector()
    collector.add("x", 1.0, 1)
    with pytest.raises(ConfigError, match=r"self.log\('x'\): logged with reduce_fx='mean' and now 'max'"):
        collector.add("x", 2.0, 1, "max")
    with pytest.raises(DistributedError, match=r"'x' was logged with different reductions on different ranks"):
        _agreed_kinds([{"x": "mean"}, {"x": "sum"}])


def test_key_on_some_ranks_only_is_an_error():
    with pytest.raises(DistributedError, match=r"'x' was logged on ranks \[0\] but not on ranks \[1\]"):
        _agreed_kinds([{"loss": "mean", "x": "mean"}, {"loss": "mean"}, {}])


def test_mid_epoch_state_keeps_the_reductions():
    collector = _collector()
    collector.add("hi", 2.0, 1, "max")
    resumed = _collector()
    resumed.load_state_dict(collector.state_dict())
    resumed.add("hi", 1.0, 1, "max")
    assert resumed.reduce(TwoRankWorld({}, np.zeros(0))) == {"hi": 2.0}


def _fit_then_validate(tmp_path, module: str, fit_with: str, validate_with: list[tuple[str, str, list[str]]]):
    """Fit one epoch with `fit_with` (2 processes), then validate its last checkpoint with each strategy:
    the fit's final metrics and each validation's, by where they came from."""
    import json

    from tests.helpers import assert_ok, run_unifit

    experiment = tmp_path / "exp.yaml"
    experiment.write_text(f"""
module: {{class_path: {module}}}
trainer: {{max_epochs: 1, batch_size: 8, root_dir: {tmp_path / "run"}, progress_bar: false}}
""")
    assert_ok(run_unifit("launch", "--nproc-per-node", "2", "-c", str(experiment), "--trainer.strategy", fit_with))
    found = {f"fit under {fit_with}": json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])}
    for strategy, procs, options in validate_with:
        assert_ok(
            run_unifit(
                "launch",
                "--nproc-per-node",
                procs,
                "-c",
                str(experiment),
                "--trainer.strategy",
                strategy,
                *options,
                "--run",
                "validate",
                "--ckpt-path",
                "last",
            )
        )
        found[strategy] = json.loads((tmp_path / "run" / "validate.json").read_text())["metrics"]
    return found


STATEFUL = {  # test -> (module, fit under, validated under)
    "test_stateful_metrics_are_exact_over_uneven_shards": (
        "tests.probe.metrics_probe.MetricsProbe",
        "ddp",
        [("single", "1", []), ("horovod", "2", [])],
    ),
    "test_keras_stateful_metrics_are_exact_over_uneven_shards": (
        "tests.probe.keras_metrics_probe.KerasMetricsProbe",
        "mwms",
        [("single", "1", []), ("mirrored", "1", ["--trainer.strategy_options", "{devices: 2}"]), ("horovod", "2", [])],
    ),
}


@pytest.fixture(scope="module")
def stateful_runs(request, tmp_path_factory) -> dict:
    """Test name -> (root, what _fit_then_validate found, or its exception): the selected ones of the two
    sequences run side by side (a TensorFlow worker keeps about one core busy, gloo ranks wait on each other)."""
    from tests.helpers import at_most

    selected = sorted(
        {item.originalname for item in request.session.items if item.path == request.path} & set(STATEFUL)
    )
    roots = {name: tmp_path_factory.mktemp(name[5:25]) for name in selected}
    jobs = [functools.partial(_fit_then_validate, roots[name], *STATEFUL[name]) for name in selected]
    return {name: (roots[name], got) for name, got in zip(selected, at_most(2, jobs), strict=True)}


def _stateful(stateful_runs: dict, name: str):
    root, found = stateful_runs[name]
    if isinstance(found, BaseException):
        raise found
    return root, found


@pytest.mark.launch
@pytest.mark.timeout(600)  # the first of the two runs both sequences side by side
def test_stateful_metrics_are_exact_over_uneven_shards(stateful_runs):
    """torchmetrics AUROC and F1 (not means) logged as objects: 37 validation samples over 2 ranks give
    the value over all of them, in fit under ddp and in validate under horovod and single."""
    import json

    import torch
    from sklearn.metrics import f1_score, roc_auc_score

    from tests.probe.metrics_probe import MetricsProbe, _data

    tmp_path, found = _stateful(stateful_runs, "test_stateful_metrics_are_exact_over_uneven_shards")
    # the reference: the checkpoint's predictions on all 37 samples, scored at once
    module = MetricsProbe()
    last = json.loads((tmp_path / "run" / "checkpoints" / "last.json").read_text())["name"]
    state = torch.load(tmp_path / "run" / "checkpoints" / last / "state.pt", weights_only=False)
    module.load_state_dict(state["engine"]["model"])
    x, y = _data(37, seed=2)
    with torch.no_grad():
        probs = torch.sigmoid(module.net(x).squeeze(1)).numpy()
    expected = {"val/auroc": roc_auc_score(y.numpy(), probs), "val/f1": f1_score(y.numpy(), probs > 0.5)}
    for where, metrics in found.items():
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(value, abs=1e-6), (where, name)


@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(600)
def test_keras_stateful_metrics_are_exact_over_uneven_shards(stateful_runs):
    """keras.metrics AUC and Precision from KerasModule.stateful_metrics(): 37 validation samples over 2
    workers (mwms fit, horovod validate) or 2 replicas (mirrored) give the one-process value."""
    _, found = _stateful(stateful_runs, "test_keras_stateful_metrics_are_exact_over_uneven_shards")
    reference = found.pop("single")  # one process, all 37 samples at once
    assert 0.5 < reference["val/auc"] < 1.0 and 0.0 < reference["val/precision"] <= 1.0
    for where, metrics in found.items():
        for name in ("val/auc", "val/precision"):
            assert metrics[name] == pytest.approx(reference[name], abs=1e-6), (where, name)


def test_a_stateful_metric_resumed_mid_epoch_covers_the_whole_epoch(tmp_path):
    """A torchmetrics object's state is part of a mid-epoch checkpoint: the epoch's AUROC after a resume
    at batch 3 of 8 equals the uninterrupted run's (without it, only batches 4-8 would count)."""
    import torch

    from tests.probe.metrics_probe import StopAt, TrainMetricsProbe
    from unifit import Trainer

    def trainer(root, *callbacks):
        return Trainer(
            max_epochs=1,
            batch_size=8,
            root_dir=str(root),
            progress_bar=False,
            seed=0,
            checkpoint={"every_n_steps": 3},
            callbacks=list(callbacks),
        )

    torch.manual_seed(0)
    whole = trainer(tmp_path / "whole").fit(TrainMetricsProbe()).metrics["train/auroc"]
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        trainer(tmp_path / "part", StopAt(4)).fit(TrainMetricsProbe())
    torch.manual_seed(1)  # the weights come from the checkpoint
    resumed = trainer(tmp_path / "part").fit(TrainMetricsProbe(), ckpt_path="last").metrics["train/auroc"]
    assert resumed == pytest.approx(whole, abs=1e-12)


@pytest.mark.tf
def test_keras_metric_state_merges_into_a_fresh_metric():
    """KerasMetricValue.state() survives JSON (a Keras checkpoint's state.json) and merge() adds it back."""
    import json

    import keras

    from unifit.frameworks.keras.stateful import KerasMetricValue

    y = np.array([0, 1, 1, 0, 1, 0, 1, 1], np.float32)
    p = np.array([0.1, 0.8, 0.4, 0.3, 0.9, 0.6, 0.7, 0.2], np.float32)
    whole = keras.metrics.AUC()
    whole.update_state(y, p)
    first, second = KerasMetricValue(keras.metrics.AUC(), "m"), KerasMetricValue(keras.metrics.AUC(), "m")
    first.update(y[:3], p[:3])
    second.update(y[3:], p[3:])
    second.merge(json.loads(json.dumps(first.state())))
    assert float(second.metric.result()) == pytest.approx(float(whole.result()), abs=1e-7)
